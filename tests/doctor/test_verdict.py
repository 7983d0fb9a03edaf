"""The verdict (doctor/verdict.py): what a release needs and the status, from the command line
and from typed inputs; the plugin's log never decides it."""

from __future__ import annotations

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
from vllm_mamba_fix.facts.config import Mode, Settings
from vllm_mamba_fix.facts.evidence import Evidence
from vllm_mamba_fix.facts.versions import family_for
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


def _policy_inputs(vllm_version: str) -> tuple[Any, Any]:
    family = family_for(vllm_version)
    return family, plan(Settings(), family, Evidence())


def test_needed_rules_follow_release_classes_and_speculative_method() -> None:
    from vllm_mamba_fix.doctor import verdict

    family, by_code = _policy_inputs("0.32.0")
    assert verdict.needed_rules(family, Mode.AUTO, by_code, False) == {Rule.SPECULATIVE_STALL}
    assert verdict.needed_rules(family, Mode.AUTO, by_code, True) == frozenset()
    by_class = verdict.needed_rules(family, Mode.AUTO, by_code, False, frozenset({Rule.SPLIT}))
    assert by_class == {Rule.SPLIT, Rule.SPECULATIVE_STALL}
    unknown, unknown_plan = _policy_inputs("not-a-version")
    assert verdict.needed_rules(unknown, Mode.AUTO, unknown_plan, False) == frozenset()
    assert verdict.needed_rules(unknown, Mode.FORCE, unknown_plan, False) == {Rule.SPLIT}


def test_problems_and_status_from_typed_inputs() -> None:
    from vllm_mamba_fix.doctor import verdict

    family, by_code = _policy_inputs("0.27.1")
    needed = verdict.needed_rules(family, Mode.OFF, by_code, False)
    chosen = verdict.policy(
        verdict.PolicyInputs(family, "0.27.1", needed, False, "disabled", by_code, "")
    )
    assert chosen.verdict == "needed-will-not-patch"
    delivery = verdict.Delivery(Mode.OFF, "0", "no entry point", False, "other")
    rule_problems = {Rule.SPLIT: "split would not apply: x"}
    found = verdict.problems(chosen, delivery, rule_problems, ("class y",))
    assert found == [
        "disabled by VLLM_MAMBA_FIX='0'",
        "no entry point",
        "VLLM_PLUGINS='other' does not list 'mamba_fix'; vLLM will not load the plugin",
        "split would not apply: x",
        "class y",
    ]
    assert verdict.status(chosen, [], found) == "not-protected"
    assert verdict.status(chosen, ["bad"], found) == "invalid-input"
    ok = verdict.Delivery(Mode.AUTO, None, None, True, None)
    will = verdict.policy(verdict.PolicyInputs(family, "0.27.1", needed, True, "", by_code, ""))
    assert verdict.problems(will, ok, {}, ()) == []
    assert verdict.status(will, [], []) == "protected"
    assert verdict.status(None, [], []) == "unknown"
    fixed, fixed_plan = _policy_inputs("0.33.0")
    none = verdict.needed_rules(fixed, Mode.AUTO, fixed_plan, False)
    calm = verdict.policy(verdict.PolicyInputs(fixed, "0.33.0", none, True, "", fixed_plan, ""))
    assert (calm.verdict, verdict.status(calm, [], [])) == ("not-needed", "not-needed")
    # A per-scheduler rule that installs: protected (exit 0), never "not needed".
    block = frozenset({Rule.BLOCK_UNIT})
    runs = verdict.policy(
        verdict.PolicyInputs(fixed, "0.33.0", none, True, "", fixed_plan, "", None, block)
    )
    assert (runs.verdict, verdict.status(runs, [], [])) == ("installed-per-scheduler", "protected")
    assert "installed: block-unit [version: " in runs.reason
    assert verdict.status(runs, [], ["x"]) == "not-protected"
    # ... unless the plugin will not act at all (VLLM_MAMBA_FIX=0).
    off = verdict.policy(
        verdict.PolicyInputs(fixed, "0.33.0", none, False, "", fixed_plan, "", None, block)
    )
    assert off.verdict == "not-needed"
