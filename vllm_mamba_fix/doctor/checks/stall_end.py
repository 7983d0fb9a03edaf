"""Whether a stall no rule can end can be ended on this release (``end_order.support(cls)``).

Per scheduler class the dry run loaded: where vLLM has no scheduler-side finish that
reaches the client, the plugin keeps naming the stall instead.
"""

from __future__ import annotations

import importlib
from typing import Any

from vllm_mamba_fix.doctor.checks.vllm_import import resolve_class
from vllm_mamba_fix.doctor.report import Report, names_text, one_line, stdout_to_stderr

MODULE = "vllm_mamba_fix.rules.end_order"  # read at run time: a build may lack it
LABEL = "ending stalls"


def check_stall_end(report: Report, class_names: list[str], active: bool) -> None:
    """One line (more where classes differ); an ImportError or a failure gives an info line."""
    info: dict[str, Any] = {"checked": False, "classes": {}}
    report.data["stall_end"] = info
    try:
        stall_end = importlib.import_module(MODULE)
    except ImportError as exc:
        info["error"] = one_line(exc)
        report.add(
            "info", LABEL, f"not checked: this build has no stall_end module ({info['error']})"
        )
        return
    try:
        with stdout_to_stderr():
            found = {name: stall_end.support(resolve_class(name)) for name in class_names}
    except Exception as exc:  # another module's fault must not stop the report
        info["error"] = one_line(exc)
        report.add("info", LABEL, f"cannot tell: {info['error']}")
        return
    info.update(checked=True, classes=found)
    can = [name.rsplit(".", 1)[-1] for name, why in found.items() if why is None]
    state = "" if active else " (the stall-end rule is off)"
    label = LABEL
    if can:
        text = f"vLLM's own finish reaches the client for {names_text(can)}{state}"
        report.add("ok" if active else "info", label, text)
        label = ""
    for name, why in found.items():
        if why is not None:
            text = f"{name}: cannot end a stall ({why}); it is only named"
            report.add("warn" if active else "info", label, text)
            label = ""
