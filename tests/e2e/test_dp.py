"""Data parallel 2 on CPU with vLLM's mp backend: one engine core (one scheduler) per DP rank.

Each rank gets a two-image request (pinned with vLLM's ``X-data-parallel-rank`` header) that
hangs stock vLLM 0.27.1; the test checks that both complete, that each was corrected in its own
engine-core process, and that each of those processes logged the plugin's active line. With the
plugin off (``VLLM_MAMBA_FIX=0``) the progress probe proves the stall and the test fails.

Issue 37: the API server's ``/metrics`` shows, for each engine core, the plugin's info series
and its counters under vLLM's own ``model_name`` and ``engine`` labels (the same values as
``vllm:num_requests_running``, so the two join), each engine core's counts under its own rank
(at least the running totals its own correction lines carry), and the live stall gauge at 0.

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
    process_lines,
    run_ranked_requests,
)
from tests.e2e.serve_helpers import run_server, sample_key, scrape_metrics
from tests.e2e.test_metrics_serve import TOTALS, TOTALS_KEYS
from vllm_mamba_fix.observe import metrics
from vllm_mamba_fix.observe.series import INFO, MAMBA_BLOCK, OLDEST_STALL, SPLIT_BLOCK, STALLED

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
        scraped = scrape_metrics(server.base_url, prefix="vllm")
        log = server.log_text()
        rank_pid = assert_each_rank_patched_and_corrected(log, requests, server.watcher.pids)
    # vLLM labels each engine core with its rank.
    for rank, pid in rank_pid.items():
        assert f"(EngineCore_DP{rank} pid={pid})" in log, (rank, pid)
    _assert_each_engine_at_metrics(scraped, log, rank_pid)


def _assert_each_engine_at_metrics(
    scraped: dict[str, float], log: str, rank_pid: dict[int, int]
) -> None:
    """Issue 37 at /metrics: each engine core's series under vLLM's labels of that rank."""
    totals = {e.pid: m for e, m in process_lines(log, TOTALS)}  # the last line per process
    for rank, pid in rank_pid.items():
        engine = {"engine": str(rank), "model_name": "tiny"}
        # The join: vLLM's own gauge carries the same label values.
        assert sample_key("vllm:num_requests_running", engine) in scraped, sorted(scraped)
        info = [k for k in scraped if k.startswith(INFO.sample + "{") and _has(k, engine)]
        assert len(info) == 1 and scraped[info[0]] == 1, info
        rules = info[0].split('rules="')[1].split('"')[0].split(",")
        assert {"split", "stall-watchdog"} <= set(rules), info
        for gauge in (SPLIT_BLOCK, MAMBA_BLOCK):
            assert scraped[sample_key(gauge.sample, engine)] > 0, (gauge.sample, rank)
        assert scraped[sample_key(STALLED.sample, engine)] == 0
        assert scraped[sample_key(OLDEST_STALL.sample, engine)] == 0
        # This engine core's counts, under its own rank: at least its last running totals.
        last = totals[pid]
        for key, value in zip(TOTALS_KEYS, last.groups(), strict=True):
            series = metrics.SERIES[key]
            shown = scraped[sample_key(series.sample, {**dict(series.labels), **engine})]
            assert shown >= int(value), (rank, key, shown, last.group(0))
        corrected = [k for k in scraped if k.startswith("vllm_mamba_fix_corrections_total{")]
        assert sum(scraped[k] for k in corrected if _has(k, engine)) > 0, (rank, corrected)
    # No series of the plugin without vLLM's labels, and none of another engine.
    ours = [k for k in scraped if k.startswith("vllm_mamba_fix_")]
    engines = {f'engine="{rank}"' for rank in rank_pid}
    assert all(any(e in k for e in engines) and 'model_name="tiny"' in k for k in ours), ours


def _has(key: str, labels: dict[str, str]) -> bool:
    return all(f'{name}="{value}"' in key for name, value in labels.items())
