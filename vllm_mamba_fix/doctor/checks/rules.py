"""Per rule of the table: what the version says, what the code says,
and which decided: the report's ``rules`` entries."""

from __future__ import annotations

from typing import Any

from vllm_mamba_fix.decide.policy import Plan, Rule, RuleVerdict
from vllm_mamba_fix.facts.evidence import Evidence
from vllm_mamba_fix.rules import table as rules


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
