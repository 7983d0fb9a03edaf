"""The verdict (doctor/verdict.py): what a release needs and the status, from the command line
and from the install records; the plugin's log never decides it."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.doctor.conftest import (
    BACKPORT_CODE,
    ENCODER_CHANGED,
    SPLIT_CHANGED,
    _doctor,
    _fake_run,
    _fake_vllm,
    _run,
)
from vllm_mamba_fix.decide.policy import Rule
from vllm_mamba_fix.doctor import verdict
from vllm_mamba_fix.facts.config import ENV_SPLIT_RULE, Mode, Settings
from vllm_mamba_fix.facts.evidence import Evidence
from vllm_mamba_fix.facts.targets import SPLIT_METHOD
from vllm_mamba_fix.facts.versions import family_for
from vllm_mamba_fix.observe.record import ClassRecord, MethodRecord, MethodState
from vllm_mamba_fix.rules.table import plan


@pytest.mark.parametrize(
    ("vllm_version", "family", "status", "needle"),
    [
        # Only the block-unit rule installs there: what runs is said, never "not needed".
        ("0.33.0", "0.33+", "protected", "vLLM 0.33.0 needs no rule by its code or version"),
        ("0.14.1", "<0.15", "not-needed", "no Scheduler."),
    ],
)
def test_unaffected_release_is_not_needed(
    tmp_path: Path, vllm_version: str, family: str, status: str, needle: str
) -> None:
    run = _fake_run(tmp_path, vllm_version, "--json")
    assert run.code == 0, run.err
    data = run.json()
    assert (data["status"], data["family"]["name"]) == (status, family)
    assert needle in data["summary"]


@pytest.mark.parametrize(
    ("vllm_version", "args", "code", "result"),
    [
        ("0.33.0", (), 0, "result: NOT NEEDED"),
        ("0.30.0", (), 1, "result: NOT PROTECTED"),  # the speculative-stall rule is off
        # ... unless the set-up is not EAGLE-type, so the stall cannot arise.
        ("0.30.0", ("--speculative-config", '{"method": "ngram"}'), 0, "result: NOT NEEDED"),
    ],
)
def test_disabled_is_fine_only_where_nothing_is_needed(
    tmp_path: Path, vllm_version: str, args: tuple[str, ...], code: int, result: str
) -> None:
    site = _fake_vllm(tmp_path / "site", vllm_version)
    run = _run(_doctor(*args), {"PYTHONPATH": str(site), "VLLM_MAMBA_FIX": "off"})
    assert run.code == code, run.out + run.err
    assert result in run.out


# Runs doctor with the plugin's log silenced and nothing captured: the verdict must not change.
_SILENT_DOCTOR = """\
import sys
from vllm_mamba_fix._log import logger
from vllm_mamba_fix.doctor import report
report.LogCapture.emit = lambda self, record: None
logger.disabled = True
from vllm_mamba_fix.doctor import main
raise SystemExit(main(["doctor", "--json", *sys.argv[1:]]))
"""


@pytest.mark.parametrize(
    ("vllm_version", "fake", "code", "status", "needle"),
    [
        ("0.25.1", {}, 0, "protected", None),
        ("0.27.1", {"signature": SPLIT_CHANGED}, 1, "not-protected", "unexpected signature"),
        ("0.32.0", {"encoder": ENCODER_CHANGED}, 1, "not-protected", "unexpected signature"),
        ("0.27.1", {"code": BACKPORT_CODE}, 0, "protected", None),
    ],
)
def test_verdict_does_not_depend_on_the_plugin_log(
    tmp_path: Path,
    vllm_version: str,
    fake: dict[str, str],
    code: int,
    status: str,
    needle: str | None,
) -> None:
    site = _fake_vllm(tmp_path / "site", vllm_version, **fake)
    silent = _run([sys.executable, "-c", _SILENT_DOCTOR], {"PYTHONPATH": str(site)})
    heard = _run(_doctor("--json"), {"PYTHONPATH": str(site)})
    quiet, loud = silent.json(), heard.json()
    assert quiet["dry_run"]["log"] == [] and loud["dry_run"]["log"]  # the silencing worked
    assert (silent.code, quiet["status"]) == (heard.code, loud["status"]) == (code, status)
    assert quiet["problems"] == loud["problems"]
    if needle is not None:
        assert needle in quiet["problems"][0]


BASE = "vllm.v1.core.sched.scheduler.Scheduler"


def _record(
    vllm_version: str,
    settings: Settings | None = None,
    evidence: Evidence | None = None,
    name: str = BASE,
) -> ClassRecord:
    """An install record as register() writes it: the plan, and a wrapper carrying its rules."""
    chosen = plan(settings or Settings(), family_for(vllm_version), evidence or Evidence())
    wrapper = MethodRecord(SPLIT_METHOD, MethodState.WRAPPED, name, rules=chosen.rules)
    return ClassRecord(name, chosen, evidence or Evidence(), (wrapper,))


def _setup(vllm_version: str, should_patch: bool = True, **more: Any) -> verdict.Setup:
    family = family_for(vllm_version)
    by_version = plan(Settings(), family, Evidence())
    return verdict.Setup(family, vllm_version, should_patch, "", by_version, **more)


def test_the_verdict_reads_one_input_the_records() -> None:
    """Issue 45 item 2: what runs and what the release needs come from the records alone."""
    assert list(inspect.signature(verdict.of_records).parameters) == ["records"]
    found = verdict.of_records([_record("0.32.0")])
    assert found.needed == {Rule.SPECULATIVE_STALL}
    assert verdict.needed_rules(found, _setup("0.32.0")) == {Rule.SPECULATIVE_STALL}
    spared = _setup("0.32.0", not_eagle="ngram")
    assert verdict.needed_rules(found, spared) == frozenset()
    # A class with a schedule() of its own that budgets encoder inputs first needs the split.
    own = Evidence(split_after_encoder=True, schedule_owner="PlatformScheduler")
    mine = _record("0.32.0", evidence=own, name="pkg.PlatformScheduler")
    by_class = verdict.of_records([_record("0.32.0"), mine])
    assert by_class.needed_by == {Rule.SPLIT: ("pkg.PlatformScheduler",)}
    assert verdict.needed_rules(by_class, _setup("0.32.0")) == {Rule.SPLIT, Rule.SPECULATIVE_STALL}
    # A switched-off rule does not run, and its record still says the release needs it.
    off = verdict.of_records(
        [_record("0.27.1", Settings(switched_off=frozenset({ENV_SPLIT_RULE})))]
    )
    assert Rule.SPLIT not in off.installed and Rule.SPLIT in off.needed
    # No record (the base class could not be loaded): the release data decides.
    nothing = verdict.of_records(())
    assert verdict.needed_rules(nothing, _setup("0.27.1")) == {Rule.SPLIT, Rule.SPECULATIVE_STALL}
    # An unreadable version: needed only where forced (should_patch).
    unknown = verdict.of_records([_record("not-a-version")])
    assert verdict.needed_rules(unknown, _setup("not-a-version", False)) == frozenset()
    assert verdict.needed_rules(unknown, _setup("not-a-version", True)) == {Rule.SPLIT}


def test_problems_and_status_from_typed_inputs() -> None:
    found = verdict.of_records([_record("0.27.1")])
    chosen = verdict.policy(found, _setup("0.27.1", False))
    assert chosen.verdict == "needed-will-not-patch"
    delivery = verdict.Delivery(Mode.OFF, "0", "no entry point", False, "other")
    rule_problems = {Rule.SPLIT: "split would not apply: x"}
    found_problems = verdict.problems(chosen, delivery, rule_problems, ("class y",))
    assert found_problems == [
        "disabled by VLLM_MAMBA_FIX='0'",
        "no entry point",
        "VLLM_PLUGINS='other' does not list 'mamba_fix'; vLLM will not load the plugin",
        "split would not apply: x",
        "class y",
    ]
    assert verdict.status(chosen, [], found_problems) == "not-protected"
    assert verdict.status(chosen, ["bad"], found_problems) == "invalid-input"
    ok = verdict.Delivery(Mode.AUTO, None, None, True, None)
    will = verdict.policy(found, _setup("0.27.1"))
    assert verdict.problems(will, ok, {}, ()) == []
    assert verdict.status(will, [], []) == "protected"
    assert verdict.status(None, [], []) == "unknown"
    # 0.33: the block-unit rule installs (a per-scheduler rule): protected, never "not needed".
    fixed = verdict.of_records([_record("0.33.0")])
    runs = verdict.policy(fixed, _setup("0.33.0"))
    assert (runs.verdict, verdict.status(runs, [], [])) == ("installed-per-scheduler", "protected")
    assert "installed: block-unit [version: " in runs.reason
    assert verdict.status(runs, [], ["x"]) == "not-protected"
    # ... unless the plugin will not act at all (VLLM_MAMBA_FIX=0), or vLLM will not load it.
    off = verdict.policy(fixed, _setup("0.33.0", False))
    assert (off.verdict, verdict.status(off, [], [])) == ("not-needed", "not-needed")
    unloaded = verdict.policy(fixed, _setup("0.33.0", delivered=False))
    assert unloaded.verdict == "not-needed"
