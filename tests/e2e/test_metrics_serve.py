"""``vllm serve``'s own ``/metrics`` shows the plugin's counters, scraped from a real server.

The tiny model as in ``test_serve.py`` (block 256 pinned, budget 384, two images, so stock
0.27.1 would hang and the plugin corrects). The counts are made in the engine core and must
appear at the API server's ``/metrics`` with no other server or port:

- corrected: after one two-image request, each ``vllm_mamba_fix_*`` series rose by exactly
  the number of correction lines the engine core logged for it (the plugin's logger at DEBUG,
  so the lines after a request's first one are seen too), and by at least the running totals
  on the last INFO correction line;
- ended: with the split rule off (``VLLM_MAMBA_FIX_SPLIT_RULE=0``, a test switch that leaves
  vLLM's split stock) the request stalls; the watchdog names it and the stall-ending rule
  finishes it; ``stalls_named`` and ``stalls_ended`` rose by the lines that say so.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.e2e.serve_helpers import logging_config_env, run_server, sample_key, scrape_metrics
from tests.e2e.test_serve import StreamingRequest
from vllm_mamba_fix import counters, metrics
from vllm_mamba_fix.decision import Action

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
REQUEST_DEADLINE_S = 180.0


def _series(key: str) -> str:
    series = metrics.SERIES[key]
    return sample_key(series.sample, dict(series.labels))


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
    missing = sorted({_series(key) for key in metrics.SERIES} - set(scraped))
    assert not missing, (
        f"not at /metrics: {missing}; scraped {sorted(scraped)} (the API server reads them only "
        "where register() calls metrics.attach(), the engine core creates them in prepare())"
    )


def test_metrics_count_corrections(tiny_model_dir: Path, tmp_path: Path, stock_hangs: None) -> None:
    env = {"VLLM_MAMBA_FIX": "auto", **logging_config_env(tmp_path, (PLUGIN_LOGGER,))}
    with run_server(tiny_model_dir, tmp_path, env) as server:
        before = scrape_metrics(server.base_url)
        _all_series_present(before)
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


def _stall_end_rule_missing() -> str | None:
    """Why the ended half cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("vllm_mamba_fix.stall_end") is None:
        return (
            "the stall-ending rule (VLLM_MAMBA_FIX_END_STALLS_AFTER, vllm_mamba_fix/stall_end.py) "
            "is not built yet: no stall can be ended, so stalls_ended cannot rise"
        )
    return None


def test_metrics_count_named_and_ended_stalls(
    tiny_model_dir: Path, tmp_path: Path, stock_hangs: None
) -> None:
    missing = _stall_end_rule_missing()
    if missing:
        pytest.skip(missing)
    env = {
        "VLLM_MAMBA_FIX": "auto",
        "VLLM_MAMBA_FIX_SPLIT_RULE": "0",  # the split left stock: the request stalls
        "VLLM_MAMBA_FIX_STALL_SECONDS": "3",
        "VLLM_MAMBA_FIX_END_STALLS_AFTER": "5",
        **logging_config_env(tmp_path, (PLUGIN_LOGGER,)),
    }
    with run_server(tiny_model_dir, tmp_path, env) as server:
        before = scrape_metrics(server.base_url)
        _all_series_present(before)
        request = StreamingRequest(server.base_url)
        start = time.monotonic()
        request.start()
        request.join(timeout=REQUEST_DEADLINE_S)
        assert not request.is_alive(), f"the stalled request was not ended in {REQUEST_DEADLINE_S}"
        elapsed = time.monotonic() - start
        # Counted in the engine core before the finish reached the client.
        after = scrape_metrics(server.base_url)
        lines = _engine_lines(server.log_text())
        assert server.health() == 200
    named = sum(1 for line in lines if STALL_NAMED.search(line))
    assert named >= 1, "\n".join(lines[-40:])
    assert _delta(before, after, "stalls_detected") == named
    assert _delta(before, after, "stalls_ended") == 1, (before, after)
    # 0.15-0.32 end it as an abort, with the cause as stop_reason (stall_end.py).
    assert request.finish_reason == "abort", (request.finish_reason, request.chunks, elapsed)
