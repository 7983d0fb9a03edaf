"""Shared helpers: subprocess workers under a watchdog, statistics, environments."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
RESULT_TAG = "BENCH-RESULT "
# Keep vLLM's own chatter out of the worker logs we keep for failures.
QUIET_ENV = {"VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


class WorkerError(RuntimeError):
    """A worker subprocess failed, timed out, or printed no result."""


@dataclass
class WorkerRun:
    result: Any
    seconds: float
    log_tail: str


def emit(result: Any) -> None:
    """Print a worker's result where :func:`run_worker` finds it."""
    print(RESULT_TAG + json.dumps(result, default=str), flush=True)


_live: set[subprocess.Popen[bytes]] = set()
_live_lock = threading.Lock()


def kill_all_workers() -> None:
    """Kill every worker still running (its process group): for an interrupted run."""
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        _kill_group(proc)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def worker_env(
    extra: dict[str, str | None] | None = None, pythonpath: str | None = None
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(QUIET_ENV)
    env["PYTHONPATH"] = pythonpath or os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def run_worker(
    args: Sequence[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
) -> WorkerRun:
    """Run ``python <args>`` in its own process group; kill the group after ``timeout`` s.

    The worker prints its result as one ``RESULT_TAG`` JSON line (the last one wins).
    """
    cmd = [sys.executable, *args]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env or worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    with _live_lock:
        _live.add(proc)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        _kill_group(proc)
        raise WorkerError(f"{' '.join(args)}: watchdog killed it after {timeout:.0f} s") from exc
    finally:
        _kill_group(proc)
        with _live_lock:
            _live.discard(proc)
    text = out.decode(errors="replace")
    seconds = time.monotonic() - start
    tail = "\n".join(text.strip().splitlines()[-30:])
    results = [ln[len(RESULT_TAG) :] for ln in text.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not results:
        raise WorkerError(f"{' '.join(args)}: exit code {proc.returncode}, output tail:\n{tail}")
    return WorkerRun(json.loads(results[-1]), seconds, tail)


Arm = TypeVar("Arm")


def arm_order(arms: Sequence[Arm], turn: int) -> list[Arm]:
    """The order side-by-side arms run in at ``turn``: every permutation in turn, so over a
    cycle (2 arms: 2 turns, 3 arms: 6) each arm runs in each place and before each other arm
    equally often. A rotation is not balanced past two arms: of three, the second always runs
    right after the first, and here the first step after ``gc.collect()`` is about 10% slower
    than the third, so three identical arms read 0.98 and 1.02 of the first."""
    orders = list(itertools.permutations(arms))
    return list(orders[turn % len(orders)])


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def quantiles(values: Sequence[float]) -> dict[str, float]:
    """Median and the 25th/75th percentiles (IQR) of ``values``."""
    if not values:
        return {"median": float("nan"), "p25": float("nan"), "p75": float("nan"), "n": 0}
    if len(values) < 4:
        return {"median": median(values), "p25": min(values), "p75": max(values), "n": len(values)}
    q = statistics.quantiles(values, n=4)
    return {"median": q[1], "p25": q[0], "p75": q[2], "n": len(values)}


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None or value != value:  # None or NaN
        return "n/a"
    return f"{value:.{digits}f}"
