"""The code evidence and, per rule, what the version says, what the code says, and which decided."""

from __future__ import annotations

from typing import Any

from vllm_mamba_fix.config import ENV_STALL_SECONDS, Mode, Settings
from vllm_mamba_fix.doctor.report import Report
from vllm_mamba_fix.evidence import Evidence
from vllm_mamba_fix.policy import Plan, Rule, RuleVerdict
from vllm_mamba_fix.rules import RULE_METHOD, plan
from vllm_mamba_fix.versions import Family

_A_SETTING = {"active": None, "reason": f"a setting ({ENV_STALL_SECONDS}), not a fix"}


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


def _code_verdict(
    rule: Rule, family: Family, evidence: Evidence, by_code: RuleVerdict
) -> dict[str, Any]:
    """What the code alone says about ``rule``: active None when it says nothing."""
    if rule is Rule.STALL_WATCHDOG:
        return dict(_A_SETTING)
    if by_code.basis == "code":
        return {"active": by_code.active, "reason": by_code.reason}
    if rule is Rule.SPECULATIVE_STALL and not family.drafter_fallback:
        return {"active": None, "reason": "not consulted: no drafter fallback on this release"}
    if rule is Rule.SPLIT:
        return {"active": None, "reason": evidence.problem or "unreadable"}
    return {"active": None, "reason": "could not read Scheduler._free_encoder_inputs"}


def rule_table(
    family: Family,
    evidence: Evidence,
    settings: Settings,
    by_version: Plan,
    by_code: Plan,
    decided: Plan | None,
    inactive_reason: str,
) -> list[dict[str, Any]]:
    """Per rule: the version's and the code's verdicts, and which one decided."""
    rules: list[dict[str, Any]] = []
    for rule in Rule:
        by_release = by_version.verdict(rule)
        version = {"active": by_release.active, "reason": by_release.reason}
        if rule is Rule.STALL_WATCHDOG:
            version = dict(_A_SETTING)
        code = _code_verdict(rule, family, evidence, by_code.verdict(rule))
        if decided is not None:
            chosen = decided.verdict(rule)
            active, basis, reason = chosen.active, chosen.basis, chosen.reason
        else:
            active, basis = False, "setting" if settings.mode is Mode.OFF else "version"
            reason = inactive_reason
        rules.append(
            {
                "rule": rule.value,
                "method": RULE_METHOD[rule],
                "version": version,
                "code": code,
                "decided_by": basis,
                "active": active,
                "reason": reason,
            }
        )
    return rules


def version_plan(family: Family, stall_seconds: float | None) -> Plan:
    """What the release data alone decides (no code read)."""
    return plan(Settings(stall_seconds=stall_seconds), family, Evidence())


def rule_lines(
    report: Report, rules: list[dict[str, Any]], family: Family, settings: Settings
) -> None:
    yes = {True: "needed", False: "not needed", None: "says nothing"}
    for entry in rules:
        rule = Rule(entry["rule"])
        if rule is Rule.STALL_WATCHDOG:
            if entry["active"]:
                text = (
                    f"active ({ENV_STALL_SECONDS}): names a request that gets 0 tokens for "
                    f"{settings.stall_seconds:g} s and 3+ steps"
                )
                mark = "ok"
                if entry["problem"]:
                    text, mark = f"{text}; but it would NOT install (see the warning)", "warn"
            else:
                text, mark = f"inactive, by {entry['decided_by']}: {entry['reason']}", "info"
            report.add(mark, rule.value, text)
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
