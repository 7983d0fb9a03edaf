from __future__ import annotations

import itertools
import logging

import pytest

from tools.release_facts import FACTS, CutShift, facts_for
from vllm_mamba_fix.decide.policy import Preflight, Rule, preflight
from vllm_mamba_fix.facts.config import Mode, Settings, load_settings
from vllm_mamba_fix.facts.evidence import UNREADABLE, Evidence
from vllm_mamba_fix.facts.versions import (
    FAMILIES,
    UNKNOWN_FAMILY,
    PrefillGate,
    Verdict,
    family_for,
    release_of,
)
from vllm_mamba_fix.install.plugin import PREFLIGHT_LOG_LEVEL
from vllm_mamba_fix.rules.table import plan


@pytest.mark.parametrize(
    ("version", "family"),
    [
        ("0.14.1", "<0.15"),
        ("0.15.0", "0.15"),
        ("0.16.0", "0.15"),
        ("0.17.0", "0.17"),
        ("0.23.0", "0.17"),
        ("0.24.0", "0.24"),
        ("0.25.1", "0.24"),
        ("0.26.0+cpu", "0.26"),
        ("0.27.1", "0.27"),
        ("0.27.2.dev12+g0123abc", "0.27"),
        ("0.28.0", "0.28"),
        ("0.28.0rc1", "0.28"),
        ("0.32.0", "0.28"),
        ("0.33.0", "0.33+"),
        ("0.15", "0.15"),
        ("dev", "unknown"),
        ("", "unknown"),
        ("garbage", "unknown"),
    ],
)
def test_family_for(version: str, family: str) -> None:
    assert family_for(version).name == family


def test_release_ignores_dev_and_local_parts() -> None:
    assert release_of("0.27.2.dev12+gabc") == (0, 27, 2)
    assert release_of("not a version") is None


def test_families_tile_the_version_line() -> None:
    for earlier, later in itertools.pairwise(FAMILIES):
        assert earlier.end == later.first
    assert FAMILIES[-1].end is None


def test_family_facts_match_the_release_notes() -> None:
    affected = [f.name for f in FAMILIES if f.verdict is Verdict.PATCH]
    assert affected == ["0.15", "0.17", "0.24", "0.26", "0.27"]
    misaligned = [f.name for f in FAMILIES if facts_for(f).stock_stays_misaligned]
    assert misaligned == ["0.15", "0.17", "0.24"]
    assert [f.name for f in FAMILIES if facts_for(f).extra_parameter] == ["0.24"]
    # The image deadlock is the split rule's: where the release data patches, and only there.
    deadlocked = [f.name for f in FAMILIES if facts_for(f).image_deadlock]
    assert deadlocked == affected
    assert family_for("0.16.0").prefill_gate is PrefillGate.NO_OUTPUT_TOKENS
    assert family_for("0.17.0").prefill_gate is PrefillGate.BEFORE_PREFILL_END
    # #46315 (deferred free and the runner's fallback) landed in 0.24.0; 0.33 dropped the delay.
    deferred = [f.name for f in FAMILIES if f.deferred_encoder_free]
    assert deferred == ["0.24", "0.26", "0.27", "0.28"]
    assert all(f.drafter_fallback for f in FAMILIES if f.deferred_encoder_free)
    lookahead = [f.name for f in FAMILIES if facts_for(f).cut_shift is CutShift.PREFILL_LOOKAHEAD]
    assert lookahead == ["0.28", "0.33+"]


def test_every_family_has_its_release_facts() -> None:
    assert set(FACTS) == {f.name for f in (*FAMILIES, UNKNOWN_FAMILY)}
    assert all(facts.family == name for name, facts in FACTS.items())
    assert facts_for("0.27") is facts_for(family_for("0.27.1"))


@pytest.mark.parametrize(
    ("mode", "version", "outcome", "waits", "level", "says"),
    [
        (Mode.AUTO, "0.27.1", Preflight.PROCEED, True, logging.DEBUG, "family 0.27"),
        (Mode.AUTO, "0.15.0", Preflight.PROCEED, True, logging.DEBUG, "family 0.15"),
        (Mode.AUTO, "0.33.0", Preflight.PROCEED, True, logging.DEBUG, "family 0.33+"),
        (Mode.FORCE, "0.28.0", Preflight.FORCED, True, logging.INFO, "force"),
        (Mode.AUTO, "0.14.1", Preflight.ABSENT, False, logging.INFO, "has no Scheduler"),
        (Mode.FORCE, "0.14.1", Preflight.ABSENT, False, logging.INFO, "has no Scheduler"),
        (Mode.AUTO, "dev", Preflight.UNREADABLE_VERSION, False, logging.WARNING, "cannot read"),
        (Mode.FORCE, "dev", Preflight.FORCED, True, logging.INFO, "force"),
        (Mode.OFF, "0.27.1", Preflight.DISABLED, False, logging.INFO, "disabled"),
    ],
)
def test_preflight(
    mode: Mode, version: str, outcome: Preflight, waits: bool, level: int, says: str
) -> None:
    result = preflight(mode, family_for(version), version)
    assert result.outcome is outcome
    assert result.outcome.waits_for_scheduler is waits
    assert PREFLIGHT_LOG_LEVEL[result.outcome] == level
    assert says in result.reason


