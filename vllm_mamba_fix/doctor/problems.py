"""Why a rule would not run, from the typed record and the plans: problems and warnings."""

from __future__ import annotations

from typing import Any

from vllm_mamba_fix.decide.policy import Rule
from vllm_mamba_fix.doctor.plans import Views
from vllm_mamba_fix.doctor.verdict import PIN_HINT
from vllm_mamba_fix.facts.config import Settings
from vllm_mamba_fix.observe.record import ClassRecord
from vllm_mamba_fix.rules import table as rules


def rule_problems(
    plans: Views, base_record: ClassRecord | None, dry_error: str | None
) -> dict[Rule, str]:
    """Why each planned rule would not install on the base class, from its record."""
    found: dict[Rule, str] = {}
    for rule in plans.planned - plans.installed:
        method = base_record.method(rules.RULE_METHOD[rule]) if base_record else None
        if method is not None and method.note:
            why = method.note
        elif method is not None:
            why = method.describe()
        else:
            why = dry_error or "no scheduler"
        found[rule] = f"{rule.value} would not apply: {why}"
    return found


def switched_off(plans: Views, needed: frozenset[Rule], settings: Settings) -> dict[Rule, str]:
    """Needed rules that the settings the plugin runs with switch off (the table's switch)."""
    decided = plans.decided
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
