"""``vllm serve``'s own ``/metrics`` shows the plugin's counters, scraped from a real server.

The tiny model as in ``test_serve.py`` (block 256 pinned, budget 384, two images, so stock
0.27.1 would hang and the plugin corrects). The counts are made in the engine core and must
appear at the API server's ``/metrics`` with no other server or port:

- corrected: a killed server's private directory, left in the server's TMPDIR, is gone once
  the server is healthy, and its own is in use; after one two-image request, each
  ``vllm_mamba_fix_*`` series rose by exactly the number of correction lines the engine core
  logged for it (the plugin's logger at DEBUG, so the lines after a request's first one are
  seen too), and by at least the running totals on the last INFO correction line;
- named and ended: one more server, with the split rule off (``VLLM_MAMBA_FIX_SPLIT_RULE=0``,
  which leaves vLLM's split stock while the watchdog runs) and the watchdog at 3 s: the
  request stalls, the watchdog's WARNING line appears and ``stalls_named`` rose by one
  scraped after it, and the live gauge shows one stall standing since before the naming;
  then the stall-ending rule (5 s) finishes the request, ``stalls_ended`` rose by one and
  the live gauge is back at 0.

Every series carries vLLM's labels of the one engine core (``model_name="tiny"``,
``engine="0"``); test_dp.py checks two engine cores.

Engine starts: 2 (about 30-90 s each).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.serve_helpers import (
    Server,
    logging_config_env,
    run_server,
    sample_key,
    scrape_metrics,
)
from tests.e2e.test_serve import StreamingRequest
from vllm_mamba_fix.decide.decision import Action
from vllm_mamba_fix.observe import counters, metrics
from vllm_mamba_fix.observe.metrics_store import GAUGE_FILE_PREFIX
from vllm_mamba_fix.observe.series import GAUGES, INFO, OLDEST_STALL, STALLED

pytestmark = pytest.mark.e2e

PLUGIN_LOGGER = "vllm.mamba_fix"
ENGINE_CORE = re.compile(r"\(EngineCore[^)]*pid=\d+\)")
CORRECTION = re.compile(r"vllm-mamba-fix: ([a-z-]+) for request \S+ at token \d+")
TOTALS = re.compile(
    r"this process so far: (\d+) collapses prevented, (\d+) re-aligned, (\d+) stopped at an "
    r"encoder input, (\d+) speculative stalls released, (\d+) block-rule chunks, (\d+) stalls "
    r"named, (\d+) ended"
)
TOTALS_KEYS = (
    "collapses_prevented", "chunks_realigned", "chunks_stopped_at_encoder_input",
    "speculative_stalls_released", "block_rule_chunks", "stalls_detected", "stalls_ended",
)  # fmt: skip
STALL_NAMED = re.compile(r"WARNING .*vllm-mamba-fix: request \S+ stalled at token \d+")
STALL_ENDED = re.compile(r"WARNING .*vllm-mamba-fix: ended request \S+")
REQUEST_DEADLINE_S = 180.0


ENGINE = {"engine": "0", "model_name": "tiny"}  # vLLM's labels of the one engine core


def _series(key: str) -> str:
    series = metrics.SERIES[key]
    return sample_key(series.sample, {**dict(series.labels), **ENGINE})


def _gauge(series: metrics.Series) -> str:
    return sample_key(series.sample, ENGINE)


def _engine_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if ENGINE_CORE.search(line)]


def _logged_corrections(lines: list[str]) -> dict[str, int]:
    """Correction lines per stats() key, INFO and DEBUG alike."""
    found = dict.fromkeys(counters.ACTION_KEYS.values(), 0)
    for line in lines:
        match = CORRECTION.search(line)
        if match:
            found[counters.ACTION_KEYS[Action(match.group(1))]] += 1
    return found


def _delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after[_series(key)] - before[_series(key)]


def _all_series_present(scraped: dict[str, float]) -> None:
    # metrics.prepare() ran in the engine core: every series exists before any count.
    gauges = {_gauge(s) for s in GAUGES if s is not INFO}
    missing = sorted(({_series(key) for key in metrics.SERIES} | gauges) - set(scraped))
    assert not missing, (
        f"not at /metrics: {missing}; scraped {sorted(scraped)} (the API server reads them only "
        "where register() calls metrics.attach(), the engine core creates them in prepare())"
    )


# A server killed before its atexit ran (SIGKILL): its engine core counted, so its private
# directory is left behind with a counter file in it.
KILLED_SERVER = """
import multiprocessing as mp, os, signal
from vllm_mamba_fix.observe import metrics

