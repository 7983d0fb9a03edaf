"""Data parallel 2 on CPU with vLLM's mp backend: one engine core (one scheduler) per DP rank.

Each rank gets a two-image request (pinned with vLLM's ``X-data-parallel-rank`` header) that
hangs stock vLLM 0.27.1; the test checks that both complete, that each was corrected in its own
engine-core process, and that each of those processes logged the plugin's active line. With the
plugin off (``VLLM_MAMBA_FIX=0``) the progress probe proves the stall and the test fails.

Runs by default, in CI too. Measured alone on this project's 2-core, 24 GiB machine while other
jobs ran (load average 2-7): 114-120 s for the file (tiny-model build, server start, both
requests, shutdown), a peak of 2.9 GiB PSS (4.0 GiB summed RSS) over 9 processes: the API
server, the DP coordinator, two engine cores and their two CPU workers. Started with one API
server (``--api-server-count 1``); vLLM's default of one per rank would add a front end.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.dp_helpers import (
    RankedChat,
    assert_each_rank_patched_and_corrected,
    run_ranked_requests,
)
from tests.e2e.serve_helpers import run_server

pytestmark = [
    pytest.mark.e2e,
    # The ranks are bound to cores 0 and 1 (DP_ENV).
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="DP=2 binds one core per rank"),
]

# 2 cores: one OpenMP thread per rank, no reserved core.
DP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
# One API server: vLLM defaults to one per DP rank, which only adds a front-end process here.
DP_ARGS = ["--data-parallel-size", "2", "--api-server-count", "1"]
TWO_IMAGES = (0, 1)  # hangs stock 0.27.1 (test_serve.py); each rank's prefix cache is cold


def test_dp2_every_engine_core_patched_and_corrected(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {"VLLM_MAMBA_FIX": "auto", **DP_ENV}
    with run_server(tiny_model_dir, tmp_path, env, extra_args=DP_ARGS, startup_s=600) as server:
        requests = [RankedChat(server.base_url, TWO_IMAGES, rank) for rank in (0, 1)]
        run_ranked_requests(server, requests, deadline_s=240)
        log = server.log_text()
        rank_pid = assert_each_rank_patched_and_corrected(log, requests, server.watcher.pids)
    # vLLM labels each engine core with its rank.
    for rank, pid in rank_pid.items():
        assert f"(EngineCore_DP{rank} pid={pid})" in log, (rank, pid)
