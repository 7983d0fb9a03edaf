"""The verdict: pure functions from typed inputs to what the release needs and the status.

No I/O, no vLLM import: every input is a value the checks produced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from vllm_mamba_fix.decide.policy import Plan, Rule
from vllm_mamba_fix.doctor.report import names_text
from vllm_mamba_fix.facts.config import ENV_MODE, ENV_VLLM_PLUGINS, PLUGIN_NAME, Mode
from vllm_mamba_fix.facts.versions import Family, Verdict
from vllm_mamba_fix.rules.table import FIX_RULES

# FIX_RULES (the rule table's ``fixes``) end a deadlock or a wrong token. The watchdog
# and stall-end only name or end stalls, so one that would not install is a warning,
# never "not protected".
# Fix rules that engage per built scheduler: block-unit is needed only where a
# scheduler's Mamba KV cache block differs from cache_config.block_size. A dry run
# builds no scheduler, so it is needed only by what a built one's record shows.
PER_SCHEDULER: frozenset[Rule] = frozenset({Rule.BLOCK_UNIT})
PER_SCHEDULER_TEXT = (
    "engages per scheduler where the Mamba KV cache's block differs from cache_config.block_size"
)
# What to do where a scheduler's two block sizes differ and the block-unit rule does not run.
PIN_HINT = (
    "vLLM's own chunks can end inside a cached block and cache a stale Mamba state "
    "(vLLM #54076): pin --block-size to the cache's block"
)
# What a per-scheduler rule that installs does at engine start, where no record shows yet.
ENGAGES_AT_START = (
    "engages at engine start for each scheduler whose Mamba KV cache block differs from "
    "cache_config.block_size (the engine core sets that to the smallest KV cache group block)"
)

VERDICT_TEXT = {
    "needed-will-patch": "needed, will patch",
    "needed-will-not-patch": "needed, but will NOT patch",
    "installed-per-scheduler": "installed, engages per scheduler",
    "not-needed": "not needed",
    "unsupported": "unsupported",
}


def needed_rules(
    family: Family,
    mode: Mode,
    by_code: Plan,
    not_eagle: bool,
    needed_by_classes: frozenset[Rule] = frozenset(),
) -> frozenset[Rule]:
    """The fix rules this deployment needs.

    ``not_eagle``: a --speculative-config that is not EAGLE-type, so the
    speculative stall cannot arise. ``needed_by_classes``: rules a scheduler
    class needs by its own ``schedule()``, and per-scheduler rules a built
    scheduler's record shows are needed.
    """
    if family.verdict is Verdict.UNKNOWN:
        needed = {Rule.SPLIT} if mode is Mode.FORCE else set()
    else:
        by_release = {r for r in FIX_RULES if r not in PER_SCHEDULER and by_code.verdict(r).active}
        needed = by_release | set(needed_by_classes)
    if not_eagle:
        needed.discard(Rule.SPECULATIVE_STALL)
    return frozenset(needed)


@dataclasses.dataclass(frozen=True)
class Policy:
    verdict: str  # a key of VERDICT_TEXT
    needed: frozenset[Rule]
    should_patch: bool
    reason: str

    def to_json(self) -> dict[str, object]:
        return {
            "verdict": self.verdict,
            "needed": bool(self.needed),
            "needed_rules": [r.value for r in FIX_RULES if r in self.needed],
            "should_patch": self.should_patch,
            "reason": self.reason,
        }


@dataclasses.dataclass(frozen=True)
class PolicyInputs:
    """What :func:`policy` decides from: the release, its needs and the dry run's plans."""

    family: Family
    version: str
    needed: frozenset[Rule]
    should_patch: bool
    preflight_reason: str
    by_code: Plan
    spared: str  # a rule let off, named
    # The classes that need a rule by their own schedule() where the base class does not.
    needed_by: Mapping[Rule, Sequence[str]] | None = None
    # Per-scheduler rules the dry run installed: they engage at engine start where the sizes
    # differ, so the plugin acts even where nothing is known to be needed.
    installed_per_scheduler: frozenset[Rule] = frozenset()
    # Per-scheduler rules the set-up shows will engage, with why (a drafter's own KV group).
    foreseen: Mapping[Rule, str] | None = None


def policy(inputs: PolicyInputs) -> Policy:
    """What the release needs and whether the plugin will act."""
    family, version, needed, should_patch = (
        inputs.family, inputs.version, inputs.needed, inputs.should_patch,
    )  # fmt: skip
    preflight_reason, by_code, spared = inputs.preflight_reason, inputs.by_code, inputs.spared
    needed_by, foreseen = inputs.needed_by, inputs.foreseen
    installed_per_scheduler = inputs.installed_per_scheduler
    reason = preflight_reason
    if needed:
        verdict = "needed-will-patch" if should_patch else "needed-will-not-patch"
        if should_patch:
            reason = _needed_reason(version, needed, by_code, needed_by, foreseen)
    elif family.verdict is Verdict.UNKNOWN:
        verdict = "unsupported"
    elif family.verdict is not Verdict.ABSENT:
        verdict, reason = _unneeded(version, by_code, spared, installed_per_scheduler,
                                    should_patch)  # fmt: skip
    else:
        verdict = "not-needed"
    return Policy(verdict, needed, should_patch, reason)