def engine_core():
    metrics.prepare()
    metrics.count("stalls_ended")

if __name__ == "__main__":
    metrics.attach()
    proc = mp.get_context("spawn").Process(target=engine_core)
    proc.start()
    proc.join(60)
    print("DIR", os.environ[metrics.ENV_DIR], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_servers_directory(tmp: Path) -> Path:
    script = tmp.parent / "killed_server.py"
    script.write_text(KILLED_SERVER)
    env = {
        k: v for k, v in os.environ.items() if k not in (metrics.PROMETHEUS_DIR, metrics.ENV_DIR)
    }
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env={**env, "TMPDIR": str(tmp)}, timeout=120)  # fmt: skip
    assert run.returncode == -signal.SIGKILL, run.stdout + run.stderr
    leftover = Path(run.stdout.split("DIR ", 1)[1].strip())
    assert [f.name.startswith(metrics.FILE_PREFIX) for f in leftover.iterdir()] == [True]
    return leftover


def test_metrics_count_corrections(tiny_model_dir: Path, tmp_path: Path, stock_hangs: None) -> None:
    # The server's own temporary directory, with a killed server's leftover in it (issue 27).
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    leftover = _killed_servers_directory(tmp)
    env = {
        "VLLM_MAMBA_FIX": "auto",
        "TMPDIR": str(tmp),
        **logging_config_env(tmp_path, (PLUGIN_LOGGER,)),
    }
    with run_server(tiny_model_dir, tmp_path, env) as server:
        before = scrape_metrics(server.base_url)
        _all_series_present(before)
        # The API server's start swept the killed one's directory; its own is in use.
        assert not leftover.exists()
        own = list(tmp.glob("vllm-mamba-fix-metrics-*"))
        assert len(own) == 1, own
        # The engine core's counter and gauge files (metrics_store.py), nothing else.
        files = sorted(f.name for f in own[0].iterdir())
        pid = files[0].rsplit("-", 1)[-1]
        assert files == [f"{metrics.FILE_PREFIX}{pid}", f"{GAUGE_FILE_PREFIX}{pid}"], files
        request = StreamingRequest(server.base_url)
        request.start()
        request.join(timeout=REQUEST_DEADLINE_S)
        assert not request.is_alive(), f"no finish in {REQUEST_DEADLINE_S:.0f} s"
        assert request.error is None and request.finish_reason == "length", repr(request.error)
        after = scrape_metrics(server.base_url)
        lines = _engine_lines(server.log_text())
    logged = _logged_corrections(lines)
    assert sum(logged.values()) > 0, "\n".join(lines[-40:])  # the plugin corrected
    for key, count in logged.items():
        assert _delta(before, after, key) == count, (key, before, after, logged)
    # The running totals on the last INFO correction line are a floor of what /metrics shows.
    totals = [TOTALS.search(line) for line in lines]
    last = [match for match in totals if match][-1]
    for key, value in zip(TOTALS_KEYS, last.groups(), strict=True):
        assert after[_series(key)] >= int(value), (key, after, last.group(0))
    assert after[_series("stalls_detected")] == 0  # corrected, never stalled


@dataclass
class StallRun:
    """One server, one request that stalls: scraped when named and again when ended."""

    before: dict[str, float]
    named: dict[str, float]  # scraped once the watchdog's line is in the log
    sent_at: float  # wall-clock time the request was sent
    named_seen_at: float  # wall-clock time the scrape after the naming began
    lines: list[str]  # the engine core's lines at the end
    request: StreamingRequest
    ended: dict[str, float] | None = None  # scraped after the client's finish
    elapsed_s: float = 0.0
    health: int = 0


def _wait_named(server: Server, deadline: float) -> list[str]:
    while time.monotonic() < deadline:
        lines = _engine_lines(server.log_text())
        if any(STALL_NAMED.search(line) for line in lines):
            return lines
        time.sleep(1)
    raise AssertionError("no stall named\n" + "\n".join(_engine_lines(server.log_text())[-40:]))


