"""Why a rule would not run, from the install records: problems and warnings."""

from __future__ import annotations

from typing import Any

from vllm_mamba_fix.decide.policy import Plan, Rule
from vllm_mamba_fix.doctor.verdict import PIN_HINT, Found
from vllm_mamba_fix.facts.config import Settings
from vllm_mamba_fix.rules import table as rules


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
