"""The plugin's own settings (``VLLM_MAMBA_FIX*``), as the plugin will read them.

The raw values come through :func:`vllm_mamba_fix.facts.config.raw_values`, the one reader
of the environment; the per-rule switches are the rule table's.
"""

from __future__ import annotations

from typing import Any

from vllm_mamba_fix.doctor.report import Report
from vllm_mamba_fix.facts import config
from vllm_mamba_fix.facts.config import Settings
from vllm_mamba_fix.rules import table as rules


def switches(settings: Settings) -> dict[str, dict[str, Any]]:
    """Per rule switch of the table (``config.SWITCHES``): the rule and whether it is on."""
    return {
        spec.switch: {"rule": spec.rule.value, "on": settings.switched_on(spec.switch)}
        for spec in rules.RULES
        if spec.switch in config.SWITCHES
    }


def check_settings(report: Report, settings: Settings) -> None:
    env = config.raw_values(config.ALL_VARIABLES)
    switched = switches(settings)
    report.data["settings"] = {
        "mode": settings.mode.value,
        "scope": settings.scope.value,
        "stall_seconds": settings.stall_seconds,
        "end_stalls_after": settings.end_stalls_after,
        "switches": switched,
        "env": env,
        "other_env": config.other_variables(),
        "problems": list(settings.problems),
    }
    report.warnings.extend(f"invalid value: {problem}" for problem in settings.problems)