@pytest.fixture(scope="module")
def stall_run(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, stock_hangs: None
) -> StallRun:
    workdir = tmp_path_factory.mktemp("metrics-stall")
    env = {
        "VLLM_MAMBA_FIX": "auto",
        "VLLM_MAMBA_FIX_SPLIT_RULE": "0",  # the split left stock: the request stalls
        "VLLM_MAMBA_FIX_STALL_SECONDS": "3",
        "VLLM_MAMBA_FIX_END_STALLS_AFTER": "5",
        **logging_config_env(workdir, (PLUGIN_LOGGER,)),
    }
    with run_server(tiny_model_dir, workdir, env) as server:
        before = scrape_metrics(server.base_url)
        _all_series_present(before)
        request = StreamingRequest(server.base_url)
        start, sent_at = time.monotonic(), time.time()
        request.start()
        _wait_named(server, start + REQUEST_DEADLINE_S)
        seen_at = time.time()
        run = StallRun(before, scrape_metrics(server.base_url), sent_at, seen_at, [], request)
        request.join(timeout=max(0.0, start + REQUEST_DEADLINE_S - time.monotonic()))
        run.elapsed_s = time.monotonic() - start
        if not request.is_alive():  # counted in the engine core before the finish left it
            run.ended = scrape_metrics(server.base_url)
        run.health = server.health()
        run.lines = _engine_lines(server.log_text())
    return run


def test_metrics_count_named_stalls(stall_run: StallRun) -> None:
    """The watchdog counts before it logs, so the scrape after its line holds it."""
    named_lines = [line for line in stall_run.lines if STALL_NAMED.search(line)]
    assert named_lines, "\n".join(stall_run.lines[-40:])
    # One request stalls, and the watchdog names a stall once: one line, one count.
    assert _delta(stall_run.before, stall_run.named, "stalls_detected") == len(named_lines)
    logged = _logged_corrections(stall_run.lines)
    for key, count in logged.items():  # the split rule is off: nothing, or what it logged
        assert _delta(stall_run.before, stall_run.named, key) == count, (key, stall_run.named)
    assert stall_run.health == 200


def test_the_live_stall_gauge_rises_while_a_stall_stands(stall_run: StallRun) -> None:
    assert stall_run.before[_gauge(STALLED)] == 0 and stall_run.before[_gauge(OLDEST_STALL)] == 0
    assert stall_run.named[_gauge(STALLED)] == 1, stall_run.named
    # Its start: after the request was sent, and at least the watchdog's 3 s before the naming.
    started = stall_run.named[_gauge(OLDEST_STALL)]
    assert stall_run.sent_at <= started <= stall_run.named_seen_at - 3, (stall_run, started)
    info = [k for k, v in stall_run.named.items() if k.startswith(INFO.sample + "{")]
    assert len(info) == 1 and stall_run.named[info[0]] == 1, info
    assert 'engine="0"' in info[0] and 'model_name="tiny"' in info[0], info
    assert 'stall_seconds="3"' in info[0] and 'end_stalls_after="5"' in info[0], info
    rules = info[0].split('rules="')[1].split('"')[0].split(",")
    assert "stall-watchdog" in rules and "split" not in rules, info  # the split rule is off


def test_metrics_count_ended_stalls(stall_run: StallRun) -> None:
    request = stall_run.request
    assert stall_run.ended is not None, (
        f"the stalled request was not ended in {REQUEST_DEADLINE_S:.0f} s\n"
        + "\n".join(stall_run.lines[-20:])
    )
    ended_lines = [line for line in stall_run.lines if STALL_ENDED.search(line)]
    assert len(ended_lines) == 1, "\n".join(stall_run.lines[-20:])
    assert _delta(stall_run.before, stall_run.ended, "stalls_ended") == 1, stall_run.ended
    # Ended: no stall stands any more (the gauge fell back).
    assert stall_run.ended[_gauge(STALLED)] == 0 and stall_run.ended[_gauge(OLDEST_STALL)] == 0
    # Finished before its prefill did: no token, not a full-length completion. The stream
    # ends with vLLM's error event carrying the cause, which the openai client raises
    # (test_stall_end_serve.py checks what the client reads in full).
    assert not request.chunks, request.chunks
    assert "vllm-mamba-fix ended this request" in str(request.error), request.error
    assert request.finish_reason != "length"
    assert stall_run.health == 200