def _settings(**kwargs: object) -> Settings:
    mode = kwargs.pop("mode", Mode.AUTO)
    seconds = kwargs.pop("seconds", 30.0)
    env = kwargs.pop("env", {})
    base = load_settings(env)  # type: ignore[arg-type]
    return base._replace(mode=mode, stall_seconds=seconds)  # type: ignore[arg-type]


def _rules(version: str, evidence: Evidence = UNREADABLE, **kwargs: object) -> frozenset[Rule]:
    return plan(_settings(**kwargs), family_for(version), evidence).rules


ALL = frozenset(Rule)
BLOCK = frozenset({Rule.BLOCK_UNIT})
WATCHED = frozenset({Rule.STALL_WATCHDOG, Rule.STALL_END})
SPLIT_AND_WATCHDOG = frozenset({Rule.SPLIT}) | BLOCK | WATCHED
SPECULATIVE_AND_WATCHDOG = frozenset({Rule.SPECULATIVE_STALL}) | BLOCK | WATCHED


@pytest.mark.parametrize(
    ("version", "rules"),
    [
        ("0.14.1", frozenset()),
        ("0.15.0", SPLIT_AND_WATCHDOG),
        ("0.23.0", SPLIT_AND_WATCHDOG),
        ("0.24.0", ALL),
        ("0.27.1", ALL),
        ("0.28.0", SPECULATIVE_AND_WATCHDOG),
        ("0.32.0", SPECULATIVE_AND_WATCHDOG),
        ("0.33.0", BLOCK),
        ("1.0.0", BLOCK),
    ],
)
def test_plan_by_version_when_the_code_is_unreadable(version: str, rules: frozenset[Rule]) -> None:
    assert _rules(version) == rules


def test_code_evidence_overrides_the_version() -> None:
    pre_fix_dev = Evidence(split_after_encoder=True, deferred_encoder_free=True)
    backport = Evidence(split_after_encoder=False, deferred_encoder_free=True)
    assert Rule.SPLIT in _rules("0.28.0.dev3", pre_fix_dev)
    assert Rule.SPLIT not in _rules("0.27.1", backport)
    verdict = plan(_settings(), family_for("0.27.1"), backport).verdict(Rule.SPLIT)
    assert verdict.basis == "code" and "backport" in verdict.reason
    # 0.33's code frees without delay: no speculative rule, whatever the version says.
    assert Rule.SPECULATIVE_STALL not in _rules("0.32.0", Evidence(False, False))
    # Before 0.24 the runner asserts on a miss: never, whatever the code says.
    assert Rule.SPECULATIVE_STALL not in _rules("0.23.0", Evidence(True, True))


@pytest.mark.parametrize(
    ("env", "version", "left_out"),
    [
        ({"VLLM_MAMBA_FIX_BLOCK_RULE": "0"}, "0.27.1", {Rule.BLOCK_UNIT}),
        ({"VLLM_MAMBA_FIX_BLOCK_RULE": "off"}, "0.33.0", {Rule.BLOCK_UNIT}),
        ({"VLLM_MAMBA_FIX_SPLIT_RULE": "0"}, "0.27.1", {Rule.SPLIT}),
        # Without the split rule 0.23 runs no fix rule, so nothing watches.
        ({"VLLM_MAMBA_FIX_SPLIT_RULE": "0"}, "0.23.0", set(SPLIT_AND_WATCHDOG - BLOCK)),
        ({"VLLM_MAMBA_FIX_END_STALLS_AFTER": "off"}, "0.27.1", {Rule.STALL_END}),
        ({"VLLM_MAMBA_FIX_END_STALLS_AFTER": "0"}, "0.23.0", {Rule.STALL_END}),
    ],
)
def test_each_rule_has_its_switch(env: dict[str, str], version: str, left_out: set[Rule]) -> None:
    on = _rules(version)
    off = _rules(version, env=env)
    assert on - off == left_out
    assert off <= on


def test_force_and_watchdog_settings() -> None:
    assert _rules("0.33.0", mode=Mode.FORCE) == SPLIT_AND_WATCHDOG
    assert _rules("dev", mode=Mode.FORCE) == SPLIT_AND_WATCHDOG
    assert _rules("0.27.1", seconds=None) == {Rule.SPLIT, Rule.SPECULATIVE_STALL, Rule.BLOCK_UNIT}
    off = plan(_settings(seconds=None), family_for("0.27.1"), UNREADABLE).verdict(
        Rule.STALL_WATCHDOG
    )
    assert not off.active and "off" in off.reason
