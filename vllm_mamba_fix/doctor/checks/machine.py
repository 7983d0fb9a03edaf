"""The machine, for ``doctor --report``: Python, OS, CPU, GPU, torch and vLLM's platform.

Cheap reads only, as vLLM's ``collect_env`` names them, and never a new import of torch or
vLLM: torch is read where vLLM's import already loaded it (its version from the installed
distribution otherwise), CUDA is asked only of a CUDA build of torch, GPU names come from
``nvidia-smi -L`` (what ``collect_env`` runs), and vLLM's platform only where vLLM resolved it.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

from vllm_mamba_fix.doctor.report import one_line

_SMI_TIMEOUT = 5.0  # seconds: a hung driver must not hang the report


def _distribution_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def os_name() -> str:
    """``PRETTY_NAME`` of os-release where there is one (``collect_env``'s OS), and the kernel."""
    pretty = None
    with contextlib.suppress(OSError, AttributeError):  # no os-release; Python < 3.10
        pretty = platform.freedesktop_os_release().get("PRETTY_NAME")
    kernel = platform.platform()
    return f"{pretty} ({kernel})" if pretty else kernel


def cpu_name() -> str:
    """The first ``model name`` of /proc/cpuinfo (Linux), else ``platform.processor()``."""
    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown"
    return f"{name}, {os.cpu_count() or '?'} logical cores ({platform.machine()})"


def torch_facts() -> dict[str, Any]:
    """torch's version and build; CUDA asked only of a CUDA build vLLM already imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {"version": _distribution_version("torch"), "imported": False}
    built = getattr(torch, "version", None)
    facts: dict[str, Any] = {
        "version": str(getattr(torch, "__version__", "unknown")),
        "imported": True,
        "cuda": getattr(built, "cuda", None),
        "hip": getattr(built, "hip", None),
    }
    if facts["cuda"] or facts["hip"]:
        try:
            facts["gpu_available"] = bool(torch.cuda.is_available())
        except Exception as exc:
            facts["gpu_available"] = one_line(exc)
    return facts


def gpu_names() -> str:
    """``nvidia-smi -L``'s GPUs, or why there are none to name."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "none named (no nvidia-smi on PATH)"
    try:
        out = subprocess.run(
            [smi, "-L"], capture_output=True, text=True, timeout=_SMI_TIMEOUT, check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi -L failed ({one_line(exc)})"
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not lines:
        return f"nvidia-smi -L: exit {out.returncode}, {len(lines)} GPUs"
    return "; ".join(lines)


def vllm_platform() -> str | None:
    """vLLM's ``current_platform`` where vLLM already resolved it (resolving it may probe
    devices), as ``CpuPlatform (device cpu)``."""
    module = sys.modules.get("vllm.platforms")
    found = getattr(module, "_current_platform", None) if module is not None else None
    if found is None:
        return None
    device = getattr(found, "device_type", None) or getattr(found, "device_name", None)
    return f"{type(found).__name__} (device {device})" if device else type(found).__name__


def collect() -> dict[str, Any]:
    """Every fact above; none raises (a failure is the fact's text)."""
    facts: dict[str, Any] = {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "executable": sys.executable,
    }
    for key, read in (
        ("os", os_name),
        ("cpu", cpu_name),
        ("gpu", gpu_names),
        ("torch", torch_facts),
        ("vllm_platform", vllm_platform),
    ):
        try:
            facts[key] = read()
        except Exception as exc:  # a fact we cannot read must not stop the report
            facts[key] = f"unreadable ({one_line(exc)})"
    return facts
