"""``VLLM_PLUGINS`` (whether vLLM would load the plugin) and the platform plugins installed."""

from __future__ import annotations

from vllm_mamba_fix.doctor.report import Report
from vllm_mamba_fix.facts.config import ENV_VLLM_PLUGINS, raw_values, vllm_plugins_allows

PLATFORM_GROUP = "vllm.platform_plugins"


def check_vllm_plugins(report: Report) -> bool:
    raw = raw_values((ENV_VLLM_PLUGINS,))[ENV_VLLM_PLUGINS]
    allows = vllm_plugins_allows()
    report.data["vllm_plugins"] = {"value": raw, "allows": allows}
    return allows


def check_platform_plugins(report: Report) -> None:
    from importlib.metadata import entry_points

    try:
        platforms = [f"{ep.name} -> {ep.value}" for ep in entry_points(group=PLATFORM_GROUP)]
    except Exception:
        platforms = []
    report.data["platform_plugins"] = platforms
    if platforms:
        report.warnings.append(
            f"platform plugins installed ({'; '.join(platforms)}): a platform may choose its "
            "own scheduler class; check it with --scheduler-cls"
        )
