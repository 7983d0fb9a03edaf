"""Data-parallel helpers for the e2e tests: requests pinned to a DP rank, per-process log lines.

Shared by ``test_dp.py`` (vLLM's mp backend) and ``test_dp_ray.py`` (its Ray backend).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.e2e.serve_helpers import Server, free_port, image_data_url, serve_command
from tools.engine_demo import ENV_DEFAULTS, REPO, ProbeWatcher
from tools.procs import kill_group
from tools.tiny_model import shim_env

# vLLM prefixes the lines of its child processes with "(EngineCore_DP<i> pid=N)". Ray prints
# what its actors write with a coloured "(EngineCoreActor pid=N)" (or "(pid=N, ip=...)") in the
# driver, here the API server, which prefixes that again: the last prefix names the process.
_ANSI = r"(?:\x1b\[[0-9;]*m)?"
PROCESS_PREFIX = re.compile(
    _ANSI + r"\((?:(?P<label>[\w.-]+) )?pid=(?P<pid>\d+)(?:, [^)]*)?\)" + _ANSI + r"\s*"
)
# The plugin's own active line names the process it ran in.
ACTIVE_LINE = re.compile(r"vllm-mamba-fix \S+ active: .*\bpid (?P<pid>\d+)\)")
# counters.record: "vllm-mamba-fix: <action> for request <id> at token <n>: ...".
CORRECTION_LINE = re.compile(r"vllm-mamba-fix: [a-z -]+ for request (?P<req>\S+) at token \d+")


@dataclass(frozen=True)
class ProcessLine:
    label: str  # vLLM's or Ray's process label ("EngineCore_DP0", "EngineCoreActor"), or ""
    pid: int  # the pid in that prefix: the process that logged the line
    text: str


def process_lines(log: str, pattern: re.Pattern[str]) -> list[tuple[ProcessLine, re.Match[str]]]:
    """Every log line with a process prefix whose text matches ``pattern``."""
    found = []
    for line in log.splitlines():
        prefix, end = None, 0
        while (next_prefix := PROCESS_PREFIX.match(line, end)) is not None:
            prefix, end = next_prefix, next_prefix.end()
        if prefix is None:
            continue
        match = pattern.search(line, end)
        if match is not None:
            entry = ProcessLine(prefix.group("label") or "", int(prefix.group("pid")), line)
            found.append((entry, match))
    return found


def chat_messages(images: tuple[int, ...]) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": image_data_url(i)}} for i in images
    ]
    content.append({"type": "text", "text": "Describe both images."})
    return [{"role": "user", "content": content}]


class RankedChat(threading.Thread):
    """A streaming chat completion in the background, sent to one DP rank.

    vLLM's API server routes a request that carries ``X-data-parallel-rank`` to that rank's
    engine core (``DPLBAsyncMPClient.get_core_engine_for_request``) instead of balancing.
    """

    def __init__(self, base_url: str, images: tuple[int, ...], dp_rank: int) -> None:
        super().__init__(daemon=True)
        self.base_url, self.images, self.dp_rank = base_url, images, dp_rank
        self.response_id: str | None = None
        self.finish_reason: str | None = None
        self.chunks: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=self.base_url + "/v1", api_key="EMPTY", timeout=300)
        try:
            stream = client.chat.completions.create(
                model="tiny",
                messages=chat_messages(self.images),
                stream=True,
                max_tokens=16,
                temperature=0.0,
                extra_body={"ignore_eos": True},
                extra_headers={"X-data-parallel-rank": str(self.dp_rank)},
            )
            for event in stream:
                self.response_id = self.response_id or event.id
                for choice in event.choices:
                    if choice.delta and choice.delta.content:
                        self.chunks.append(choice.delta.content)
                    if choice.finish_reason:
                        self.finish_reason = choice.finish_reason
        except BaseException as exc:  # the server is killed under a hung stream
            self.error = exc


def run_ranked_requests(server: Server, requests: list[RankedChat], deadline_s: float) -> None:
    """Start ``requests`` together and wait; fail at once if the probe proves a stall."""
    for request in requests:
        request.start()
    deadline = time.monotonic() + deadline_s
    for request in requests:
        while request.is_alive() and time.monotonic() < deadline:
            request.join(timeout=1)
            stall = server.watcher.poll()
            assert stall is None, f"hung with the plugin: {stall.describe()}"
        assert not request.is_alive(), f"rank {request.dp_rank}: no finish in {deadline_s:.0f} s"
        assert request.error is None, f"rank {request.dp_rank}: {request.error!r}"
        assert request.finish_reason == "length", (request.dp_rank, request.finish_reason)
        assert request.chunks, f"rank {request.dp_rank}: no content"


def assert_each_rank_patched_and_corrected(
    log: str, requests: list[RankedChat], probe_pids: set[int]
) -> dict[int, int]:
    """Each request was corrected in its own engine core, and each of those cores logged the
    plugin's active line; returns ``{dp_rank: pid}``."""
    tail = log[-6000:]
    active = {int(m.group("pid")) for _, m in process_lines(log, ACTIVE_LINE)}
    # The plugin names its own pid; the prefix must agree (the line came from that process).
    for entry, match in process_lines(log, ACTIVE_LINE):
        assert entry.pid == int(match.group("pid")), entry.text
    corrections = process_lines(log, CORRECTION_LINE)
    rank_pid: dict[int, int] = {}
    for request in requests:
        assert request.response_id is not None, request.dp_rank
        # The engine's request id is the API server's ("chatcmpl-...") plus a suffix.
        pids = {e.pid for e, m in corrections if m.group("req").startswith(request.response_id)}
        assert len(pids) == 1, (
            f"rank {request.dp_rank} ({request.response_id}): corrections from {pids}\n{tail}"
        )
        rank_pid[request.dp_rank] = pids.pop()
    assert len(set(rank_pid.values())) == len(requests), f"ranks share a process: {rank_pid}"
    assert set(rank_pid.values()) <= active, f"no active line in {rank_pid} ({active})\n{tail}"
    # The scheduler probe ran in exactly these processes: one scheduler per DP rank.
    assert probe_pids == set(rank_pid.values()), (probe_pids, rank_pid)
    return rank_pid