def _needed_reason(
    version: str,
    needed: frozenset[Rule],
    by_code: Plan,
    needed_by: Mapping[Rule, Sequence[str]] | None,
    foreseen: Mapping[Rule, str] | None,
) -> str:
    """Why each needed rule is needed: code or version; only force on an unreadable version
    needs it by setting."""

    def basis(rule: Rule) -> str:
        chosen = by_code.verdict(rule)
        classes = ", ".join(needed_by.get(rule, ())) if needed_by else ""
        if rule in PER_SCHEDULER and foreseen and rule in foreseen:
            return foreseen[rule]
        if rule in PER_SCHEDULER and classes:
            return f"the block sizes of the built {classes}"
        if chosen.active:
            return chosen.basis
        if classes:
            return f"the code of {classes}"
        return "setting"

    return f"vLLM {version} needs " + names_text(
        [f"{r.value} (by {basis(r)})" for r in FIX_RULES if r in needed]
    )


def _unneeded(
    version: str,
    by_code: Plan,
    spared: str,
    installed_per_scheduler: frozenset[Rule],
    should_patch: bool,
) -> tuple[str, str]:
    """The verdict and reason where no rule is needed on an affected-family release."""
    fixes = [
        f"{v.rule.value} [{v.basis}: {v.reason}]"
        for v in by_code.verdicts
        if v.rule in FIX_RULES
        and v.rule not in PER_SCHEDULER
        and not (spared and v.rule is Rule.SPECULATIVE_STALL)
    ]
    listed = "; ".join([*fixes, spared] if spared else fixes)
    if installed_per_scheduler and should_patch:
        # Never "not needed" while a rule installs: say what runs and when it acts.
        parts = [
            f"{r.value} [{by_code.verdict(r).basis}: {by_code.verdict(r).reason}]"
            for r in FIX_RULES
            if r in installed_per_scheduler
        ]
        return "installed-per-scheduler", (
            f"vLLM {version} needs no rule by its code or version ({listed}); installed: "
            f"{'; '.join(parts)}; it {ENGAGES_AT_START}"
        )
    waiting = [
        f"{v.rule.value} [needed only where a built scheduler's Mamba KV cache block "
        "differs from cache_config.block_size; none shows it]"
        for v in by_code.verdicts
        if v.rule in PER_SCHEDULER and v.active
    ]
    return "not-needed", f"not needed on vLLM {version}: " + "; ".join(
        [*fixes, *waiting, spared] if spared else [*fixes, *waiting]
    )


@dataclasses.dataclass(frozen=True)
class Delivery:
    """Whether vLLM will load and run the plugin, as the checks found."""

    mode: Mode
    mode_env: str | None  # the raw VLLM_MAMBA_FIX value
    entry_point_error: str | None  # None: vLLM finds and loads ``register``
    vllm_plugins_allows: bool
    vllm_plugins_env: str | None


def problems(
    chosen: Policy,
    delivery: Delivery,
    rule_problems: dict[Rule, str],
    class_problems: tuple[str, ...],
) -> list[str]:
    """Why a needed rule would not apply, in the order an operator fixes them."""
    found: list[str] = []
    if chosen.needed:
        if delivery.mode is Mode.OFF:
            found.append(f"disabled by {ENV_MODE}={delivery.mode_env!r}")
        if delivery.entry_point_error is not None:
            found.append(delivery.entry_point_error)
        if not delivery.vllm_plugins_allows:
            found.append(
                f"{ENV_VLLM_PLUGINS}={delivery.vllm_plugins_env!r} does not list "
                f"{PLUGIN_NAME!r}; vLLM will not load the plugin"
            )
        for rule in FIX_RULES:
            text = rule_problems.get(rule)
            if rule in chosen.needed and text and text not in found:
                found.append(text)
        found.extend(class_problems)
    elif chosen.verdict == "unsupported":
        found.append(chosen.reason)
    return found


def status(chosen: Policy | None, bad_input: list[str], found_problems: list[str]) -> str:
    """``chosen`` None: vLLM or its version could not be read."""
    if bad_input:
        return "invalid-input"
    if chosen is None or chosen.verdict == "unsupported":
        return "unknown"
    if chosen.verdict == "installed-per-scheduler":
        return "not-protected" if found_problems else "protected"
    if not chosen.needed:
        return "not-needed"
    return "not-protected" if found_problems else "protected"


def summary(status_: str, version: str | None, reason: str, found_problems: list[str]) -> str:
    if status_ == "protected" and reason.startswith(f"vLLM {version} needs no rule"):
        return reason  # installed-per-scheduler: the reason says what runs and when
    if status_ == "protected":
        return f"{reason}; the fix will be applied"
    if status_ == "not-needed":
        return reason
    if status_ == "invalid-input":
        return found_problems[0]
    if status_ == "not-protected":
        return f"vLLM {version} needs the fix but it would not apply: {found_problems[0]}"
    if version is None:
        return "vLLM is not importable in this interpreter"
    return reason
