"""A drafter with its own KV cache group pulls ``cache_config.block_size`` below the Mamba block.

From 0.32 the engine core sets ``cache_config.block_size`` to the smallest block over the
prefix-cacheable KV cache groups (0.34 ``v1/engine/core.py``), and vLLM's GPU worker notes
that a drafter group with its own smaller block (DFlash) pulls it below ``mamba_block_size``.
Then vLLM's split floors to the drafter's block while the Mamba cache stores a state per
larger block: the two-block-size wrong-token case (vLLM #54076) on GPUs. These tests build
the KV cache config as the engine core does, with a DFlash-like drafter group whose block
is half the Mamba groups', and set ``cache_config.block_size`` as the release's engine core
computes it. The oracle is vLLM itself with the block pinned to the cache's.

``VLLM_MAMBA_FIX_BLOCK_RULE=0 pytest tests/scheduler/test_drafter_block.py`` must fail.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tools import scenarios as sc
from tools import sched_harness as harness
from tools.sched_harness import HarnessConfig, RequestSpec

CACHED, DRAFTER = 256, 128
# Pinned: the drafter group is there, cache_config.block_size stays the Mamba block.
PINNED = HarnessConfig(
    block_size=CACHED,
    drafter_block_size=DRAFTER,
    max_num_batched_tokens=384,
    encoder_cache_tokens=256,
    max_model_len=2048,
)
# As the engine core leaves it: the minimum over the prefix-cacheable groups.
AS_ENGINE_CORE = dataclasses.replace(PINNED, block_size_from_groups=True)
FIRST = RequestSpec("t1", 650, max_tokens=2, seed=11)
LATER = (
    RequestSpec("t2", 900, max_tokens=2, seed=11),
    RequestSpec("t3", 700, max_tokens=2, seed=11),
    RequestSpec("mm-after-text", 1000, ((600, 256),), max_tokens=2, seed=11),
    RequestSpec("two-images", 1100, ((300, 256), (558, 256)), max_tokens=2, seed=12),
)
TEXT = tuple(spec for spec in LATER if not spec.has_mm)


def engine_core_source() -> str:
    """``EngineCore._initialize_kv_caches`` of the imported release, read without importing
    the engine core (it needs the compiled ops)."""
    spec = importlib.util.find_spec("vllm.v1.engine.core")
    assert spec is not None and spec.origin
    tree = ast.parse(Path(spec.origin).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "_initialize_kv_caches":
            return ast.get_source_segment(Path(spec.origin).read_text(), node) or ""
    return ""


@pytest.fixture(autouse=True)
def _min_over_prefix_cacheable_groups() -> None:
    source = engine_core_source()
    if "cache_config.block_size = min(" not in source or "prefix_cacheable" not in source:
        pytest.skip(
            f"vLLM {harness.vllm_version()}'s engine core does not set cache_config.block_size "
            "to the minimum over the prefix-cacheable KV cache groups (0.32+)"
        )


def _run(cfg: HarnessConfig, later: tuple[RequestSpec, ...]) -> Any:
    """t1 to its end, then the prompts that reuse its cached blocks."""
    run = harness.Harness(cfg)
    run.add(FIRST)
    first = run.run()
    assert first.completed, first.stall_at
    run.add(*later)
    return run.run()


def _chunks(result: Any) -> dict[str, list[tuple[int, int]]]:
    return {rid: result.spans(rid) for rid in result.chunks}


def _ends_inside_a_block(result: Any, block: int) -> set[tuple[str, int]]:
    return {
        (rid, end)
        for rid, spans in _chunks(result).items()
        for _, end in spans
        if end % block and end < result.prompt_len[rid]
    }


def test_the_engine_core_sets_the_minimum_over_prefix_cacheable_groups() -> None:
    """The harness's rule (engine_core_block_size) is the one the release's code has."""
    source = engine_core_source()
    assert "if g.kv_cache_spec.prefix_cacheable" in source
    assert "g.kv_cache_spec.block_size for g in kv_cache_groups" in source


def test_the_drafter_group_pulls_the_block_below_the_mamba_block(
    sched_mode: harness.Mode,
) -> None:
    from vllm.v1.kv_cache_interface import MambaSpec

    built = harness.build_scheduler(sched_mode.apply(AS_ENGINE_CORE))
    groups = built.scheduler.kv_cache_config.kv_cache_groups
    drafter = [g for g in groups if g.kv_cache_spec.block_size == DRAFTER]
    assert drafter and not any(isinstance(g.kv_cache_spec, MambaSpec) for g in drafter)
    assert all(g.kv_cache_spec.prefix_cacheable for g in groups)
    assert built.block_size == CACHED  # what the Mamba cache stores
    assert built.scheduler.cache_config.block_size == DRAFTER  # what the split floors to
    assert harness.engine_core_block_size(built.scheduler.kv_cache_config) == DRAFTER
    pinned = harness.build_scheduler(sched_mode.apply(PINNED))
    assert pinned.scheduler.cache_config.block_size == CACHED


def test_text_and_multimodal_chunks_stay_in_the_cache_blocks(
    sched_mode: harness.Mode, load_plugin, vllm_log: list[str]
) -> None:
    pinned_cfg, engine_cfg = sched_mode.apply(PINNED), sched_mode.apply(AS_ENGINE_CORE)
    stock_pinned = _run(pinned_cfg, LATER)
    stock = _run(engine_cfg, LATER)
    assert stock_pinned.completed and stock.completed
    # The bug: stock's chunks end inside the cache's blocks.
    assert _ends_inside_a_block(stock, CACHED) - _ends_inside_a_block(stock_pinned, CACHED)
    stock_text_pinned = _run(pinned_cfg, TEXT)

    load_plugin()  # 0.33+: the block-unit rule is the only rule, and it wraps the split
    text = _run(engine_cfg, TEXT)
    assert text.violations(CACHED) == [], _chunks(text)
    assert _chunks(text) == _chunks(stock_text_pinned)
    everything = _run(engine_cfg, LATER)
    assert everything.completed, everything.stall_at
    assert everything.violations(CACHED) == [], _chunks(everything)
    assert _chunks(everything) == _chunks(stock_pinned)
    engaged = [m for m in vllm_log if "block-unit rule engaged" in m]
    assert len(engaged) == 2, engaged  # one per scheduler built with the two sizes apart
    assert f"stores {CACHED}-token blocks" in engaged[0]
    assert f"cache_config.block_size is {DRAFTER}" in engaged[0]


def test_the_issue_layout_at_vllms_own_block(load_plugin) -> None:
    """Two 11,844-token images at the block vLLM aligns the model to, the drafter at half."""
    own = harness.build_scheduler(sc.ISSUE_CONFIG).block_size
    pinned_cfg = dataclasses.replace(sc.ISSUE_CONFIG, drafter_block_size=own // 2)
    engine_cfg = dataclasses.replace(pinned_cfg, block_size_from_groups=True)
    specs = (*sc.TWO_IMAGES.requests, *sc.TEXT_ONLY.requests)
    stock_pinned = harness.run_requests(specs, pinned_cfg)
    stock = harness.run_requests(specs, engine_cfg)
    assert stock_pinned.completed and stock_pinned.violations(own) == []
    assert stock.violations(own), "stock with the drafter's block must end inside cache blocks"
    load_plugin()
    patched = harness.run_requests(specs, engine_cfg)
    assert patched.completed, patched.stall_at
    assert patched.violations(own) == []
    assert _chunks(patched) == _chunks(stock_pinned)