# --------------------------------------------------------------------------- Ray


def ray_env() -> dict[str, str]:
    """Settings shared by the Ray head and the API server (the Ray driver)."""
    return {
        # Ray folds lines that differ only in numbers (the pids) into "[repeated 2x]".
        "RAY_DEDUP_LOGS": "0",
        # A loopback cluster of this test only. Left to itself, Ray 2.60's head turned token
        # authentication on and the API server connected without it ("InvalidAuthToken").
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
    }


@contextlib.contextmanager
def ray_head(env: dict[str, str], num_cpus: int, startup_s: float = 180) -> Iterator[str]:
    """A single-node Ray cluster in its own process group; yields its address.

    ``ray start --block`` keeps the head's processes (GCS, raylet, the actors' workers) under
    one process group that is always killed on exit; ``ray stop`` would stop every Ray on the
    machine. The temp dir is short: Ray's socket paths must stay under 108 bytes.
    """
    workdir = Path(tempfile.mkdtemp(prefix="vmf-ray-", dir="/tmp"))
    port = free_port()
    log = workdir / "head.log"
    command = [
        str(Path(sys.executable).with_name("ray")),
        "start",
        "--head",
        "--block",
        "--port",
        str(port),
        "--num-cpus",
        str(num_cpus),
        "--temp-dir",
        str(workdir / "t"),
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    child_env = shim_env({**ENV_DEFAULTS, **os.environ, **env})
    with open(log, "wb") as log_fh:
        proc = subprocess.Popen(
            command, cwd=REPO, env=child_env, stdout=log_fh, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + startup_s
        while "Ray runtime started" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray head did not start:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield f"127.0.0.1:{port}"
    finally:
        kill_group(proc, grace_s=30)
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def run_ray_server(
    model_dir: Path,
    workdir: Path,
    env: dict[str, str],
    ray_address: str,
    extra_args: list[str],
    startup_s: float = 600,
) -> Iterator[Server]:
    """``vllm serve`` as ``run_server`` starts it, through ``tools.ray_cpu_serve`` (the CPU
    platform's Ray device key) and connected to the Ray cluster at ``ray_address``."""
    port = free_port()
    probe, log = workdir / "probe.jsonl", workdir / "server.log"
    child_env = shim_env({**ENV_DEFAULTS, **os.environ, **env, "RAY_ADDRESS": ray_address})
    child_env["VLLM_E2E_PROBE"] = str(probe)
    command = [sys.executable, "-m", "tools.ray_cpu_serve", *serve_command(model_dir, port)[1:]]
    with open(log, "wb") as log_fh:
        proc = subprocess.Popen(
            [*command, *extra_args], cwd=REPO, env=child_env, stdout=log_fh,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    server = Server(f"http://127.0.0.1:{port}", proc, log, ProbeWatcher(probe))
    try:
        deadline = time.monotonic() + startup_s
        while server.health() != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited early:\n{server.log_text()[-4000:]}")
            if time.monotonic() > deadline:
                tail = server.log_text()[-4000:]
                raise RuntimeError(f"vllm serve not healthy in {startup_s:.0f} s:\n{tail}")
            time.sleep(1)
        yield server
    finally:
        kill_group(proc, grace_s=15)
