"""The verdict, pure functions (no I/O, no vLLM import): :func:`of_records` reads the one
input, the install records (of a real ``register()`` or of doctor's dry run of it): what runs,
what the release needs before any setting, what classes need beyond the base. :func:`policy`
adds what no record holds: the release's name, the settings' outcome, a --speculative-config,
and whether vLLM loads the plugin."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_mamba_fix.decide.policy import Plan, Rule
from vllm_mamba_fix.doctor.report import names_text
from vllm_mamba_fix.facts.blocks import BlockUnit
from vllm_mamba_fix.facts.config import ENV_MODE, ENV_VLLM_PLUGINS, PLUGIN_NAME, Mode, Settings
from vllm_mamba_fix.facts.targets import SCHEDULER_CLASS, SCHEDULER_MODULE
from vllm_mamba_fix.facts.versions import Family, Verdict
from vllm_mamba_fix.observe.record import ClassRecord
from vllm_mamba_fix.rules import table as rules
from vllm_mamba_fix.rules.table import FIX_RULES

BASE_SCHEDULER = f"{SCHEDULER_MODULE}.{SCHEDULER_CLASS}"

# FIX_RULES end a deadlock or a wrong token; the watchdog and stall-end only name or end
# stalls, so one that would not install is a warning, never "not protected". Block-unit engages
# per built scheduler (where its two block sizes differ): only a built one's record needs it.
PER_SCHEDULER: frozenset[Rule] = frozenset({Rule.BLOCK_UNIT})
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


@dataclass(frozen=True)
class BlockFact:
    """What a built scheduler's record says about its block sizes."""

    scheduler_class: str
    unit: BlockUnit
    runs_block_rule: bool  # the class's wrappers carry the block-unit rule
    split_idle: str | None

    @property
    def engaged(self) -> bool:
        return self.runs_block_rule and self.unit.differs and not self.split_idle

    def to_json(self) -> dict[str, object]:
        return {
            "class": self.scheduler_class,
            "block_size": self.unit.mamba,
            "cache_config_block_size": self.unit.configured,
            "differs": self.unit.differs,
            "engaged": self.engaged,
            "split_idle": self.split_idle,
            "problem": self.unit.problem,
        }


@dataclass(frozen=True)
class Found:
    """What the install records say (:func:`of_records`)."""

    base: ClassRecord | None  # the base Scheduler's record; None: the plugin kept none
    # Fix rules the base class's code or version needs, before any setting switched or forced one.
    needed: frozenset[Rule]
    # Rules a class needs beyond the base: by its own schedule(), or by a built one's block sizes.
    needed_by: Mapping[Rule, tuple[str, ...]]
    facts: tuple[BlockFact, ...]  # of the schedulers built in this process (a dry run builds none)

    @property
    def installed(self) -> frozenset[Rule]:
        """What runs on the base class: what its wrappers carry."""
        return self.base.rules if self.base is not None else frozenset()

    @property
    def planned(self) -> frozenset[Rule]:
        return self.base.plan.rules if self.base is not None else frozenset()

    @property
    def release(self) -> Plan | None:
        """The base class's plan before any setting: what the release needs, and why."""
        if self.base is None:
            return None
        return Plan(tuple(v.by_release for v in self.base.plan.verdicts))


def _release_needs(record: ClassRecord, basis: tuple[str, ...]) -> frozenset[Rule]:
    return frozenset(
        v.rule
        for v in (v.by_release for v in record.plan.verdicts)
        if v.active and v.basis in basis and v.rule in FIX_RULES and v.rule not in PER_SCHEDULER
    )


def of_records(records: Sequence[ClassRecord]) -> Found:
    """The verdict's one input read: what runs, what the release needs and who needs more.

    ``records``: the plugin's install records, of a real ``register()`` in this process or of
    doctor's dry run of the same code path (they are the same records)."""
    base = next((r for r in records if r.scheduler_class == BASE_SCHEDULER), None)
    needed_by: dict[Rule, list[str]] = {}
    for found in records:  # a class with its own schedule(): its code decides for it
        if found.evidence.schedule_owner != SCHEDULER_CLASS:
            for rule in _release_needs(found, ("code",)):
                needed_by.setdefault(rule, []).append(found.scheduler_class)
    facts = tuple(
        BlockFact(r.scheduler_class, r.block, Rule.BLOCK_UNIT in r.rules, r.split_idle)
        for r in records
        if r.block is not None
    )
    block = base is not None and base.plan.verdict(Rule.BLOCK_UNIT).by_release.active
    apart = [f.scheduler_class for f in facts if f.unit.differs and not f.split_idle]
    if block and apart:  # block-unit: needed where a built scheduler shows the sizes apart
        needed_by[Rule.BLOCK_UNIT] = apart
    needed = _release_needs(base, ("code", "version")) if base is not None else frozenset()
    return Found(base, needed, {r: tuple(c) for r, c in needed_by.items()}, facts)


