"""Section 4: what ``register()`` adds to a vLLM process, and the ``doctor`` run time.

Measured in processes that already imported vLLM, as ``load_general_plugins()`` finds them:

- ``hook``: the scheduler module is not imported yet (front end, workers): ``register()`` only
  installs an import hook; the patch runs when the scheduler module is imported (timed too).
  The process holds what ``vllm serve``'s front end holds when it first loads plugins (building
  its argument parser): ``vllm.entrypoints.openai.api_server``, which imports prometheus_client;
  workers and engine cores skip the metrics attach altogether (a multiprocessing child);
- ``imported``: the scheduler module is already imported (engine core): ``register()`` patches.

"cold" includes importing ``vllm_mamba_fix`` (the entry point load), first call in the process,
right after vLLM's own read of the ``vllm.general_plugins`` entry points, with a fresh temp
directory (the metrics sweep lists it; this machine's, which test runs fill, is timed apart).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import quantiles, run_worker, worker_env

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"


def _ms(ns: int) -> float:
    return ns / 1e6


def cold_register(case: str) -> dict[str, Any]:
    """Time the plugin's first load in this process. Must run before anything imports it."""
    if "vllm_mamba_fix" in sys.modules:
        raise RuntimeError("vllm_mamba_fix is already imported; cold start cannot be measured")
    import vllm

    if case == "imported":
        import vllm.v1.core.sched.scheduler
    else:
        _import_front_end()
        if SCHEDULER_MODULE in sys.modules:
            raise RuntimeError("the scheduler module is already imported")
    # What vLLM's load_plugins_by_group() has just done when it loads the entry point.
    importlib.metadata.entry_points(group="vllm.general_plugins")
    # A serving host's temp directory, which the metrics sweep lists: this one's holds what
    # test runs left (timed on its own below, as sweep_ms_here).
    machine_tmp, tempfile.tempdir = tempfile.gettempdir(), tempfile.mkdtemp()
    clock = time.perf_counter_ns
    t0 = clock()
    import vllm_mamba_fix
    from vllm_mamba_fix.install import plugin

    t1 = clock()
    patch_ns: list[int] = []
    original = plugin._patch_scheduler

    def timed(*args: Any, **kwargs: Any) -> None:
        start = clock()
        try:
            original(*args, **kwargs)
        finally:
            patch_ns.append(clock() - start)

    plugin._patch_scheduler = timed  # type: ignore[assignment]
    t2 = clock()
    vllm_mamba_fix.register()
    t3 = clock()
    import_ns = 0
    if case == "hook":
        t4 = clock()
        import vllm.v1.core.sched.scheduler  # noqa: F401

        import_ns = clock() - t4
    plugin._patch_scheduler = original  # type: ignore[assignment]
    shutil.rmtree(tempfile.tempdir, ignore_errors=True)
    tempfile.tempdir = machine_tmp
    from tools.sched_harness import split_is_wrapped

    result = {
        "case": case,
        "import_ms": _ms(t1 - t0),
        "register_ms": _ms(t3 - t2),
        "deferred_patch_ms": _ms(sum(patch_ns)) if case == "hook" else 0.0,
        "patched": split_is_wrapped(),
        "scheduler_import_ms": _ms(import_ns),
        **_sweep_here(machine_tmp),
    }
    result["total_ms"] = result["import_ms"] + result["register_ms"] + result["deferred_patch_ms"]
    return result


def _sweep_here(directory: str) -> dict[str, Any]:
    """The metrics sweep over this machine's temp directory, which test runs fill."""
    from vllm_mamba_fix.observe import metrics_sweep

    t0 = time.perf_counter_ns()
    metrics_sweep.sweep(directory=directory)
    return {
        "sweep_ms_here": _ms(time.perf_counter_ns() - t0),
        "tmp_entries": len(os.listdir(directory)),
    }


def _import_front_end() -> None:
    """What ``vllm serve`` has imported when ``load_general_plugins()`` first runs (in vLLM's
    ``EngineArgs.add_cli_args``, after ``vllm.entrypoints.cli.serve`` imported the API
    server). A release without that module: the bare process."""
    with contextlib.suppress(ImportError):
        import vllm.entrypoints.openai.api_server  # noqa: F401


def warm_register(repeats: int) -> dict[str, Any]:
    """``register()`` again after ``unregister()``, scheduler imported (module cached)."""
    import vllm_mamba_fix

    times = []
    for _ in range(repeats):
        vllm_mamba_fix.unregister()
        t0 = time.perf_counter_ns()
        vllm_mamba_fix.register()
        times.append(_ms(time.perf_counter_ns() - t0))
    return quantiles(times)


def doctor_command() -> list[str] | None:
    """The console script, or None when the doctor is not there (yet)."""
    try:
        import vllm_mamba_fix.doctor  # noqa: F401
    except ImportError:
        return None
    script = Path(sys.executable).with_name("vllm-mamba-fix")
    if script.exists():
        return [str(script), "doctor"]
    found = shutil.which("vllm-mamba-fix")
    return [found, "doctor"] if found else None


def time_doctor(repeats: int, timeout: float) -> dict[str, Any]:
    """Wall time of ``vllm-mamba-fix doctor`` (fresh process each; includes importing vLLM)."""
    import subprocess

    cmd = doctor_command()
    if cmd is None:
        return {"skipped": "vllm_mamba_fix.doctor or its console script is absent"}
    times, codes = [], []
    for _ in range(repeats):
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, env=worker_env(), capture_output=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return {"skipped": f"doctor timed out after {timeout:.0f} s"}
        times.append(time.monotonic() - t0)
        codes.append(proc.returncode)
    return {"command": " ".join(Path(c).name for c in cmd), "seconds": quantiles(times),
            "exit_codes": codes}  # fmt: skip


def run_imported_case(timeout: float) -> dict[str, Any]:
    """The ``imported`` cold case needs its own process (the worker's is taken by ``hook``)."""
    return run_worker(
        ["-m", "benchmarks.worker", "--tasks", "startup_imported"], timeout=timeout
    ).result["startup_imported"]
