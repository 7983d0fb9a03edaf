"""Issue 11 item 5: under VLLM_MAMBA_FIX_SCOPE=all the plugin acts on stalls, not on defers.

A text request's 0 from the split is either a one-step defer (from 0.26 the
split returns 0 on purpose when the step's budget cannot fund a block) or a
stall (a long-prefill threshold below the block, on 0.15-0.26, floors every
chunk to 0 forever). The plugin corrects a text request's 0 only once it
repeats at the same position.
"""

from __future__ import annotations

from typing import Any

import pytest

from tools import sched_harness as harness
from tools.scenarios import text_request
from tools.sched_harness import HarnessConfig, RunResult
from vllm_mamba_fix.facts.versions import Family, release_of

CAP = 512


def _defer() -> RunResult:
    # Step 0: "first" takes 1700 of 2048 tokens; 348 left cannot fund a block
    # for "second", whose split returns 0. Step 1: "second" runs in full.
    cfg = HarnessConfig(max_num_batched_tokens=2048, encoder_cache_tokens=2048)
    return harness.run_requests(
        [text_request("first", 1700), text_request("second", 2002)], cfg, max_steps=40
    )


def _threshold() -> RunResult:
    cfg = HarnessConfig(long_prefill_token_threshold=CAP)
    return harness.run_requests([text_request("capped", 5000)], cfg, max_steps=60, stall_steps=8)


def _threshold_hangs_stock() -> bool:
    # 0.27 added a guard for blocks wider than the prefill cap.
    return (release_of(harness.vllm_version()) or (0, 0, 0)) < (0, 27, 0)


def test_a_defer_stays_a_defer(family: Family, load_plugin: Any) -> None:
    stock = _defer()
    assert stock.completed
    assert stock.chunks["second"][0][0] == 1, stock.chunks  # deferred one step
    if not load_plugin(VLLM_MAMBA_FIX_SCOPE="all", VLLM_MAMBA_FIX="force"):
        pytest.fail("the plugin did not load")
    patched = _defer()
    assert patched.chunks == stock.chunks


def test_a_stall_is_ended(family: Family, load_plugin: Any) -> None:
    try:
        stock = _threshold()
    except Exception as exc:
        if type(exc).__name__ != "ValidationError":
            raise
        pytest.skip(f"vLLM {harness.vllm_version()} rejects this config: {str(exc)[:120]}")
    assert stock.block_size > CAP  # every capped chunk is sub-block
    assert stock.completed is not _threshold_hangs_stock(), stock.stall_at
    assert load_plugin(VLLM_MAMBA_FIX="force")  # default scope: text is left alone
    assert _threshold().completed is stock.completed
    harness.unload_plugin()
    assert load_plugin(VLLM_MAMBA_FIX_SCOPE="all", VLLM_MAMBA_FIX="force")
    patched = _threshold()
    assert patched.completed, patched.stall_at
    assert patched.violations() == []
    if stock.completed:  # wherever stock makes progress, its chunks stand
        assert patched.chunks == stock.chunks
