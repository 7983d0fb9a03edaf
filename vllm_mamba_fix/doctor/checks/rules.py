"""The code evidence and, per rule of the table, what the version says, what the code says,
and which decided; then one line (or a few) per rule."""

from __future__ import annotations

from typing import Any

from vllm_mamba_fix.decide.policy import Plan, Rule, RuleVerdict
from vllm_mamba_fix.doctor.report import Report
from vllm_mamba_fix.doctor.verdict import ENGAGES_AT_START, PER_SCHEDULER_TEXT, PIN_HINT, BlockFact
from vllm_mamba_fix.facts.config import ENV_END_STALLS_AFTER, ENV_STALL_SECONDS, Settings
from vllm_mamba_fix.facts.evidence import Evidence
from vllm_mamba_fix.facts.versions import Family
from vllm_mamba_fix.rules import table as rules

NOT_SEEN = "a dry run builds no scheduler, so it cannot tell yet"


def evidence_json(evidence: Evidence, read_from: str | None) -> dict[str, Any]:
    return {
        "read_from": read_from,
        "split_after_encoder": evidence.split_after_encoder,
        "deferred_encoder_free": evidence.deferred_encoder_free,
        "problem": evidence.problem,
    }


def evidence_text(evidence: Evidence) -> str:
    owner = evidence.schedule_owner
    order = {
        True: f"{owner}.schedule budgets encoder inputs before the split",
        False: f"{owner}.schedule splits before encoder budgeting",
        None: f"the order of split and encoder budgeting in {owner}.schedule is unreadable",
    }[evidence.split_after_encoder]
    free = {
        True: "Scheduler._free_encoder_inputs defers frees by the drafter's look-ahead",
        False: "Scheduler._free_encoder_inputs frees without a look-ahead",
        None: "Scheduler._free_encoder_inputs is unreadable",
    }[evidence.deferred_encoder_free]
    return f"{order}; {free}"


def _a_setting(spec: rules.RuleSpec) -> dict[str, Any]:
    return {"active": None, "reason": f"a setting ({spec.switch}), not a fix"}


def _code_verdict(spec: rules.RuleSpec, evidence: Evidence, release: RuleVerdict) -> dict[str, Any]:
    """What the code alone says about a rule (the record's verdict before any setting)."""
    if not spec.fixes:
        return _a_setting(spec)
    if release.basis == "code":
        return {"active": release.active, "reason": release.reason}
    why = evidence.problem if spec.rule is Rule.SPLIT else None
    return {"active": None, "reason": why or f"not read from code: {release.reason}"}


def rule_table(
    evidence: Evidence,
    by_version: Plan,
    release: Plan,
    decided: Plan | None,
    inactive: tuple[str, str],
) -> list[dict[str, Any]]:
    """Per rule of the table: the version's and the code's verdicts, and which one decided.

    ``release``: the base record's verdicts before any setting; ``decided``: what the plugin
    runs (None: it will not act, for ``inactive``'s basis and reason)."""
    entries: list[dict[str, Any]] = []
    for spec in rules.RULES:
        by_release = by_version.verdict(spec.rule)
        version = {"active": by_release.active, "reason": by_release.reason}
        if not spec.fixes:
            version = _a_setting(spec)
        code = _code_verdict(spec, evidence, release.verdict(spec.rule))
        active, (basis, reason) = False, inactive
        if decided is not None:
            chosen = decided.verdict(spec.rule)
            active, basis, reason = chosen.active, chosen.basis, chosen.reason
        entries.append(
            {
                "rule": spec.rule.value,
                "method": spec.method,
                "switch": spec.switch,
                "fixes": spec.fixes,
                "version": version,
                "code": code,
                "decided_by": basis,
                "active": active,
                "reason": reason,
            }
        )
    return entries


