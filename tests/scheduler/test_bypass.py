"""Issue 29: split calls that need no look cost what stock's cost, on the real scheduler.

Where no rule can act for a scheduler (quiet: the sizes agree on 0.28+), every split call
is vLLM's own, bound to the scheduler. Where only multimodal requests can need the split
rule (0.27, sizes agreeing, the built-in scope), text requests' calls are; the
encoder wrapper sends each multimodal request's split through the wrapper. These tests
count which requests' split calls reach the class's wrapper while the suite's scenarios
run, and check that undo leaves nothing bound.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator
from typing import Any

from tools import sched_harness as harness
from tools.sched_harness import Harness, HarnessConfig, RequestSpec
from vllm_mamba_fix.facts.blocks import ARM_ATTR, SPLIT_ATTR
from vllm_mamba_fix.facts.targets import MARKER, SPLIT_METHOD
from vllm_mamba_fix.facts.versions import Family

CONFIG = HarnessConfig(block_size=256, max_num_batched_tokens=384, encoder_cache_tokens=256,
                       max_model_len=4096, max_num_seqs=8)  # fmt: skip
# The layout (two images the encoder cache cannot hold together) beside two text
# prompts that take several chunks each.
REQUESTS = (
    RequestSpec("two-images", 537, ((1, 256), (259, 256)), max_tokens=3),
    RequestSpec("text-a", 1500, (), max_tokens=3),
    RequestSpec("text-b", 900, (), max_tokens=3),
)


@contextlib.contextmanager
def counted_split() -> Iterator[Counter[str]]:
    """Which requests' split calls reach the class's split wrapper (the plugin's, counted
    by a pass-through that keeps its marker, so the plugin settles as it would)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    reached: Counter[str] = Counter()
    wrapper = Scheduler.__dict__[SPLIT_METHOD]
    assert hasattr(wrapper, MARKER)  # the plugin's, installed before counting starts

    @functools.wraps(wrapper)
    def counting(self: Any, request: Any, *args: Any, **kwargs: Any) -> int:
        reached[request.request_id] += 1
        return wrapper(self, request, *args, **kwargs)

    Scheduler._mamba_block_aligned_split = counting  # type: ignore[method-assign]
    try:
        yield reached
    finally:
        Scheduler._mamba_block_aligned_split = wrapper  # type: ignore[method-assign]


def _split_calls(run: Harness) -> Counter[str]:
    """Every split call vLLM made per request: one per scheduled chunk at least."""
    return Counter({rid: len(spans) for rid, spans in run.result().chunks.items()})


def _run(sched_mode: Any) -> Harness:
    run = Harness(sched_mode.apply(CONFIG))
    run.add(*REQUESTS)
    result = run.run(max_steps=200)
    assert result.completed, result.stall_at
    return run


def test_calls_that_need_no_look_skip_the_wrapper(
    family: Family, load_plugin, sched_mode: Any
) -> None:
    split_rule = load_plugin()
    with counted_split() as reached:
        run = _run(sched_mode)
    state = getattr(run.scheduler, SPLIT_ATTR)
    chunks = _split_calls(run)
    text = ("text-a", "text-b")
    if state.quiet:  # nothing to look at: only the settling call meets the wrapper
        assert sum(reached.values()) == 1, reached
    elif split_rule and family.stops_mid_block:  # 0.27
        # Only multimodal requests can need the split rule: every one of the image
        # request's calls meets it, text requests' calls (but the settling one) do not.
        assert vars(run.scheduler).get(ARM_ATTR) is True
        assert reached["two-images"] >= chunks["two-images"]
        assert sum(reached[rid] for rid in text) <= 1, reached
    else:  # 0.15-0.26: the block-unit rule may re-align any request, every call looks
        assert all(reached[rid] >= chunks[rid] for rid in text), reached
        assert SPLIT_METHOD not in vars(run.scheduler)


def test_undo_leaves_no_scheduler_bound(load_plugin, sched_mode: Any) -> None:
    load_plugin()
    run = _run(sched_mode)
    scheduler = run.scheduler
    bound = vars(scheduler).get(SPLIT_METHOD)
    harness.unload_plugin()
    assert SPLIT_METHOD not in vars(scheduler)
    if bound is not None:  # what was bound is vLLM's own split, and its settlement goes too
        assert bound.__func__ is type(scheduler)._mamba_block_aligned_split
        assert ARM_ATTR not in vars(scheduler) and SPLIT_ATTR not in vars(scheduler)
