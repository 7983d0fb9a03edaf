"""The verdict, pure functions: :func:`of_records` reads its one input, the install records (of
a real ``register()`` or of doctor's dry run of it); :func:`policy` adds what no record holds."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_mamba_fix.decide.policy import Plan, Rule, RuleVerdict
from vllm_mamba_fix.doctor.report import names_text
from vllm_mamba_fix.facts.config import ENV_MODE, ENV_VLLM_PLUGINS, PLUGIN_NAME, Mode, Settings
from vllm_mamba_fix.facts.evidence import Evidence
from vllm_mamba_fix.facts.targets import SCHEDULER_CLASS, SCHEDULER_MODULE
from vllm_mamba_fix.facts.versions import Family, Verdict
from vllm_mamba_fix.observe.record import ClassRecord
from vllm_mamba_fix.rules.table import FIX_RULES, RULE_METHOD, RULES

BASE_SCHEDULER = f"{SCHEDULER_MODULE}.{SCHEDULER_CLASS}"
# FIX_RULES end a deadlock or a wrong token; the watchdog and stall-end only name or end
# stalls, so one that would not install is a warning, never "not protected". Block-unit engages
# per built scheduler (where its two block sizes differ): only a built one's record needs it.
PER_SCHEDULER: frozenset[Rule] = frozenset({Rule.BLOCK_UNIT})


def block_fact(record: ClassRecord) -> dict[str, object]:
    unit = record.block  # only built schedulers' records are facts: never None
    engaged = Rule.BLOCK_UNIT in record.rules and unit.differs and not record.split_idle
    return {"class": record.scheduler_class, "block_size": unit.mamba,
            "cache_config_block_size": unit.configured, "differs": unit.differs,
            "engaged": engaged, "split_idle": record.split_idle,
            "problem": unit.problem}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Found:  # what the install records say (of_records)
    base: ClassRecord | None  # the base Scheduler's record; None: the plugin kept none
    needed: frozenset[Rule]  # fix rules the base's code or version needs, before any setting
    # Rules a class needs beyond the base: by its own schedule(), or by a built one's block sizes.
    needed_by: Mapping[Rule, tuple[str, ...]]
    facts: tuple[ClassRecord, ...]  # the records of schedulers built in this process

    @property
    def installed(self) -> frozenset[Rule]:
        return self.base.rules if self.base is not None else frozenset()

    @property
    def planned(self) -> frozenset[Rule]:
        return self.base.plan.rules if self.base is not None else frozenset()

    @property
    def release(self) -> Plan | None:  # the base's plan before any setting
        return Plan(tuple(v.by_release for v in self.base.plan.verdicts)) if self.base else None

    def decided(self, will_patch: bool) -> Plan | None:  # None: the plugin will not act
        return self.base.plan if will_patch and self.base is not None else None


def _release_needs(record: ClassRecord, basis: tuple[str, ...]) -> list[Rule]:
    verdicts = (v.by_release for v in record.plan.verdicts)
    return [v.rule for v in verdicts if v.active and v.basis in basis and v.rule in FIX_RULES
            and v.rule not in PER_SCHEDULER]  # fmt: skip


def of_records(records: Sequence[ClassRecord]) -> Found:
    """The one input read: what runs, what the release needs and which class needs more."""
    base = next((r for r in records if r.scheduler_class == BASE_SCHEDULER), None)
    needed_by: dict[Rule, list[str]] = {}
    for found in records:  # a class with its own schedule(): its code decides for it
        if found.evidence.schedule_owner != SCHEDULER_CLASS:
            for rule in _release_needs(found, ("code",)):
                needed_by.setdefault(rule, []).append(found.scheduler_class)
    facts = tuple(r for r in records if r.block is not None)
    block = base is not None and base.plan.verdict(Rule.BLOCK_UNIT).by_release.active
    apart = [f.scheduler_class for f in facts if f.block and f.block.differs and not f.split_idle]
    if block and apart:  # block-unit: needed where a built scheduler shows the sizes apart
        needed_by[Rule.BLOCK_UNIT] = apart
    needed = frozenset(_release_needs(base, ("code", "version")) if base is not None else ())
    return Found(base, needed, {r: tuple(c) for r, c in needed_by.items()}, facts)


@dataclasses.dataclass(frozen=True)
class Policy:
    verdict: str  # a key of report.VERDICT_TEXT
    needed: frozenset[Rule]
    should_patch: bool
    reason: str

    def to_json(self) -> dict[str, object]:
        return {"verdict": self.verdict, "needed": bool(self.needed),
                "needed_rules": [r.value for r in FIX_RULES if r in self.needed],
                "should_patch": self.should_patch, "reason": self.reason}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Setup:  # what the records cannot hold
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
    if setup.family.verdict is Verdict.UNKNOWN:  # only force patches an unreadable version
        needed = {Rule.SPLIT} if setup.should_patch else set()
    elif found.base is None:  # nothing was read from code: the release data decides
        verdicts = setup.by_version.verdicts
        needed = {v.rule for v in verdicts if v.rule in FIX_RULES and v.active} - PER_SCHEDULER
    else:
        needed = set(found.needed)
    needed |= set(found.needed_by) | set(setup.foreseen)
    if setup.not_eagle:
        needed.discard(Rule.SPECULATIVE_STALL)
    return frozenset(needed)


def _said(v: RuleVerdict) -> str:
    return f"{v.rule.value} [{v.basis}: {v.reason}]"


def policy(found: Found, setup: Setup) -> Policy:
    needed, reason = needed_rules(found, setup), setup.preflight_reason
    if needed and setup.should_patch:
        verdict, reason = "needed-will-patch", _needed_reason(needed, found, setup)
    elif needed:
        verdict = "needed-will-not-patch"
    elif setup.family.verdict is Verdict.UNKNOWN:
        verdict = "unsupported"
    elif setup.family.verdict is not Verdict.ABSENT:
        verdict, reason = _unneeded(found, setup)
    else:
        verdict = "not-needed"
    return Policy(verdict, needed, setup.should_patch, reason)


def _needed_reason(needed: frozenset[Rule], found: Found, setup: Setup) -> str:
    """Why each needed rule is needed: code or version, the block sizes or set-up that make a
    per-scheduler rule engage; only force on an unreadable version needs it by setting."""
    by_code = found.release or setup.by_version

    def basis(rule: Rule) -> str:
        classes = ", ".join(found.needed_by.get(rule, ()))
        if rule in PER_SCHEDULER and rule in setup.foreseen:
            return setup.foreseen[rule]
        if rule in PER_SCHEDULER and classes:
            return f"the block sizes of the built {classes}"
        if by_code.verdict(rule).active:
            return by_code.verdict(rule).basis
        return f"the code of {classes}" if classes else "setting"

    reasons = [f"{r.value} (by {basis(r)})" for r in FIX_RULES if r in needed]
    return f"vLLM {setup.version} needs " + names_text(reasons)


def _unneeded(found: Found, setup: Setup) -> tuple[str, str]:
    """The verdict and reason where no rule is needed on an affected-family release."""
    by_code, version = found.release or setup.by_version, setup.version
    spared = []
    if setup.not_eagle and by_code.verdict(Rule.SPECULATIVE_STALL).active:
        spared = [f"speculative-stall [--speculative-config: {setup.not_eagle} is not EAGLE-type]"]
    fixes = [_said(v) for v in by_code.verdicts if v.rule in FIX_RULES and v.rule not in
             PER_SCHEDULER and not (spared and v.rule is Rule.SPECULATIVE_STALL)]  # fmt: skip
    installed = PER_SCHEDULER & found.installed if setup.delivered else frozenset()
    if installed and setup.should_patch:  # never "not needed" while a rule installs
        listed = "; ".join([*fixes, *spared])
        parts = "; ".join(_said(v) for v in by_code.verdicts if v.rule in installed)
        return "installed-per-scheduler", (
            f"vLLM {version} needs no rule by its code or version ({listed}); installed: {parts};"
            " it engages at engine start for each scheduler whose Mamba KV cache block differs "
            "from cache_config.block_size (the engine core sets that to the smallest KV cache "
            "group block)"
        )
    waiting = [
        f"{v.rule.value} [needed only where a built scheduler's Mamba KV cache block "
        "differs from cache_config.block_size; none shows it]"
        for v in by_code.verdicts
        if v.rule in PER_SCHEDULER and v.active
    ]
    return "not-needed", f"not needed on vLLM {version}: " + "; ".join([*fixes, *waiting, *spared])


@dataclasses.dataclass(frozen=True)
class Delivery:  # whether vLLM will load and run the plugin
    mode: Mode
    mode_env: str | None  # the raw VLLM_MAMBA_FIX value
    entry_point_error: str | None  # None: vLLM finds and loads ``register``
    vllm_plugins_allows: bool
    vllm_plugins_env: str | None


def problems(
    chosen: Policy,
    delivery: Delivery,
    rule_problems: dict[Rule, str],
    class_problems: Sequence[str],
) -> list[str]:
    """Why a needed rule would not apply, in the order an operator fixes them."""
    if not chosen.needed:
        return [chosen.reason] if chosen.verdict == "unsupported" else []
    found = [f"disabled by {ENV_MODE}={delivery.mode_env!r}"] if delivery.mode is Mode.OFF else []
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
    return [*found, *class_problems]


def status(chosen: Policy | None, bad_input: list[str], found_problems: list[str]) -> str:
    if bad_input:
        return "invalid-input"
    if chosen is None or chosen.verdict == "unsupported":
        return "unknown"
    if not chosen.needed and chosen.verdict != "installed-per-scheduler":
        return "not-needed"  # installed-per-scheduler: a rule installs, so never "not needed"
    return "not-protected" if found_problems else "protected"


def summary(status_: str, version: str | None, reason: str, found_problems: list[str]) -> str:
    if status_ == "invalid-input":
        return found_problems[0]
    if status_ == "not-protected":
        return f"vLLM {version} needs the fix but it would not apply: {found_problems[0]}"
    if status_ == "protected" and not reason.startswith(f"vLLM {version} needs no rule"):
        return f"{reason}; the fix will be applied"  # else: the reason says what runs and when
    return "vLLM is not importable in this interpreter" if version is None else reason


def rule_problems(found: Found, dry_error: str | None) -> dict[Rule, str]:
    """Why each rule the base class's plan gives would not run on it."""
    result: dict[Rule, str] = {}
    for rule in found.base.left_out if found.base is not None else ():
        method = found.base.method(RULE_METHOD[rule])
        why = (method.note or method.describe()) if method is not None else dry_error
        result[rule] = f"{rule.value} would not apply: {why or 'no scheduler'}"
    return result


