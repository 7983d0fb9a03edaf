"""Will vLLM load the plugin: whether its loader would find and load ``register``, and whether
``VLLM_PLUGINS`` allows it; and the platform plugins installed."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from vllm_mamba_fix._version import __version__
from vllm_mamba_fix.doctor.report import Report, one_line, package_path
from vllm_mamba_fix.facts.config import (
    ENV_VLLM_PLUGINS,
    PLUGIN_NAME,
    raw_values,
    vllm_plugins_allows,
)

PLUGIN_GROUP = "vllm.general_plugins"
ENTRY_POINT_VALUE = "vllm_mamba_fix:register"
PLATFORM_GROUP = "vllm.platform_plugins"


def check_entry_point(report: Report, register: Callable[..., Any]) -> bool:
    """Whether the entry point resolves to ``register``, the plugin's (core hands it over)."""
    from importlib.metadata import entry_points

    info: dict[str, Any] = {"group": PLUGIN_GROUP, "name": PLUGIN_NAME, "found": False}
    report.data["entry_point"] = info
    try:
        found = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    except Exception as exc:
        info["error"] = f"cannot read entry points ({one_line(exc)})"
        return False
    if not found:
        info["error"] = (
            f"no {PLUGIN_GROUP} entry point named {PLUGIN_NAME!r} in {sys.executable}; "
            "vLLM will never call the plugin"
        )
        return False
    ep = found[-1]  # vLLM keeps the last one of a name
    dist = getattr(ep, "dist", None)
    info.update(
        found=True,
        value=ep.value,
        distribution=dist.name if dist else None,
        distribution_version=dist.version if dist else None,
        count=len(found),
    )
    if len(found) > 1:
        owners = ", ".join(str(getattr(getattr(e, "dist", None), "name", "?")) for e in found)
        report.warnings.append(f"{len(found)} entry points named {PLUGIN_NAME!r} ({owners})")
    try:
        func = ep.load()
    except Exception as exc:
        info["error"] = f"{ep.value} does not load ({one_line(exc)})"
        return False
    if func is not register:
        info["error"] = f"{PLUGIN_NAME!r} resolves to {ep.value}, not {ENTRY_POINT_VALUE}"
        return False
    if dist and dist.version != __version__:
        report.warnings.append(
            f"installed metadata says {dist.name} {dist.version}, but this interpreter imports "
            f"vllm_mamba_fix {__version__} from {package_path()}"
        )
    return True


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
