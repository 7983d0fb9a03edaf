"""Whether the plugin's counters reach ``vllm serve``'s ``/metrics`` (``metrics.support()``)."""

from __future__ import annotations

import importlib

from vllm_mamba_fix.doctor.report import Report, one_line

MODULE = "vllm_mamba_fix.observe.metrics"  # read at run time: a build may lack it
LABEL = "metrics"


def check_metrics(report: Report) -> None:
    """One line; a build without the metrics module (or one that fails) gets an info line."""
    try:
        metrics = importlib.import_module(MODULE)
    except ImportError as exc:
        report.data["metrics"] = {"checked": False, "available": None, "reason": one_line(exc)}
        report.add(
            "info", LABEL, f"not checked: this build has no metrics module ({one_line(exc)})"
        )
        return
    try:
        available, reason = metrics.support()
    except Exception as exc:  # another module's fault must not stop the report
        report.data["metrics"] = {"checked": False, "available": None, "reason": one_line(exc)}
        report.add("info", LABEL, f"cannot tell: {one_line(exc)}")
        return
    report.data["metrics"] = {"checked": True, "available": bool(available), "reason": reason}
    if available:
        report.add("ok", LABEL, reason)
    else:
        report.add("warn", LABEL, f"counts stay in the engine core's log: {reason}")
