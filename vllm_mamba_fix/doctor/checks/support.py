"""What two other modules say this release supports; neither changes the verdict, and a build
without either (or one that fails) is not checked, never an error. ``metrics``: whether the
counters reach ``vllm serve``'s ``/metrics``; ``stall_end``: per scheduler class the dry run
loaded, whether a stall no rule can end can be ended (where vLLM has no scheduler-side finish
that reaches the client, the plugin keeps naming it instead)."""

from __future__ import annotations

import importlib
from typing import Any

from vllm_mamba_fix.doctor.checks.vllm_import import resolve_class
from vllm_mamba_fix.doctor.report import Report, one_line, stdout_to_stderr

# Read at run time: a build may lack them.
METRICS_MODULE = "vllm_mamba_fix.observe.metrics"
STALL_END_MODULE = "vllm_mamba_fix.rules.end_order"


def check_metrics(report: Report) -> None:
    info: dict[str, Any] = {"checked": False, "available": None}
    report.data["metrics"] = info
    try:
        available, reason = importlib.import_module(METRICS_MODULE).support()
    except ImportError as exc:
        info["reason"] = f"this build has no metrics module ({one_line(exc)})"
    except Exception as exc:  # another module's fault must not stop the report
        info["reason"] = one_line(exc)
    else:
        info.update(checked=True, available=bool(available), reason=reason)


def check_stall_end(report: Report, class_names: list[str]) -> None:
    """Per class: None where vLLM's own finish reaches the client, else why it is only named."""
    info: dict[str, Any] = {"checked": False, "classes": {}}
    report.data["stall_end"] = info
    try:
        stall_end = importlib.import_module(STALL_END_MODULE)
    except ImportError as exc:
        info["error"] = f"this build has no stall_end module ({one_line(exc)})"
        return
    try:
        with stdout_to_stderr():
            found = {name: stall_end.support(resolve_class(name)) for name in class_names}
    except Exception as exc:  # another module's fault must not stop the report
        info["error"] = one_line(exc)
        return
    info.update(checked=True, classes=found)
