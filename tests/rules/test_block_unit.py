"""rules/block_unit.py: the block-unit rule's engaged split call (vLLM #54076).

vLLM's split is a function that records the ``cache_config.block_size`` it read; the rule must
ask it through the cache's block on a prefill chunk only, always put the scheduler's own
``cache_config`` back, and count a chunk the configured block would have ended elsewhere.
The rule on the real Scheduler and engine: tests/scheduler/test_block_units.py and
tests/e2e/test_cache_reuse.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_mamba_fix.facts.blocks import CacheConfigView, SplitState
from vllm_mamba_fix.observe import counters
from vllm_mamba_fix.rules.block_unit import make_engaged

CACHE_BLOCK, CONFIGURED = 256, 128
PROMPT = 1000


class Scheduler:
    def __init__(self) -> None:
        self.cache_config = SimpleNamespace(block_size=CONFIGURED, enable_prefix_caching=True)
        self.seen: list[int] = []


def split(self: Scheduler, request: Any, num_new_tokens: int, *_: Any) -> int:
    """vLLM 0.26+'s floor, in whatever block ``cache_config`` says now."""
    block = self.cache_config.block_size
    self.seen.append(block)
    start = request.num_computed_tokens
    end = start + num_new_tokens
    if end >= request.num_prompt_tokens:
        return num_new_tokens
    return max(0, end // block * block - start)


def request(at: int) -> Any:
    return SimpleNamespace(
        request_id="r", num_computed_tokens=at, num_prompt_tokens=PROMPT, num_tokens=PROMPT
    )


def state_of(scheduler: Scheduler, starved: bool = False, size: int = CACHE_BLOCK) -> SplitState:
    view = CacheConfigView(scheduler.cache_config, size)
    return SplitState(size, view, CONFIGURED, starved=starved)


def ask(engaged: Any, scheduler: Scheduler, state: SplitState, req: Any, asked: int) -> int:
    return int(engaged(scheduler, state, req, asked, 0, (), {}))


def fall_back(exc: Exception, answer: Any) -> Any:
    raise AssertionError(f"the rule failed: {exc!r}")  # nothing here may fail


def looked(*args: Any) -> int:
    return args[3]  # the answer, as the split rule would leave it


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    counters.reset()
    yield


def test_a_prefill_chunk_is_asked_in_the_caches_block_and_the_config_is_put_back() -> None:
    scheduler = Scheduler()
    real = scheduler.cache_config
    engaged = make_engaged(split, absolute_end=True, look=looked, fall_back=fall_back)
    # [0, 300): the configured block ends it at 256 too; [0, 400): 256, not 384.
    assert ask(engaged, scheduler, state_of(scheduler), request(0), 300) == 256
    assert counters.stats()["block_rule_chunks"] == 0
    assert ask(engaged, scheduler, state_of(scheduler), request(0), 400) == 256
    assert counters.stats()["block_rule_chunks"] == 1
    assert scheduler.seen == [CACHE_BLOCK, CACHE_BLOCK]
    assert scheduler.cache_config is real


def test_a_decode_is_vllms_answer_in_the_configured_block() -> None:
    scheduler = Scheduler()
    engaged = make_engaged(split, absolute_end=True, look=looked, fall_back=fall_back)
    assert ask(engaged, scheduler, state_of(scheduler), request(PROMPT), 1) == 1
    assert scheduler.seen == [CONFIGURED]


def test_vllms_exception_propagates_and_the_config_is_still_put_back() -> None:
    scheduler = Scheduler()
    real = scheduler.cache_config

    def raising(self: Scheduler, *args: Any) -> int:
        raise ValueError("vLLM's own")

    engaged = make_engaged(raising, absolute_end=True, look=looked, fall_back=fall_back)
    with pytest.raises(ValueError, match="vLLM's own"):
        ask(engaged, scheduler, state_of(scheduler), request(0), 400)
    assert scheduler.cache_config is real


def test_starved_the_configured_answer_stops_at_the_caches_boundary() -> None:
    """A cache block longer than any chunk: asked in it, 0.15-0.26 would floor to 0 forever.
    The configured answer, stopped at the next cache boundary, is what stock schedules."""
    scheduler = Scheduler()
    engaged = make_engaged(split, absolute_end=True, look=looked, fall_back=fall_back)
    state = state_of(scheduler, starved=True, size=2048)
    long_prompt = request(1900)
    long_prompt.num_prompt_tokens = long_prompt.num_tokens = 5000
    # configured: [1900, 2176); the cache's boundary at 2048 comes first
    assert ask(engaged, scheduler, state, long_prompt, 300) == 148
    assert counters.stats()["block_rule_chunks"] == 1
    long_prompt.num_computed_tokens = 0
    assert ask(engaged, scheduler, state, long_prompt, 300) == 256  # stock's chunk
    assert counters.stats()["block_rule_chunks"] == 1
    assert scheduler.seen == [CONFIGURED, CONFIGURED]


def test_the_arguments_reach_vllm_untouched_and_their_tokens_count_as_computed() -> None:
    scheduler = Scheduler()
    calls: list[tuple[Any, ...]] = []

    def recording(self: Scheduler, req: Any, n: int, *args: Any, **kwargs: Any) -> int:
        calls.append((n, args, kwargs))
        return n

    engaged = make_engaged(recording, absolute_end=True, look=looked, fall_back=fall_back)
    # 990 computed + 10 local: the chunk starts at the end of the prompt, a decode
    assert engaged(scheduler, state_of(scheduler), request(990), 1, 10, (10, 0), {"x": 1}) == 1
    assert calls == [(1, (10, 0), {"x": 1})]
    assert scheduler.cache_config.block_size == CONFIGURED
