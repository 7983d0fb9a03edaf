"""The rules check (verdict.rule_entries in doctor/verdict.py): per rule of the table,
what the version says, what the code evidence says, which decided, and the block-unit rule's
block facts."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests.doctor.conftest import (
    _VLLM,
    BACKPORT_CODE,
    PRE_FIX_CODE,
    REPO,
    UPDATE_CODE,
    Run,
    _fake_run,
    _needed_by_version,
    _rules,
    _run,
    needs_affected_vllm,
)
from vllm_mamba_fix.doctor import FALLBACK_METHODS


@needs_affected_vllm
def test_both_evidences_are_shown_and_the_code_decides(real: dict[str, Run]) -> None:
    data = real["json"].json()
    evidence = data["evidence"]
    assert evidence["read_from"] == "vllm.v1.core.sched.scheduler.Scheduler"
    assert evidence["split_after_encoder"] is True  # every affected release: the matrix agrees
    rules = {r["rule"]: r for r in data["rules"]}
    # The rule table's order; block-unit and stall-end were added to it (issues 20, 21).
    assert list(rules) == [
        "split", "block-unit", "speculative-stall", "stall-watchdog", "stall-end",
    ]  # fmt: skip
    split = rules["split"]
    assert split["version"]["active"] is split["code"]["active"] is True
    assert (split["decided_by"], split["active"], split["installs"]) == ("code", True, True)
    speculative = rules["speculative-stall"]
    assert speculative["active"] is ("speculative-stall" in _needed_by_version(_VLLM))
    assert speculative["version"]["active"] is speculative["active"]
    watchdog = rules["stall-watchdog"]
    assert (watchdog["decided_by"], watchdog["active"], watchdog["needed"]) == (
        "setting",
        True,
        None,
    )
    # Before the engine starts, the speculative set-up is invisible; the list is the release's.
    spec = data["speculative"]
    assert spec["visible"] is False and spec["eagle_type"] is None
    assert spec["eagle_methods_from"] == "vllm.config.speculative (use_eagle)"
    if _VLLM == "0.27.1":
        assert spec["eagle_methods"] == list(FALLBACK_METHODS.eagle)


@pytest.mark.parametrize(
    ("vllm_version", "family", "needed", "wrapped"),
    [
        ("0.25.1", "0.24", ["split", "speculative-stall"], 3),
        # 0.28-0.32: upstream fixed the split, not the speculative stall. The split is still
        # wrapped, for the block-unit rule (vLLM #54076), on every release that has it.
        ("0.32.0", "0.28", ["speculative-stall"], 3),
    ],
)
def test_fake_affected_release_is_protected(
    tmp_path: Path, vllm_version: str, family: str, needed: list[str], wrapped: int
) -> None:
    # With update_from_output, the watchdog's carrier (and the stall end's): three wrapped.
    data = _fake_run(tmp_path, vllm_version, "--json", code=UPDATE_CODE).json()
    assert (data["status"], data["exit_code"], data["family"]["name"]) == ("protected", 0, family)
    assert data["policy"]["needed_rules"] == needed
    assert data["dry_run"]["patched"] and data["dry_run"]["restored"]
    assert len(data["dry_run"]["wrapped_methods"]) == wrapped
    # No code to read in the fake: the version decides, and the report says so.
    assert data["evidence"]["split_after_encoder"] is None and data["evidence"]["problem"]
    rules = _rules(data)
    assert [rules[r]["decided_by"] for r in needed] == ["version"] * len(needed)
    assert all(rules[r]["code"]["active"] is None for r in rules)
    assert rules["stall-watchdog"]["active"] and rules["stall-watchdog"]["installs"]


def test_code_evidence_patches_a_pre_fix_dev_build(tmp_path: Path) -> None:
    run = _fake_run(tmp_path, "0.28.0.dev3", "--json", code=PRE_FIX_CODE)
    assert run.code == 0, run.err
    data = run.json()
    assert data["status"] == "protected"
    assert "needs split (by code) and speculative-stall (by code)" in data["policy"]["reason"]
    assert data["evidence"]["split_after_encoder"] is True
    split = _rules(data)["split"]
    assert "the version alone would have left it (a pre-fix build)" in split["reason"]
    assert (split["version"]["active"], split["code"]["active"]) == (False, True)


def test_code_evidence_leaves_a_backport_alone(tmp_path: Path) -> None:
    data = _fake_run(tmp_path, "0.27.1", "--json", code=BACKPORT_CODE).json()
    # The block-unit rule still installs, so never "not needed": it engages at engine start.
    assert (data["status"], data["exit_code"]) == ("protected", 0)
    assert data["policy"]["verdict"] == "installed-per-scheduler"
    assert data["evidence"]["split_after_encoder"] is False
    assert data["evidence"]["deferred_encoder_free"] is False
    rules = _rules(data)
    for name in ("split", "speculative-stall"):
        assert rules[name]["version"]["active"] is True and rules[name]["code"]["active"] is False
        assert (rules[name]["decided_by"], rules[name]["active"]) == ("code", False)
    assert "the version alone would have patched (a backport)" in data["summary"]
    # Only the block-unit rule's wrapper: a backport still floors to cache_config.block_size.
    assert data["dry_run"]["wrapped_methods"] == ["_mamba_block_aligned_split"]
    assert _rules(data)["block-unit"]["installs"] is True
    assert _rules(data)["block-unit"]["needed"] is None  # no scheduler built: cannot tell


def test_block_rule_on_0_33_is_installed_and_engages_at_engine_start(tmp_path: Path) -> None:
    run = _fake_run(tmp_path, "0.33.0")
    assert run.code == 0, run.err
    assert "NOT NEEDED" not in run.out  # a rule installs: never "not needed"
    assert "result: PROTECTED: vLLM 0.33.0 needs no rule by its code or version" in run.out
    assert "policy            installed, engages per scheduler:" in run.out
    assert re.search(r"^  block-unit +runs +by version: ", run.out, re.M), run.out
    assert (
        "it engages at engine start for each scheduler whose Mamba KV cache block "
        "differs from cache_config.block_size"
    ) in run.out
    assert "patched Scheduler._mamba_block_aligned_split on import" in run.out
    assert "block-unit will not run" not in run.out


# Builds real schedulers first (the plugin loaded as vLLM loads it), then runs doctor in
# the same process: one with the Mamba KV cache block (256) above cache_config.block_size
# (128), as vLLM #54076 reports; an AsyncScheduler over attention layers only.
_BUILT_THEN_DOCTOR = """\
import json, sys
from tools import sched_harness as harness
from tools.sched_harness import HarnessConfig
harness.load_plugins()
small = dict(block_size=256, max_num_batched_tokens=192, encoder_cache_tokens=256,
             max_model_len=1024)
