"""How each rule's need is decided: settings, release data and code evidence in, a verdict out.

Pure: no vLLM, no logging (callers pick the log level). The rule table
(:mod:`vllm_mamba_fix.rules.table`) names which function decides which rule and runs them in
its order; why each rule exists and where it stops being needed is its module's header."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import NamedTuple

from vllm_mamba_fix.decide.plan import Plan as Plan  # plan.py's, re-exported for its callers
from vllm_mamba_fix.decide.plan import Rule, RuleVerdict
from vllm_mamba_fix.facts.config import (
    ENV_BLOCK_RULE,
    ENV_END_STALLS_AFTER,
    ENV_MODE,
    ENV_SPLIT_RULE,
    ENV_STALL_SECONDS,
    Mode,
    Settings,
)
from vllm_mamba_fix.facts.evidence import Evidence
from vllm_mamba_fix.facts.versions import Family, Verdict


class Facts(NamedTuple):
    settings: Settings
    family: Family
    evidence: Evidence


Earlier = Mapping[Rule, RuleVerdict]  # the verdicts decided before, in table order


def _switched_off(need: RuleVerdict, switch: str) -> RuleVerdict:
    return RuleVerdict(need.rule, False, "setting", f"{switch}=0", need)


def split_verdict(facts: Facts, earlier: Earlier) -> RuleVerdict:
    need = _split_need(facts)
    if not facts.settings.switched_on(ENV_SPLIT_RULE):
        return _switched_off(need, ENV_SPLIT_RULE)
    if facts.settings.mode is Mode.FORCE:
        return RuleVerdict(Rule.SPLIT, True, "setting", f"{ENV_MODE}=force", need)
    return need


def _split_need(facts: Facts) -> RuleVerdict:
    found, owner = facts.evidence.split_after_encoder, facts.evidence.schedule_owner
    by_version = facts.family.verdict is Verdict.PATCH
    if found is None:
        return RuleVerdict(Rule.SPLIT, by_version, "version", facts.family.summary)
    if not found:
        note = "; the version alone would have patched (a backport)" if by_version else ""
        why = f"{owner}.schedule splits before encoder budgeting (vLLM #51603){note}"
        return RuleVerdict(Rule.SPLIT, False, "code", why)
    note = ""
    if not by_version and owner != "Scheduler":
        note = "; on this release only a scheduler with its own schedule() needs it"
    elif not by_version:
        note = "; the version alone would have left it (a pre-fix build)"
    why = f"{owner}.schedule budgets encoder inputs before the split, so a sub-block cut becomes 0"
    return RuleVerdict(Rule.SPLIT, True, "code", why + note)


def block_unit_verdict(facts: Facts, earlier: Earlier) -> RuleVerdict:
    why = "every release's split floors to cache_config.block_size (vLLM #54076); engages for "
    why += "each scheduler whose Mamba KV cache stores another block"
    need = RuleVerdict(Rule.BLOCK_UNIT, True, "version", why)
    if facts.family.verdict is Verdict.ABSENT:
        need = RuleVerdict(Rule.BLOCK_UNIT, False, "version", facts.family.summary)
    if not facts.settings.switched_on(ENV_BLOCK_RULE):
        return _switched_off(need, ENV_BLOCK_RULE)
    return need


def speculative_verdict(facts: Facts, earlier: Earlier) -> RuleVerdict:
    family, evidence = facts.family, facts.evidence
    if not family.drafter_fallback:
        why = "before 0.24 the model runner asserts on any encoder-cache miss; the watchdog names "
        return RuleVerdict(Rule.SPECULATIVE_STALL, False, "version", why + "such stalls instead")
    found = evidence.deferred_encoder_free
    deferred = family.deferred_encoder_free if found is None else found
    how = "only past the drafter's look-ahead" if deferred else "without a look-ahead delay"
    basis = "version" if found is None else "code"
    return RuleVerdict(Rule.SPECULATIVE_STALL, deferred, basis, f"encoder inputs are freed {how}")


def watchdog_verdict(facts: Facts, earlier: Earlier) -> RuleVerdict:
    seconds = facts.settings.stall_seconds
    if seconds is None:
        return RuleVerdict(Rule.STALL_WATCHDOG, False, "setting", f"{ENV_STALL_SECONDS}=off")
    active = any(earlier[rule].active for rule in (Rule.SPLIT, Rule.SPECULATIVE_STALL))
    why = f"after {seconds:g} s" if active else "no fix rule installed"
    return RuleVerdict(Rule.STALL_WATCHDOG, active, "setting", why)


def stall_end_verdict(facts: Facts, earlier: Earlier) -> RuleVerdict:
    after = facts.settings.end_stalls_after
    if after is None:
        return RuleVerdict(Rule.STALL_END, False, "setting", f"{ENV_END_STALLS_AFTER}=off")
    if not earlier[Rule.STALL_WATCHDOG].active:
        return RuleVerdict(Rule.STALL_END, False, "setting", "the stall watchdog is off")
    return RuleVerdict(Rule.STALL_END, True, "setting", f"{after:g} s after a stall is named")


class Preflight(enum.Enum):  # what ``register()`` learns before the scheduler exists
    DISABLED = "disabled"  # VLLM_MAMBA_FIX=off
    ABSENT = "absent"  # the release has no split method
    UNREADABLE_VERSION = "unreadable-version"  # and not forced: vLLM is left untouched
    FORCED = "forced"
    PROCEED = "proceed"

    @property
    def waits_for_scheduler(self) -> bool:
        return self is Preflight.FORCED or self is Preflight.PROCEED


class PreflightResult(NamedTuple):
    outcome: Preflight
    reason: str


def preflight(mode: Mode, family: Family, version: str) -> PreflightResult:
    """At ``register()``: whether to wait for the scheduler, and why."""
    if mode is Mode.OFF:
        why = f"disabled by {ENV_MODE}; vLLM {version} left untouched"
        return PreflightResult(Preflight.DISABLED, why)
    if family.verdict is Verdict.ABSENT:
        why = f"vLLM {version} has no Scheduler._mamba_block_aligned_split (added in 0.15.0)"
        return PreflightResult(Preflight.ABSENT, why)
    if family.verdict is Verdict.UNKNOWN and mode is not Mode.FORCE:
        why = f"cannot read the vLLM version {version!r}; leaving vLLM untouched"
        why += f" (set {ENV_MODE}=force to patch anyway)"
        return PreflightResult(Preflight.UNREADABLE_VERSION, why)
    if mode is Mode.FORCE:
        why = f"{ENV_MODE}=force: patching vLLM {version} regardless"
        return PreflightResult(Preflight.FORCED, why)
    why = f"vLLM {version}: family {family.name} ({family.summary})"
    return PreflightResult(Preflight.PROCEED, why)