def _setting_rule_line(report: Report, entry: dict[str, Any], settings: Settings) -> None:
    rule = Rule(entry["rule"])
    if not entry["active"]:
        report.add("info", rule.value, f"inactive, by {entry['decided_by']}: {entry['reason']}")
        return
    if rule is Rule.STALL_END:
        text = (
            f"active ({ENV_END_STALLS_AFTER}): ends the request of a stall no rule can end, "
            f"{settings.end_stalls_after:g} s after the watchdog names it"
        )
    else:
        text = (
            f"active ({ENV_STALL_SECONDS}): names a request that gets 0 tokens for "
            f"{settings.stall_seconds:g} s and 3+ steps"
        )
    mark = "ok"
    if entry["problem"]:
        text, mark = f"{text}; but it would NOT install (see the warning)", "warn"
    report.add(mark, rule.value, text)


def _block_rule_lines(report: Report, entry: dict[str, Any], facts: tuple[BlockFact, ...]) -> None:
    """block-unit: active by the table; engaged per scheduler, which only a built one shows."""
    decided = f"by {entry['decided_by']}: {entry['reason']}"
    has_split = entry["version"]["active"]
    if entry["problem"]:
        mark = "fail" if entry["needed"] else "warn"
        report.add(mark, Rule.BLOCK_UNIT.value, f"would NOT apply; active {decided}")
    elif entry["active"]:
        report.add("ok", Rule.BLOCK_UNIT.value, f"active, {decided}")
    else:
        mark = "fail" if entry["needed"] else ("warn" if has_split else "info")
        report.add(mark, Rule.BLOCK_UNIT.value, f"inactive, {decided}")
    if not has_split:
        return
    if entry.get("foreseen") and not facts:
        will = "the rule will engage at engine start" if entry["active"] else "nothing aligns"
        report.add(
            "ok" if entry["active"] else "fail", "",
            f"the two block sizes will differ: {entry['foreseen']}; {will}",
        )  # fmt: skip
    elif entry["active"] and not facts:
        report.add("info", "", f"installed; it {ENGAGES_AT_START}; {NOT_SEEN} whether it will")
    elif not facts:
        report.add("info", "", f"{PER_SCHEDULER_TEXT}; {NOT_SEEN}")
    for fact in facts:
        report.add("info", "", fact.describe())
    if not entry["active"] and not entry["needed"]:
        report.add("info", "", f"where a scheduler's two block sizes differ, {PIN_HINT}")
    if entry["problem"]:
        report.add("fail" if entry["needed"] else "warn", "", entry["problem"])


def rule_lines(
    report: Report,
    entries: list[dict[str, Any]],
    family: Family,
    settings: Settings,
    facts: tuple[BlockFact, ...],
) -> None:
    yes = {True: "needed", False: "not needed", None: "says nothing"}
    for entry in entries:
        rule = Rule(entry["rule"])
        if not entry["fixes"]:
            _setting_rule_line(report, entry, settings)
            continue
        if rule is Rule.BLOCK_UNIT:
            _block_rule_lines(report, entry, facts)
            continue
        decided = f"by {entry['decided_by']}: {entry['reason']}"
        if entry["needed"] and entry["problem"]:
            mark, text = "fail", f"needed, but would NOT apply; active {decided}"
        elif entry["needed"] and not entry["active"] and entry.get("needed_by_classes"):
            classes = ", ".join(entry["needed_by_classes"])
            mark = "ok"
            text = f"off for Scheduler ({decided}); on for {classes}, by its own schedule()"
        elif entry["needed"] and not entry["active"]:
            mark, text = "fail", f"needed, but off {decided}"
        elif entry["active"]:
            mark, text = "ok", f"active, {decided}"
        else:
            mark, text = "info", f"inactive, {decided}"
        report.add(mark, rule.value, text)
        code = entry["code"]
        code_text = yes[code["active"]]
        if code["active"] is None:
            code_text += f" ({code['reason']})"
        report.add(
            "info",
            "",
            f"version (family {family.name}): {yes[entry['version']['active']]}; code: {code_text}",
        )
        if entry["problem"]:
            report.add("fail" if entry["needed"] else "warn", "", entry["problem"])