harness.build_scheduler(HarnessConfig(configured_block_size=128, **small))
harness.build_scheduler(HarnessConfig(async_scheduling=True, attention_only=True, **small))
from vllm_mamba_fix.doctor import run
from vllm_mamba_fix.doctor.render import render_text
report = run()
with open(sys.argv[1], "w") as out:
    json.dump({"data": report.data, "text": render_text(report, 0.0)}, out, default=str)
"""


@needs_affected_vllm
@pytest.mark.parametrize("block_rule", ["on", "0"])
def test_a_built_schedulers_block_sizes_decide_the_block_rule(
    tmp_path: Path, block_rule: str
) -> None:
    out = tmp_path / "doctor.json"
    run = _run(
        [sys.executable, "-c", _BUILT_THEN_DOCTOR, str(out)],
        {"VLLM_MAMBA_FIX_BLOCK_RULE": block_rule, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    assert run.code == 0, run.err[-3000:]
    found = json.loads(out.read_text())
    data, text = found["data"], found["text"]
    sched = "vllm.v1.core.sched.scheduler.Scheduler"
    block = _rules(data)["block-unit"]
    facts = {f["class"].rsplit(".", 1)[1]: f for f in block["block_facts"]}
    assert (facts["Scheduler"]["block_size"], facts["Scheduler"]["cache_config_block_size"]) == (
        256,
        128,
    )
    assert facts["AsyncScheduler"]["split_idle"]  # no Mamba layers: vLLM never calls the split
    assert block["needed"] is True and block["needed_by_classes"] == [sched]
    assert data["dry_run"]["already_active"] and "left in place" in text
    idle = next(s for s in data["schedulers"] if s["class"].endswith("AsyncScheduler"))
    assert idle["record"]["split_idle"]
    assert "split rules idle: vLLM never calls the split here" in text
    if block_rule == "on":
        assert (data["status"], facts["Scheduler"]["engaged"]) == ("protected", True)
        assert "block-unit" in data["policy"]["needed_rules"]
        assert f"block-unit (by the block sizes of the built {sched})" in data["policy"]["reason"]
        assert (
            f"{sched}: Mamba KV cache 256, cache_config.block_size 128 (differ, block-unit "
            "engaged)" in text
        )
    else:  # the mismatch is seen and the rule is off: not protected
        assert (data["status"], facts["Scheduler"]["engaged"]) == ("not-protected", False)
        assert "block-unit is switched off by VLLM_MAMBA_FIX_BLOCK_RULE=0" in data["problems"]
        assert (
            f"{sched}: Mamba KV cache 256, cache_config.block_size 128 (differ, block-unit "
            "NOT engaged)" in text
        )