@dataclasses.dataclass(frozen=True)
class Policy:
    verdict: str  # a key of report.VERDICT_TEXT
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
class Setup:
    """What the records cannot hold: the release, what the settings let run, the engine's
    speculative set-up and whether vLLM loads the plugin."""

    family: Family
    version: str
    should_patch: bool  # the plugin will act (not off, the version readable or forced)
    preflight_reason: str
    by_version: Plan  # what the release data alone says (where no record was kept)
    not_eagle: str = ""  # the method of a --speculative-config that is not EAGLE-type
    # Per-scheduler rules the set-up shows will engage, with why (a drafter's own KV group).
    foreseen: Mapping[Rule, str] = dataclasses.field(default_factory=dict)
    delivered: bool = True  # the entry point is found and VLLM_PLUGINS allows it


def needed_rules(found: Found, setup: Setup) -> frozenset[Rule]:
    """The fix rules this deployment needs."""
    if setup.family.verdict is Verdict.UNKNOWN:  # only force patches an unreadable version
        needed = {Rule.SPLIT} if setup.should_patch else set()
    elif found.base is None:  # nothing was read from code: the release data decides
        by_version = setup.by_version
        needed = {r for r in FIX_RULES if r not in PER_SCHEDULER and by_version.verdict(r).active}
    else:
        needed = set(found.needed)
    needed |= set(found.needed_by) | set(setup.foreseen)
    if setup.not_eagle:
        needed.discard(Rule.SPECULATIVE_STALL)
    return frozenset(needed)


def spared(found: Found, setup: Setup) -> str:
    """The speculative-stall rule let off by a --speculative-config that is not EAGLE-type."""
    release = found.release or setup.by_version
    if setup.not_eagle and release.verdict(Rule.SPECULATIVE_STALL).active:
        return f"speculative-stall [--speculative-config: {setup.not_eagle} is not EAGLE-type]"
    return ""


def policy(found: Found, setup: Setup) -> Policy:
    """What the release needs and whether the plugin will act."""
    family, version, should_patch = setup.family, setup.version, setup.should_patch
    needed = needed_rules(found, setup)
    by_code = found.release or setup.by_version
    reason = setup.preflight_reason
    if needed:
        verdict = "needed-will-patch" if should_patch else "needed-will-not-patch"
        if should_patch:
            reason = _needed_reason(version, needed, by_code, found.needed_by, setup.foreseen)
    elif family.verdict is Verdict.UNKNOWN:
        verdict = "unsupported"
    elif family.verdict is not Verdict.ABSENT:
        per_scheduler = PER_SCHEDULER & found.installed if setup.delivered else frozenset()
        verdict, reason = _unneeded(version, by_code, spared(found, setup), per_scheduler,
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
            raw = delivery.vllm_plugins_env or ""
            spaced = PLUGIN_NAME in (part.strip() for part in raw.split(","))
            found.append(
                f"{ENV_VLLM_PLUGINS}={raw!r} does not list {PLUGIN_NAME!r}; vLLM will not load "
                "the plugin" + (" (vLLM does not strip spaces around names)" if spaced else "")
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
    if not chosen.needed and chosen.verdict != "installed-per-scheduler":
        return "not-needed"  # installed-per-scheduler: a rule installs, so never "not needed"
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


# Why a rule would not run, from the install records: problems and warnings.
def rule_problems(found: Found, dry_error: str | None) -> dict[Rule, str]:
    """Why each rule the base class's plan gives would not run on it, from its record."""
    result: dict[Rule, str] = {}
    base = found.base
    for rule in base.left_out if base is not None else frozenset():
        method = base.method(rules.RULE_METHOD[rule])
        why = (method.note or method.describe()) if method is not None else dry_error
        result[rule] = f"{rule.value} would not apply: {why or 'no scheduler'}"
    return result


def switched_off(
    decided: Plan | None, needed: frozenset[Rule], settings: Settings
) -> dict[Rule, str]:
    """Needed rules that the settings the plugin runs with switch off (the table's switch)."""
    found: dict[Rule, str] = {}
    for spec in rules.RULES:
        if decided is None or spec.rule not in needed or decided.verdict(spec.rule).active:
            continue
        if spec.switch in settings.switched_off:
            found[spec.rule] = f"{spec.rule.value} is switched off by {spec.switch}=0"
    return found


def rule_warnings(entries: list[dict[str, Any]]) -> list[str]:
    """Rules that would not run, where that breaks nothing the release is known to need."""
    found: list[str] = []
    for entry in entries:
        if entry["problem"] and not entry["needed"] and entry["active"]:
            found.append(entry["problem"])
        # block-unit off where the release has the split (and no built scheduler needs it).
        if (
            entry["rule"] == Rule.BLOCK_UNIT.value
            and entry["version"]["active"]
            and not entry["active"]
            and not entry["needed"]
        ):
            found.append(
                f"block-unit will not run ({entry['decided_by']}: {entry['reason']}); where a "
                f"scheduler's Mamba KV cache block differs from cache_config.block_size, {PIN_HINT}"
            )
    return found
