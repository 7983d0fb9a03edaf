"""Doctor says what will run: its dry run against the record and the active line that the
real scheduler of the same release logs when the engine builds it (issue 28, item 3).

On 0.33+ only the block-unit rule installs: doctor must report it installed and engaging at
engine start, never "not needed", and the scheduler the engine builds must carry exactly
that. With a DFlash-like drafter group (tests/scheduler/test_drafter_block.py's set-up),
doctor run inside that process reads the built scheduler's record and says it engaged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from tests.active_line import parse_active
from tests.conftest import facts_of
from tests.scheduler.test_drafter_block import engine_core_source
from tools import sched_harness as harness
from tools.sched_harness import HarnessConfig
from vllm_mamba_fix import __version__, records
from vllm_mamba_fix.decide.policy import Rule
from vllm_mamba_fix.doctor import verdict
from vllm_mamba_fix.doctor.checks.schedulers import default_targets, dry_run
from vllm_mamba_fix.doctor.core import run as doctor_run
from vllm_mamba_fix.doctor.render import render_text
from vllm_mamba_fix.doctor.report import Report
from vllm_mamba_fix.install import plugin

BASE = "vllm.v1.core.sched.scheduler.Scheduler"
ALL_RULES = [r.value for r in Rule]  # the active line's order
_records: list[logging.LogRecord] = []  # what _vllm_log() collected last
SMALL = HarnessConfig(block_size=256, max_num_batched_tokens=384, encoder_cache_tokens=256,
                      max_model_len=2048)  # fmt: skip
DRAFTER = dataclasses.replace(SMALL, drafter_block_size=128, block_size_from_groups=True)


def _doctor() -> dict[str, Any]:
    report = doctor_run()
    report.data["text"] = render_text(report, 0.0)
    return report.data


def _active_line(log: list[str]) -> str:
    (line,) = [m for m in log if f" active: {BASE} carries" in m]
    return line


def _active_facts() -> dict[str, Any]:
    """The fields of the base's active record (the reasons and wraps are there, off the line)."""
    (found,) = [r for r in _records if " active: " in r.getMessage()]
    return facts_of(found)


@contextlib.contextmanager
def _vllm_log() -> Iterator[list[str]]:
    """Messages under the `vllm` logger. Attached after a first scheduler was built: the
    first build in a process may configure vLLM's logging again (0.34), dropping handlers."""
    harness.build_scheduler(SMALL)
    messages: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())
            _records.append(record)

    _records.clear()
    handler = _Collect(level=logging.DEBUG)
    logging.getLogger("vllm").addHandler(handler)
    try:
        yield messages
    finally:
        logging.getLogger("vllm").removeHandler(handler)


def test_doctor_says_what_the_built_scheduler_carries(vllm_version: str, load_plugin) -> None:
    before = _doctor()  # the dry run before the engine: patch, verify, undo
    assert not harness.split_is_wrapped()
    assert before["vllm"]["version"] == vllm_version
    installs = [r["rule"] for r in before["rules"] if r["installs"]]
    assert before["exit_code"] == 0, before["summary"]
    # Never "not needed" while a rule installs.
    assert (before["status"] == "not-needed") is (not installs), (before["status"], installs)

    with _vllm_log() as log:
        load_plugin()
        harness.build_scheduler(SMALL)
    line = _active_line(log)
    (built,) = [r for r in records() if r.scheduler_class == BASE]
    assert sorted(r.value for r in built.rules) == sorted(installs)
    parsed = parse_active(line)
    assert parsed is not None, line
    facts = _active_facts()
    for entry in before["rules"]:
        if entry["installs"]:  # the same rule, decided on the same basis, with the same reason
            assert facts["reasons"][entry["rule"]] == f"{entry['decided_by']}: {entry['reason']}"
        else:
            assert entry["rule"] not in parsed.rules, line
    # What doctor tells the operator to expect in the engine core's log.
    first = next(r for r in ALL_RULES if r in installs)
    assert line.startswith(f"vllm-mamba-fix {__version__} active: {BASE} carries {first}")
    assert list(parsed.rules) == [r for r in ALL_RULES if r in installs], line
    wraps = ", ".join(facts["wraps"])
    for method in before["dry_run"]["wrapped_methods"]:
        assert f"Scheduler.{method}" in wraps, (method, facts["wraps"])
    # Built with equal sizes the rule stays idle; doctor said it engages only where they differ.
    assert built.block is not None and not built.block.differs
    if before["policy"]["verdict"] == "installed-per-scheduler":
        assert "engages at engine start" in before["summary"]
        assert before["status"] == "protected"


def test_doctor_inside_the_engine_reads_the_built_schedulers_sizes(load_plugin) -> None:
    if "prefix_cacheable" not in engine_core_source():
        pytest.skip("the drafter's own block pulls cache_config.block_size down from 0.32")
    with _vllm_log() as vllm_log:
        load_plugin()
        harness.build_scheduler(DRAFTER)  # a drafter group pulls cache_config.block_size to 128
    (built,) = [r for r in records() if r.scheduler_class == BASE]
    assert (built.block.mamba, built.block.configured) == (256, 128)
    after = _doctor()
    block = next(r for r in after["rules"] if r["rule"] == "block-unit")
    assert block["needed"] is True
    facts = [f for f in block["block_facts"] if f["class"] == BASE]
    assert facts and facts[0]["engaged"] and facts[0]["block_size"] == 256
    assert after["status"] == "protected" and after["exit_code"] == 0
    sizes = "Mamba KV cache 256, cache_config.block_size 128 (differ, block-unit engaged)"
    assert f"{BASE}: {sizes}" in after["text"]
    engaged = [m for m in vllm_log if "block-unit rule engaged" in m]
    assert len(engaged) == 1 and "cache_config.block_size is 128" in engaged[0]


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"VLLM_MAMBA_FIX_SPLIT_RULE": "0"},
        {"VLLM_MAMBA_FIX_BLOCK_RULE": "0"},
        {"VLLM_MAMBA_FIX_STALL_SECONDS": "off"},
        {"VLLM_MAMBA_FIX": "force"},
    ],
)
def test_the_verdict_reads_the_same_from_the_engines_records_as_from_the_dry_run(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch, load_plugin
) -> None:
    """Issue 45 item 2: the verdict's one input is the install records; doctor's dry run
    makes the records the engine makes, so the verdict read from either is the same."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    dry = dry_run(Report(), None, default_targets([])[:1], plugin)
    assert not harness.split_is_wrapped()  # the dry run undid itself
    load_plugin()
    harness.build_scheduler(SMALL)
    engine = verdict.of_records(records())
    doctor = verdict.of_records(dry.records)
    assert engine.base is not None and doctor.base is not None
    assert (engine.needed, engine.installed, engine.planned, engine.release) == (
        doctor.needed, doctor.installed, doctor.planned, doctor.release,
    )  # fmt: skip
    assert dict(engine.needed_by) == dict(doctor.needed_by) == {}  # equal block sizes
    assert engine.base.block is not None and doctor.base.block is None  # only the engine built
    # A rule switched off by a setting is still needed where the release needs it.
    split = engine.base.plan.verdict(Rule.SPLIT)
    if env.get("VLLM_MAMBA_FIX_SPLIT_RULE") == "0":
        assert not split.active and Rule.SPLIT not in engine.installed
    assert (Rule.SPLIT in engine.needed) is split.by_release.active
