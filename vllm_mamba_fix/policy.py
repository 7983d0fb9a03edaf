"""Which rules to install: settings, release data and code evidence in, a typed plan out.

Pure functions; no vLLM import and no logging (callers pick the log level).

The rules, why they exist, and where they stop being needed:

- ``split``: wraps ``_mamba_block_aligned_split``. Through 0.27.1 ``schedule()``
  budgets encoder inputs before the split, so a chunk cut short before an image
  is floored to 0 and the request never moves. Upstream moved the split ahead of
  encoder budgeting in 0.28.0 (vLLM #51603); a platform scheduler that keeps the
  old order in its own ``schedule()`` still needs the rule on any release.
- ``speculative-stall``: wraps ``_try_schedule_encoder_inputs``. From 0.24.0 an
  encoder-cache entry is freed only past the drafter's look-ahead (vLLM #46315),
  which parks a request whose images sit closer than that under EAGLE-type
  speculation. 0.33.0 frees without the delay and cuts without the shift.
- ``stall-watchdog``: names a request that gets 0 tokens for long, with its cause.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vllm_mamba_fix.config import ENV_MODE, ENV_STALL_SECONDS, Mode
from vllm_mamba_fix.evidence import Evidence
from vllm_mamba_fix.versions import Family, Verdict


class Rule(enum.Enum):
    """What the plugin may install."""

    # Wraps _mamba_block_aligned_split: collapse, re-align, encoder stop.
    SPLIT = "split"
    # Wraps _try_schedule_encoder_inputs: ends the EAGLE encoder-cache deadlock.
    SPECULATIVE_STALL = "speculative-stall"
    # Wraps _try_schedule_encoder_inputs: names stalls no rule can end.
    STALL_WATCHDOG = "stall-watchdog"


@dataclass(frozen=True)
class RuleVerdict:
    rule: Rule
    active: bool
    basis: str  # what decided: "code", "version" or "setting"
    reason: str


@dataclass(frozen=True)
class Plan:
    verdicts: tuple[RuleVerdict, ...]

    @property
    def rules(self) -> frozenset[Rule]:
        return frozenset(v.rule for v in self.verdicts if v.active)

    def verdict(self, rule: Rule) -> RuleVerdict:
        return next(v for v in self.verdicts if v.rule is rule)

    def describe(self, rules: frozenset[Rule] | None = None) -> str:
        """The verdicts on ``rules`` (default: the inactive ones), for a log line."""
        chosen = [
            v for v in self.verdicts if (v.rule in rules if rules is not None else not v.active)
        ]
        return "; ".join(f"{v.rule.value} [{v.basis}: {v.reason}]" for v in chosen)


def _split_verdict(force: bool, family: Family, evidence: Evidence) -> RuleVerdict:
    if force:
        return RuleVerdict(Rule.SPLIT, True, "setting", "VLLM_MAMBA_FIX=force")
    if evidence.split_after_encoder is not None:
        by_version = family.verdict is Verdict.PATCH
        if evidence.split_after_encoder:
            own = evidence.schedule_owner != "Scheduler"
            note = (
                ""
                if by_version
                else (
                    "; on this release only a scheduler with its own schedule() needs it"
                    if own
                    else "; the version alone would have left it (a pre-fix build)"
                )
            )
            return RuleVerdict(
                Rule.SPLIT, True, "code",
                f"{evidence.schedule_owner}.schedule budgets encoder inputs before the split, so "
                f"a sub-block cut becomes 0{note}",
            )  # fmt: skip
        note = "; the version alone would have patched (a backport)" if by_version else ""
        return RuleVerdict(
            Rule.SPLIT, False, "code",
            f"{evidence.schedule_owner}.schedule splits before encoder budgeting (vLLM #51603)"
            f"{note}",
        )  # fmt: skip
    return RuleVerdict(Rule.SPLIT, family.verdict is Verdict.PATCH, "version", family.summary)


def _speculative_verdict(family: Family, evidence: Evidence) -> RuleVerdict:
    if not family.drafter_fallback:
        return RuleVerdict(
            Rule.SPECULATIVE_STALL, False, "version",
            "before 0.24 the model runner asserts on any encoder-cache miss; the watchdog names "
            "such stalls instead",
        )  # fmt: skip
    basis = "version" if evidence.deferred_encoder_free is None else "code"
    deferred = (
        family.deferred_encoder_free
        if evidence.deferred_encoder_free is None
        else evidence.deferred_encoder_free
    )
    if deferred:
        reason = "encoder inputs are freed only past the drafter's look-ahead"
    else:
        reason = "encoder inputs are freed without a look-ahead delay"
    return RuleVerdict(Rule.SPECULATIVE_STALL, deferred, basis, reason)


def plan(mode: Mode, family: Family, evidence: Evidence, stall_seconds: float | None) -> Plan:
    """Which rules to install, once the scheduler class exists; code first, version second."""
    split = _split_verdict(mode is Mode.FORCE, family, evidence)
    speculative = _speculative_verdict(family, evidence)
    if stall_seconds is None:
        watchdog = RuleVerdict(Rule.STALL_WATCHDOG, False, "setting", f"{ENV_STALL_SECONDS}=off")
    else:
        active = split.active or speculative.active
        watchdog = RuleVerdict(
            Rule.STALL_WATCHDOG, active, "setting",
            f"after {stall_seconds:g} s" if active else "no other rule installed",
        )  # fmt: skip
    return Plan((split, speculative, watchdog))


class Preflight(enum.Enum):
    """What ``register()`` learns before the scheduler exists."""

    DISABLED = "disabled"  # VLLM_MAMBA_FIX=off
    ABSENT = "absent"  # the release has no split method
    UNREADABLE_VERSION = "unreadable-version"  # and not forced: vLLM is left untouched
    FORCED = "forced"
    PROCEED = "proceed"

    @property
    def waits_for_scheduler(self) -> bool:
        return self in (Preflight.FORCED, Preflight.PROCEED)


@dataclass(frozen=True)
class PreflightResult:
    outcome: Preflight
    reason: str


def preflight(mode: Mode, family: Family, version: str) -> PreflightResult:
    """At ``register()``: whether to wait for the scheduler, and why."""
    if mode is Mode.OFF:
        return PreflightResult(
            Preflight.DISABLED, f"disabled by {ENV_MODE}; vLLM {version} left untouched"
        )
    if family.verdict is Verdict.ABSENT:
        return PreflightResult(
            Preflight.ABSENT,
            f"vLLM {version} has no Scheduler._mamba_block_aligned_split (added in 0.15.0)",
        )
    if family.verdict is Verdict.UNKNOWN and mode is not Mode.FORCE:
        reason = (
            f"cannot read the vLLM version {version!r}; leaving vLLM untouched "
            f"(set {ENV_MODE}=force to patch anyway)"
        )
        return PreflightResult(Preflight.UNREADABLE_VERSION, reason)
    if mode is Mode.FORCE:
        return PreflightResult(
            Preflight.FORCED, f"{ENV_MODE}=force: patching vLLM {version} regardless"
        )
    return PreflightResult(
        Preflight.PROCEED, f"vLLM {version}: family {family.name} ({family.summary})"
    )
