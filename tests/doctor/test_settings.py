"""The settings (doctor/checks/delivery.py): every ``VLLM_MAMBA_FIX*`` variable, invalid
values, the plugin switched off, the stall watchdog and the rule switches."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.doctor.conftest import (
    UPDATE_CODE,
    Run,
    _doctor,
    _fake_vllm,
    _rules,
    _run,
    needs_affected_vllm,
)
from vllm_mamba_fix.facts.config import ALL_VARIABLES


@needs_affected_vllm
def test_disabled_on_affected_release_is_not_protected(real: dict[str, Run]) -> None:
    run = real["off"]
    assert run.code == 1, run.err
    data = run.json()
    assert data["status"] == "not-protected"
    assert data["policy"]["verdict"] == "needed-will-not-patch"
    assert any("disabled by VLLM_MAMBA_FIX='0'" in p for p in data["problems"])
    assert "VLLM_MAMBA_FIX" in data["summary"]
    # A dry run with VLLM_MAMBA_FIX=auto still shows that enabling it would work.
    assert data["dry_run"]["forced"] and data["dry_run"]["patched"]
    assert data["dry_run"]["mode"] == "auto"
    assert not any(r["active"] for r in data["rules"])
    assert {r["decided_by"] for r in data["rules"]} == {"setting"}


@needs_affected_vllm
def test_invalid_env_value_is_reported(real: dict[str, Run]) -> None:
    run = real["plugins"]
    assert "invalid value: VLLM_MAMBA_FIX_SCOPE='images-only' is not one of" in run.out
    assert re.search(r"^  VLLM_MAMBA_FIX_SCOPE +'images-only' -> multimodal ", run.out, re.M)


def test_invalid_env_value_alone_keeps_protection(tmp_path: Path) -> None:
    site = _fake_vllm(tmp_path / "site", "0.27.1")
    run = _run(_doctor("--json"), {"PYTHONPATH": str(site), "VLLM_MAMBA_FIX": "maybe"})
    assert run.code == 0, run.err
    data = run.json()
    assert (data["status"], data["settings"]["mode"]) == ("protected", "auto")
    assert data["settings"]["env"]["VLLM_MAMBA_FIX"] == "maybe"
    (problem,) = data["settings"]["problems"]
    assert "VLLM_MAMBA_FIX='maybe'" in problem
    assert problem in " ".join(data["warnings"])


@pytest.mark.parametrize(
    ("stall", "seconds", "text", "warned"),
    [
        (None, 30.0, "stall watchdog after 30 s", False),
        ("off", None, "stall watchdog off", False),
        ("soon", 30.0, "stall watchdog after 30 s", True),  # invalid: warned, default applies
    ],
)
def test_stall_watchdog_setting_is_reported(
    tmp_path: Path, stall: str | None, seconds: float | None, text: str, warned: bool
) -> None:
    site = _fake_vllm(tmp_path / "site", "0.32.0")
    env = {"PYTHONPATH": str(site)}
    if stall is not None:
        env["VLLM_MAMBA_FIX_STALL_SECONDS"] = stall
    data = _run(_doctor("--json"), env).json()
    assert (data["status"], data["exit_code"]) == ("protected", 0)
    assert data["settings"]["stall_seconds"] == seconds
    assert data["settings"]["env"]["VLLM_MAMBA_FIX_STALL_SECONDS"] == stall
    watchdog = _rules(data)["stall-watchdog"]
    assert watchdog["active"] is (seconds is not None)
    problems = data["settings"]["problems"]
    assert bool(problems) is warned
    if warned:
        assert "VLLM_MAMBA_FIX_STALL_SECONDS='soon' is not a number" in problems[0]
        assert problems[0] in " ".join(data["warnings"])
    human = _run(_doctor(), env).out
    assert re.search(rf"^  VLLM_MAMBA_FIX_STALL_SECONDS +\S+ -> {text}", human, re.M), human


def test_settings_show_every_variable_and_the_rule_switches(tmp_path: Path) -> None:
    site = _fake_vllm(tmp_path / "site", "0.27.1", code=UPDATE_CODE)
    env = {"PYTHONPATH": str(site), "VLLM_MAMBA_FIX_END_STALLS_AFTER": "5"}
    data = _run(_doctor("--json"), env).json()
    settings = data["settings"]
    assert list(settings["env"]) == list(ALL_VARIABLES)  # the config's own list, in order
    assert settings["env"]["VLLM_MAMBA_FIX_END_STALLS_AFTER"] == "5"
    assert settings["end_stalls_after"] == 5.0
    assert settings["switches"] == {
        "VLLM_MAMBA_FIX_SPLIT_RULE": {"rule": "split", "on": True},
        "VLLM_MAMBA_FIX_BLOCK_RULE": {"rule": "block-unit", "on": True},
    }
    stall_end = _rules(data)["stall-end"]
    assert (stall_end["active"], stall_end["installs"], stall_end["needed"]) == (True, True, None)
    assert stall_end["switch"] == "VLLM_MAMBA_FIX_END_STALLS_AFTER"
    human = _run(_doctor(), {**env, "VLLM_MAMBA_FIX_BLOCK_RULE": "maybe"}).out
    assert "a stall no rule can end is ended 5 s after it is named" in human
    assert re.search(r"^  VLLM_MAMBA_FIX_SPLIT_RULE +unset -> on \(split rule\)$", human, re.M)
    assert re.search(
        r"^  VLLM_MAMBA_FIX_BLOCK_RULE +'maybe' -> on \(block-unit rule\)", human, re.M
    )
    assert "invalid value: VLLM_MAMBA_FIX_BLOCK_RULE='maybe'" in human
    off = _run(_doctor("--json"), {**env, "VLLM_MAMBA_FIX_END_STALLS_AFTER": "off"}).json()
    assert off["settings"]["end_stalls_after"] is None
    assert (off["status"], _rules(off)["stall-end"]["active"]) == ("protected", False)


def test_a_needed_rule_switched_off_is_not_protected(tmp_path: Path) -> None:
    site = _fake_vllm(tmp_path / "site", "0.27.1")
    run = _run(_doctor("--json"), {"PYTHONPATH": str(site), "VLLM_MAMBA_FIX_SPLIT_RULE": "0"})
    assert run.code == 1, run.err
    data = run.json()
    assert data["status"] == "not-protected"
    assert data["problems"] == ["split is switched off by VLLM_MAMBA_FIX_SPLIT_RULE=0"]
    split = _rules(data)["split"]
    assert (split["needed"], split["active"], split["decided_by"]) == (True, False, "setting")
    # The rest still installs: the block-unit rule on the split, the encoder rules.
    assert data["dry_run"]["wrapped_methods"] == [
        "_mamba_block_aligned_split", "_try_schedule_encoder_inputs",
    ]  # fmt: skip
    assert _rules(data)["block-unit"]["installs"] is True


def test_block_rule_switched_off_on_0_33_warns_and_leaves_the_base_recorded(
    tmp_path: Path,
) -> None:
    site = _fake_vllm(tmp_path / "site", "0.33.0")
    run = _run(_doctor("--json"), {"PYTHONPATH": str(site), "VLLM_MAMBA_FIX_BLOCK_RULE": "off"})
    assert run.code == 0, run.err
    data = run.json()
    # Nothing 0.33 is known to need: a mismatch shows only on a built scheduler.
    assert (data["status"], data["problems"]) == ("not-needed", [])
    block = _rules(data)["block-unit"]
    assert (block["active"], block["needed"], block["installs"]) == (False, None, False)
    assert block["reason"] == "VLLM_MAMBA_FIX_BLOCK_RULE=0" and block["block_facts"] == []
    assert any(
        w.startswith("block-unit will not run") and "pin --block-size" in w
        for w in data["warnings"]
    )
    assert data["dry_run"]["wrapped_methods"] == []
    # The base class is recorded though nothing was installed: doctor reads its plan.
    base = next(s for s in data["schedulers"] if s["class"].endswith(".scheduler.Scheduler"))
    assert base["record"]["rules"] == [] and base["record"]["left_out"] == []
    assert data["dry_run"]["error"].startswith("no rule to install: split [")
