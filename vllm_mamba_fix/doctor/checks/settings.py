"""The plugin's own settings (``VLLM_MAMBA_FIX*``), as the plugin will read them, through
:func:`vllm_mamba_fix.facts.config.raw_values` (the environment's one reader)."""

from __future__ import annotations

from vllm_mamba_fix.doctor.report import Report
from vllm_mamba_fix.facts import config
from vllm_mamba_fix.facts.config import Settings
from vllm_mamba_fix.rules import table as rules


def check_settings(report: Report, settings: Settings) -> None:
    env = config.raw_values(config.ALL_VARIABLES)
    switched = {  # per rule switch of the table (config.SWITCHES): its rule, whether on
        spec.switch: {"rule": spec.rule.value, "on": settings.switched_on(spec.switch)}
        for spec in rules.RULES
        if spec.switch in config.SWITCHES
    }
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
