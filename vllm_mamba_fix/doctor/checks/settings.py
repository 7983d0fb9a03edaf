"""The plugin's own settings (``VLLM_MAMBA_FIX*``), as the plugin will read them."""

from __future__ import annotations

import os

from vllm_mamba_fix.config import ENV_MODE, ENV_SCOPE, ENV_STALL_SECONDS, Settings
from vllm_mamba_fix.doctor.report import Report


def watchdog_text(seconds: float | None) -> str:
    return "stall watchdog off" if seconds is None else f"stall watchdog after {seconds:g} s"


def check_settings(report: Report, settings: Settings) -> None:
    env = {name: os.environ.get(name) for name in (ENV_MODE, ENV_SCOPE, ENV_STALL_SECONDS)}
    report.data["settings"] = {
        "mode": settings.mode.value,
        "scope": settings.scope.value,
        "stall_seconds": settings.stall_seconds,
        "env": env,
        "problems": list(settings.problems),
    }
    text = (
        f"mode {settings.mode.value}, scope {settings.scope.value}, "
        f"{watchdog_text(settings.stall_seconds)}"
    )
    set_vars = ", ".join(f"{k}={v!r}" for k, v in env.items() if v is not None)
    report.add("ok" if not settings.problems else "warn", "settings", text)
    if set_vars:
        report.add("info", "", f"from {set_vars}")
    for problem in settings.problems:
        report.add("warn", "", f"invalid value: {problem}")
        report.warnings.append(f"invalid value: {problem}")
