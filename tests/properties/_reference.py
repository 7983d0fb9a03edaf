"""Upstream's fixed release as the second oracle of the differential suite (issue 35 item 2).

Each rule answers to the release where vLLM fixed what it fixes:
- the split rule (0.15-0.27) to 0.28.0, which aligns before the encoder cut;
- the speculative-stall rule (0.24-0.32, under EAGLE/MTP) to 0.33.0.

A workload the suite runs on this release's stock and plugin also runs on stock of each fixed
release that answers for it here, in a process of its own with that release's `vllm/` first on
PYTHONPATH (tools/releases.py, the overlay the matrix uses). Importing a release costs seconds,
so there is one long-lived process per fixed release per test session: it reads one workload
per line as JSON on stdin (`Workload.to_json`, the mode's name) and answers one `Outcome` per
line on stdout, after a marker (vLLM may print on stdout too). `python -m
tests.properties._reference` is that process; the client side is `fixed_runs`.

$VLLM_MAMBA_FIX_DIFFERENTIAL_REFERENCE=0 runs the suite without it (stock alone, as before).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import IO, Any

from tools.sched_harness import MODES_BY_NAME, Mode

REPO = Path(__file__).resolve().parents[2]
SPLIT_FIXED = "0.28.0"  # the split rule's reference: 0.15-0.27
SPECULATIVE_FIXED = "0.33.0"  # the speculative-stall rule's reference: 0.24-0.32, MTP
REFERENCE_ENV = "VLLM_MAMBA_FIX_DIFFERENTIAL_REFERENCE"
MARKER = "@@reference@@ "
TIMEOUT = 600.0  # seconds for one workload (a 48-request crowd takes a few)
_PLUGIN_ENV = ("VLLM_MAMBA_FIX", "VLLM_MAMBA_FIX_SCOPE", "VLLM_PLUGINS")


def fixed_releases(release: tuple[int, int], mode: Mode) -> tuple[str, ...]:
    """The fixed releases that answer for a run of `release` in `mode`."""
    out = []
    if (0, 15) <= release <= (0, 27):
        out.append(SPLIT_FIXED)
    if mode.speculative and (0, 24) <= release <= (0, 32):
        out.append(SPECULATIVE_FIXED)
    return tuple(out)


def enabled() -> bool:
    return os.environ.get(REFERENCE_ENV, "1").strip() != "0"


class ReferenceProcess:
    """One fixed release's stock scheduler in a process of its own, fed workloads."""

    def __init__(self, release: str) -> None:
        from tools import releases

        self.release = release
        parts = [str(releases.ensure_overlay(release))]
        deps = releases.ensure_extra_packages(releases.quirks_for(release).extra_packages)
        if deps:
            parts.append(str(deps))
        parts.append(str(REPO))  # no PYTHONPATH of ours: it may carry this run's overlay
        env = {k: v for k, v in os.environ.items() if k not in _PLUGIN_ENV}
        env["PYTHONPATH"] = os.pathsep.join(parts)
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (lives as long as the process)
            "w+", prefix=f"reference-{release}-", suffix=".log", delete=False
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.properties._reference"],
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True, bufsize=1,
        )  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        hello = self._answer()
        self.version = hello["version"]
        if self.version != release:
            self.close()
            raise RuntimeError(f"the reference process imported vLLM {self.version}, not {release}")

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            if line.startswith(MARKER):
                self.lines.put(line[len(MARKER) :])
        self.lines.put(None)

    def _answer(self) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=TIMEOUT)
        except queue.Empty:
            self.close()
            raise RuntimeError(f"vLLM {self.release}'s reference process: no answer") from None
        if line is None:
            raise RuntimeError(f"vLLM {self.release}'s reference process exited: {self.tail()}")
        data: dict[str, Any] = json.loads(line)
        if "error" in data:
            raise RuntimeError(f"vLLM {self.release}'s reference run failed:\n{data['error']}")
        return data

    def tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-3000:]

    def run(self, workload: Any, mode: Mode) -> Any:
        from tests.properties._differential import Outcome

        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"workload": workload.to_json(), "mode": mode.name}))
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return Outcome.from_json(self._answer()["outcome"])

    def close(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


_PROCESSES: dict[str, ReferenceProcess] = {}
_BROKEN: dict[str, str] = {}


def process(release: str) -> ReferenceProcess:
    """The session's process for `release`, started on first use."""
    if release in _BROKEN:
        raise RuntimeError(_BROKEN[release])
    if release not in _PROCESSES or _PROCESSES[release].proc.poll() is not None:
        try:
            _PROCESSES[release] = ReferenceProcess(release)
        except Exception as exc:
            _BROKEN[release] = f"vLLM {release}'s reference process did not start: {exc}"
            raise
    return _PROCESSES[release]


@atexit.register
def _close_all() -> None:
    for proc in _PROCESSES.values():
        proc.close()
    _PROCESSES.clear()


def fixed_runs(workload: Any, mode: Mode, release: tuple[int, int]) -> dict[str, Any]:
    """`workload` in `mode` on stock of every fixed release answering here: {release: Outcome}."""
    if not enabled():
        return {}
    return {r: process(r).run(workload, mode) for r in fixed_releases(release, mode)}


# --------------------------------------------------------------------------
# The process itself


def serve() -> int:
    from tests.properties import _differential
    from tools import sched_harness as harness

    out = sys.stdout

    def answer(data: dict[str, Any]) -> None:
        out.write(MARKER + json.dumps(data) + "\n")
        out.flush()

    sys.stdout = sys.stderr  # anything else printed goes to the log
    answer({"version": harness.vllm_version()})
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            workload = _differential.Workload.from_json(request["workload"])
            mode = MODES_BY_NAME[request["mode"]]
            reason = harness.mode_unsupported_reason(mode)
            if reason:
                raise RuntimeError(f"{mode}: {reason}")
            with _differential.stock():
                outcome = _differential.drive(workload, mode)
            answer({"outcome": outcome.to_json()})
        except Exception:
            answer({"error": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    raise SystemExit(serve())
