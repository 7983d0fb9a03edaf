"""Will vLLM load and run the plugin: its entry point, ``VLLM_PLUGINS``, the plugin's settings
(read through :mod:`vllm_mamba_fix.facts.config`), and the platform plugins installed."""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from vllm_mamba_fix._version import __version__
from vllm_mamba_fix.doctor.report import Report, one_line, package_path
from vllm_mamba_fix.doctor.verdict import Delivery
from vllm_mamba_fix.facts import config
from vllm_mamba_fix.facts.config import ENV_MODE, ENV_VLLM_PLUGINS, PLUGIN_NAME, Settings
from vllm_mamba_fix.rules.table import RULES

PLUGIN_GROUP = "vllm.general_plugins"


def check_entry_point(report: Report, register: Callable[..., Any]) -> str | None:
    """Why vLLM's loader would not reach ``register``, the plugin's (None: it would)."""
    info: dict[str, Any] = {"group": PLUGIN_GROUP, "name": PLUGIN_NAME, "found": False}
    report.data["entry_point"] = info
    try:
        found = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    except Exception as exc:
        info["error"] = f"cannot read entry points ({one_line(exc)})"
        return info["error"]
    if not found:
        info["error"] = (
            f"no {PLUGIN_GROUP} entry point named {PLUGIN_NAME!r} in {sys.executable}; "
            "vLLM will never call the plugin"
        )
        return info["error"]
    ep = found[-1]  # vLLM keeps the last one of a name
    dist = getattr(ep, "dist", None)
    info.update(found=True, value=ep.value, distribution=dist.name if dist else None,
                distribution_version=dist.version if dist else None, count=len(found))  # fmt: skip
    if len(found) > 1:
        owners = ", ".join(str(getattr(getattr(e, "dist", None), "name", "?")) for e in found)
        report.warnings.append(f"{len(found)} entry points named {PLUGIN_NAME!r} ({owners})")
    try:
        func = ep.load()
    except Exception as exc:
        info["error"] = f"{ep.value} does not load ({one_line(exc)})"
        return info["error"]
    if func is not register:
        info["error"] = f"{PLUGIN_NAME!r} resolves to {ep.value}, not vllm_mamba_fix:register"
        return info["error"]
    if dist and dist.version != __version__:
        report.warnings.append(
            f"installed metadata says {dist.name} {dist.version}, but this interpreter imports "
            f"vllm_mamba_fix {__version__} from {package_path()}"
        )
    return None


def check_delivery(report: Report, settings: Settings, register: Callable[..., Any]) -> Delivery:
    """The entry point, ``VLLM_PLUGINS`` and the settings (``register``: core hands it over)."""
    error = check_entry_point(report, register)
    raw = config.raw_values((ENV_VLLM_PLUGINS,))[ENV_VLLM_PLUGINS]
    allows = config.vllm_plugins_allows()
    report.data["vllm_plugins"] = {"value": raw, "allows": allows}
    switched = {  # per rule switch of the table (config.SWITCHES): its rule, whether on
        spec.switch: {"rule": spec.rule.value, "on": settings.switched_on(spec.switch)}
        for spec in RULES
        if spec.switch in config.SWITCHES
    }
    report.data["settings"] = {
        "mode": settings.mode.value,
        "scope": settings.scope.value,
        "stall_seconds": settings.stall_seconds,
        "end_stalls_after": settings.end_stalls_after,
        "switches": switched,
        "env": config.raw_values(config.ALL_VARIABLES),
        "other_env": config.other_variables(),
        "problems": list(settings.problems),
    }
    report.warnings.extend(f"invalid value: {problem}" for problem in settings.problems)
    return Delivery(settings.mode, report.data["settings"]["env"][ENV_MODE], error, allows, raw)


def check_platform_plugins(report: Report) -> None:
    try:
        found = [f"{ep.name} -> {ep.value}" for ep in entry_points(group="vllm.platform_plugins")]
    except Exception:
        found = []
    report.data["platform_plugins"] = found
    if found:
        report.warnings.append(
            f"platform plugins installed ({'; '.join(found)}): a platform may choose its "
            "own scheduler class; check it with --scheduler-cls"
        )
