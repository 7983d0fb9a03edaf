"""Version policy: which vLLM releases need which rule, and how each family behaves.

The facts come from reading every release's scheduler (0.15.0 to 0.33.0).
Pure data and ``packaging``; no vLLM import. Where the installed scheduler's
source can be read, :mod:`vllm_mamba_fix.evidence` overrides the version's
verdict on the split rule and the speculative-stall rule.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from vllm_mamba_fix.config import ENV_MODE, ENV_STALL_SECONDS, Mode
from vllm_mamba_fix.evidence import Evidence


class PrefillGate(enum.Enum):
    """How a release decides that a request is still in prefill."""

    NO_OUTPUT_TOKENS = "num_output_tokens == 0"  # 0.15-0.16
    BEFORE_PREFILL_END = "start < max(num_prompt_tokens, num_tokens - 1)"  # 0.17+


class CutShift(enum.Enum):
    """How ``schedule()`` shifts an encoder-limited cut under EAGLE-type speculation."""

    USE_EAGLE = "1 if use_eagle"  # 0.15-0.27
    PREFILL_LOOKAHEAD = "num_prefill_lookahead"  # 0.28+: num_spec_tokens for multi-module MTP


class Verdict(enum.Enum):
    PATCH = "patch"  # affected: the split fix is needed
    NOT_NEEDED = "not-needed"  # fixed upstream
    ABSENT = "absent"  # the method does not exist yet
    UNKNOWN = "unknown"  # the version cannot be parsed


class Rule(enum.Enum):
    """What the plugin may install."""

    # Wraps _mamba_block_aligned_split: collapse, re-align, encoder stop.
    SPLIT = "split"
    # Wraps _try_schedule_encoder_inputs: ends the EAGLE encoder-cache deadlock.
    SPECULATIVE_STALL = "speculative-stall"
    # Wraps _try_schedule_encoder_inputs: names stalls no rule can end.
    STALL_WATCHDOG = "stall-watchdog"


@dataclass(frozen=True)
class Family:
    name: str
    first: tuple[int, int, int]  # inclusive
    end: tuple[int, int, int] | None  # exclusive; None: open-ended
    verdict: Verdict  # of the split rule
    summary: str
    prefill_gate: PrefillGate | None = PrefillGate.BEFORE_PREFILL_END
    # Stock keeps a request that starts mid-block misaligned: re-align is vital.
    stock_stays_misaligned: bool = False
    # Stock budgets the encoder before the split, so a sub-block cut becomes 0.
    image_deadlock: bool = True
    extra_parameter: bool = False  # 0.24-0.25 pass a fifth positional argument
    cut_shift: CutShift = CutShift.USE_EAGLE
    # Stock defers an encoder-cache free by the drafter's look-ahead (#46315),
    # which parks a request whose images sit < 2 look-aheads apart.
    deferred_encoder_free: bool = False
    # The model runner falls back to token embeddings when the drafter reads an
    # unencoded input that starts at the processed end (0.24+); before, any
    # encoder-cache miss asserts, so the 0.33 cut would crash the engine.
    drafter_fallback: bool = True


_AFTER_ENCODER = "split after encoder budgeting"
_DEFERRED_FREE = "encoder free deferred by the drafter's look-ahead"

FAMILIES: tuple[Family, ...] = (
    Family(
        "<0.15", (0, 0, 0), (0, 15, 0), Verdict.ABSENT, "method absent; nothing to patch",
        prefill_gate=None, image_deadlock=False, drafter_fallback=False,
    ),
    Family(
        "0.15", (0, 15, 0), (0, 17, 0), Verdict.PATCH, f"chunk-length alignment; {_AFTER_ENCODER}",
        prefill_gate=PrefillGate.NO_OUTPUT_TOKENS, stock_stays_misaligned=True,
        drafter_fallback=False,
    ),
    Family(
        "0.17", (0, 17, 0), (0, 24, 0), Verdict.PATCH, f"chunk-length alignment; {_AFTER_ENCODER}",
        stock_stays_misaligned=True, drafter_fallback=False,
    ),
    Family(
        "0.24", (0, 24, 0), (0, 26, 0), Verdict.PATCH,
        f"chunk-length alignment, fifth parameter; {_AFTER_ENCODER}; {_DEFERRED_FREE}",
        stock_stays_misaligned=True, extra_parameter=True, deferred_encoder_free=True,
    ),
    Family(
        "0.26", (0, 26, 0), (0, 27, 0), Verdict.PATCH,
        f"absolute-end alignment; {_AFTER_ENCODER}; {_DEFERRED_FREE}", deferred_encoder_free=True,
    ),
    Family(
        "0.27", (0, 27, 0), (0, 28, 0), Verdict.PATCH,
        f"absolute-end alignment with guard; {_AFTER_ENCODER}; {_DEFERRED_FREE}",
        deferred_encoder_free=True,
    ),
    Family(
        "0.28", (0, 28, 0), (0, 33, 0), Verdict.NOT_NEEDED,
        f"upstream splits before encoder budgeting (vLLM #51603); {_DEFERRED_FREE}",
        image_deadlock=False, cut_shift=CutShift.PREFILL_LOOKAHEAD, deferred_encoder_free=True,
    ),
    Family(
        "0.33+", (0, 33, 0), None, Verdict.NOT_NEEDED,
        "upstream splits before encoder budgeting and frees encoder inputs without delay",
        image_deadlock=False, cut_shift=CutShift.PREFILL_LOOKAHEAD,
    ),
)  # fmt: skip

# Used with VLLM_MAMBA_FIX=force when the version cannot be read.
UNKNOWN_FAMILY = Family(
    "unknown", (0, 0, 0), None, Verdict.UNKNOWN, "version not recognised", image_deadlock=False,
    cut_shift=CutShift.PREFILL_LOOKAHEAD, drafter_fallback=False,
)  # fmt: skip


def release_of(version: str) -> tuple[int, int, int] | None:
    """The (major, minor, micro) release of a version; dev and local parts ignored."""
    try:
        parsed = Version(version.strip())
    except (InvalidVersion, TypeError, AttributeError):
        return None
    major, minor, micro = (*parsed.release, 0, 0)[:3]
    return major, minor, micro


def family_for(version: str) -> Family:
    release = release_of(version)
    if release is None:
        return UNKNOWN_FAMILY
    for family in FAMILIES:
        if family.first <= release and (family.end is None or release < family.end):
            return family
    return UNKNOWN_FAMILY  # not reached: FAMILIES covers every release


# --------------------------------------------------------------------------
# The decision: settings, version and code evidence -> the rules to install.


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
            note = "" if by_version else "; the version alone would have left it (a pre-fix build)"
            return RuleVerdict(
                Rule.SPLIT, True, "code", f"Scheduler.schedule budgets encoder inputs before the "
                f"split, so a sub-block cut becomes 0{note}",
            )  # fmt: skip
        note = "; the version alone would have patched (a backport)" if by_version else ""
        return RuleVerdict(
            Rule.SPLIT, False, "code",
            f"Scheduler.schedule splits before encoder budgeting (vLLM #51603){note}",
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


def preflight(mode: Mode, family: Family, version: str) -> tuple[bool, int, str]:
    """At ``register()``: whether to wait for the scheduler, and the line that says why."""
    if mode is Mode.OFF:
        return False, logging.INFO, f"disabled by {ENV_MODE}; vLLM {version} left untouched"
    if family.verdict is Verdict.ABSENT:
        reason = "has no Scheduler._mamba_block_aligned_split (added in 0.15.0)"
        return False, logging.INFO, f"vLLM {version} {reason}"
    if family.verdict is Verdict.UNKNOWN and mode is not Mode.FORCE:
        reason = (
            f"cannot read the vLLM version {version!r}; leaving vLLM untouched "
            f"(set {ENV_MODE}=force to patch anyway)"
        )
        return False, logging.WARNING, reason
    if mode is Mode.FORCE:
        return True, logging.INFO, f"{ENV_MODE}=force: patching vLLM {version} regardless"
    return True, logging.DEBUG, f"vLLM {version}: family {family.name} ({family.summary})"