def switched_off(
    decided: Plan | None, needed: frozenset[Rule], settings: Settings
) -> dict[Rule, str]:
    if decided is None:
        return {}
    off = [s for s in RULES if s.rule in needed and s.switch in settings.switched_off]
    return {
        s.rule: f"{s.rule.value} is switched off by {s.switch}=0"
        for s in off
        if not decided.verdict(s.rule).active
    }


def rule_warnings(entries: list[dict[str, Any]]) -> list[str]:
    """Rules that would not run, where that breaks nothing the release is known to need."""
    found: list[str] = []
    for e in entries:
        if e["problem"] and not e["needed"] and e["active"]:
            found.append(e["problem"])
        block = e["rule"] == Rule.BLOCK_UNIT.value and e["version"]["active"]
        if block and not e["active"] and not e["needed"]:
            found.append(
                f"block-unit will not run ({e['decided_by']}: {e['reason']}); where a "
                "scheduler's Mamba KV cache block differs from cache_config.block_size, vLLM's "
                "own chunks can end inside a cached block and cache a stale Mamba state (vLLM "
                "#54076): pin --block-size to the cache's block"
            )
    return found


def rule_entries(
    found: Found,
    setup: Setup,
    evidence: Evidence,
    needed: frozenset[Rule],
    inactive: tuple[str, str],
    problems: Mapping[Rule, str],
) -> list[dict[str, Any]]:
    """``inactive``: the basis and reason of every rule where the plugin will not act."""
    decided, release = found.decided(setup.should_patch), found.release or setup.by_version
    entries: list[dict[str, Any]] = []
    for spec in RULES:
        rule = spec.rule
        by_version, by_code = setup.by_version.verdict(rule), release.verdict(rule)
        version = {"active": by_version.active, "reason": by_version.reason}
        code = {"active": by_code.active, "reason": by_code.reason}
        if by_code.basis != "code":  # the code could not tell
            why = evidence.problem if rule is Rule.SPLIT else None
            code = {"active": None, "reason": why or f"not read from code: {by_code.reason}"}
        if not spec.fixes:
            version = code = {"active": None, "reason": f"a setting ({spec.switch}), not a fix"}
        chosen = decided.verdict(rule) if decided is not None else None
        basis, reason = (chosen.basis, chosen.reason) if chosen is not None else inactive
        entry = {"rule": rule.value, "method": spec.method, "switch": spec.switch,
                 "fixes": spec.fixes, "version": version, "code": code, "decided_by": basis,
                 "active": chosen is not None and chosen.active, "reason": reason,
                 "needed": rule in needed if spec.fixes else None,
                 "installs": rule in found.installed,
                 "needed_by_classes": list(found.needed_by.get(rule, ())),
                 "problem": problems.get(rule)}  # fmt: skip
        if rule in PER_SCHEDULER:
            # Only a built scheduler's record tells (a dry run builds none), or a set-up that
            # makes the sizes differ (a drafter with its own KV cache group).
            if not found.facts and rule not in setup.foreseen:
                entry["needed"] = None
            entry["block_facts"] = [block_fact(record) for record in found.facts]
            entry["foreseen"] = setup.foreseen.get(rule)
        entries.append(entry)
    return entries
