"""The plugin's own settings (``VLLM_MAMBA_FIX*``), as the plugin will read them.

The raw values come through :func:`vllm_mamba_fix.facts.config.raw_values`, the one reader
of the environment; the per-rule switches are the rule table's.
"""

from __future__ import annotations

from typing import Any

from vllm_mamba_fix.doctor.report import Report, stall_end_text, watchdog_text
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
    text = (
        f"mode {settings.mode.value}, scope {settings.scope.value}, "
        f"{watchdog_text(settings.stall_seconds)}, {stall_end_text(settings.end_stalls_after)}"
    )
    report.add("ok" if not settings.problems else "warn", "settings", text)
    states = ", ".join(
        f"{name} {'on' if s['on'] else 'OFF'} ({s['rule']})" for name, s in switched.items()
    )
    report.add("info", "", f"rule switches: {states}")
    set_vars = ", ".join(f"{k}={v!r}" for k, v in env.items() if v is not None)
    if set_vars:
        report.add("info", "", f"from {set_vars}")
    for problem in settings.problems:
        report.add("warn", "", f"invalid value: {problem}")
        report.warnings.append(f"invalid value: {problem}")
