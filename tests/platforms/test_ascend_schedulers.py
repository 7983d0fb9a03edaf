"""vllm-ascend 0.23.0.post1's own ``Scheduler`` subclasses, run by the real vLLM (issue 16).

Opt-in: ascend's code is never copied into this repository. Point
``VLLM_MAMBA_FIX_ASCEND_SRC`` at the extracted sdist (the directory holding
``vllm_ascend/``); skipped otherwise::

    # the sdist's metadata step needs setuptools_scm and a chip name (no NPU)
    pip install --target /tmp/ascend/bd setuptools_scm
    SOC_VERSION=ascend910b1 PYTHONPATH=/tmp/ascend/bd pip download --no-deps \\
        --no-binary :all: --no-build-isolation vllm-ascend==0.23.0.post1 -d /tmp/ascend
    tar xf /tmp/ascend/vllm_ascend-0.23.0.post1.tar.gz -C /tmp/ascend
    VLLM_MAMBA_FIX_ASCEND_SRC=/tmp/ascend/vllm_ascend-0.23.0.post1 \\
        python -m pytest -p no:cacheprovider tests/platforms/test_ascend_schedulers.py

The subclasses run over their matching vLLM, 0.23.0 (ascend's docs pin it), overlaid in a
subprocess as the release matrix does (tools/releases.py); the stand-ins for what cannot
load without an NPU are listed in tests/platforms/_ascend_run.py. The 0.23.0.post1 sdist has
four: ``RecomputeScheduler`` and ``AsyncRecomputeScheduler`` (core/recompute_scheduler.py),
``ProfilingChunkScheduler`` (core/scheduler_profiling_chunk.py) and ``BalanceScheduler``
(patch/platform/patch_balance_schedule.py; dyntra_lb_scheduler.py and
batch_job_aware_scheduler.py are not in it). Each has its own ``schedule()`` with encoder
budgeting before the split.

``patch_balance_schedule`` is imported by ascend's global patches (its general plugins call
them) and rebinds ``vllm.v1.core.sched.scheduler.Scheduler`` to ``BalanceScheduler``, so
the engine builds it without any ``scheduler_cls``. Whether ascend's general plugins or this
one load first depends on entry-point order, so both orders run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.platforms._release_env import release_env

REPO = Path(__file__).resolve().parents[2]
SOURCE_ENV = "VLLM_MAMBA_FIX_ASCEND_SRC"
RELEASE = "0.23.0"
RESULT_PREFIX = "ASCEND_RESULT "
SPLIT = "_mamba_block_aligned_split"
BASE_SPLIT = f"vllm.v1.core.sched.scheduler.Scheduler.{SPLIT}"
# Run end to end over 0.23.0. The recompute schedulers are built (and recorded) but cannot
# step there: their update_from_output() reads Request.num_in_flight_tokens (not in 0.23.0),
# while over 0.27.1 their schedule() unpacks two values from get_computed_blocks (three).
RUNNABLE = ("ProfilingChunkScheduler", "BalanceScheduler")
RECORDED_ONLY = ("RecomputeScheduler", "AsyncRecomputeScheduler")
# Where each class's own schedule() is defined (what the plugin's code evidence must read).
SCHEDULE_OWNER = {
    "RecomputeScheduler": "RecomputeScheduler",
    "AsyncRecomputeScheduler": "RecomputeScheduler",
    "ProfilingChunkScheduler": "ProfilingChunkScheduler",
    "BalanceScheduler": "BalanceScheduler",
}


@pytest.fixture(scope="module")
def ascend(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    source = os.environ.get(SOURCE_ENV)
    if not source:
        pytest.skip(f"set {SOURCE_ENV} to an extracted vllm-ascend 0.23.0.post1 sdist")
    if not (Path(source) / "vllm_ascend" / "core" / "recompute_scheduler.py").is_file():
        pytest.skip(f"{SOURCE_ENV}={source} holds no vllm_ascend/core/recompute_scheduler.py")
    env = release_env(RELEASE)
    link_dir = tmp_path_factory.mktemp("ascend-link")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.platforms._ascend_run", source, str(link_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    assert out["version"] == RELEASE
    return out


def _split(case: dict[str, Any], qualname: str) -> dict[str, Any]:
    recorded = case["records"].get(qualname)
    assert recorded is not None, list(case["records"])
    return next(m for m in recorded["methods"] if m["name"] == SPLIT)


@pytest.mark.parametrize("name", RUNNABLE)
def test_stock_stalls(ascend: dict[str, Any], name: str) -> None:
    case = ascend["stock"][name]
    assert case["error"] is None
    assert case["stalled"] and not case["completed"], case
    assert all(at % 1056 == 0 for at in case["stall_at"].values()), case["stall_at"]


@pytest.mark.parametrize("name", RUNNABLE)
def test_plugin_loaded_first_completes(ascend: dict[str, Any], name: str) -> None:
    case = ascend["plugin_first"][name]
    qualname = ascend["classes"][name]
    assert case["error"] is None
    assert case["completed"], case
    assert case["evidence"][qualname] == [SCHEDULE_OWNER[name], True]
    split = _split(case, qualname)
    assert (split["state"], split["wraps"]) == ("wrapped", BASE_SPLIT), split
    active = [msg for level, msg in ascend["plugin_first_log"] if " active: " in msg]
    assert any(f"active: {qualname} carries split" in msg for msg in active), active


@pytest.mark.parametrize("name", RECORDED_ONLY)
def test_recompute_schedulers_are_checked_when_built(ascend: dict[str, Any], name: str) -> None:
    case = ascend["plugin_first"][name]
    qualname = ascend["classes"][name]
    # The same API mismatch with and without the plugin, in ascend's own code.
    assert case["error"] == ascend["stock"][name]["error"]
    assert "num_in_flight_tokens" in case["error"]
    assert case["evidence"][qualname] == [SCHEDULE_OWNER[name], True]
    split = _split(case, qualname)
    assert (split["state"], split["wraps"]) == ("wrapped", BASE_SPLIT), split


@pytest.mark.parametrize("name", RUNNABLE)
def test_ascend_loaded_first_completes(ascend: dict[str, Any], name: str) -> None:
    case = ascend["ascend_first"][name]
    assert case["error"] is None
    assert case["completed"], ascend["ascend_first_log"]
    split = _split(case, ascend["classes"][name])
    assert split["state"] == "wrapped", split
