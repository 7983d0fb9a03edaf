"""rules/speculative_stall.py: the speculative-stall rule per 0 of the encoder-input check.

The encoder cache manager and the check are stand-ins with vLLM's shapes (its
``get_cached_input_ids``, ``free_encoder_input`` and ``(…, num_new_tokens, …)`` result); the
rule's decisions are decide/decision.py's (tests/unit/test_decision.py,
tests/unit/test_unshifted_cut.py). The rule on the real Scheduler under MTP and EAGLE:
tests/scheduler/test_speculative_stall.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vllm_mamba_fix.decide.stalls import Streak
from vllm_mamba_fix.observe import counters
from vllm_mamba_fix.rules import speculative_stall
from vllm_mamba_fix.rules.speculative_stall import EncoderCall


class Cache:
    def __init__(self, held: set[int]) -> None:
        self.held = held
        self.freed: list[int] = []

    def get_cached_input_ids(self, request: Any) -> set[int]:
        return set(self.held)

    def free_encoder_input(self, request: Any, input_id: int) -> None:
        self.held.discard(input_id)
        self.freed.append(input_id)


def image(offset: int, length: int) -> Any:
    return SimpleNamespace(mm_position=SimpleNamespace(offset=offset, length=length))


def setup(held: set[int], *images: tuple[int, int]) -> tuple[Any, Any]:
    scheduler = SimpleNamespace(encoder_cache_manager=Cache(held))
    request = SimpleNamespace(request_id="r", mm_features=[image(*i) for i in images])
    return scheduler, request


pytestmark = pytest.mark.usefixtures("session")


def test_a_held_image_the_request_is_past_is_freed_and_the_check_asked_without_the_shift() -> None:
    """Image 0 [10, 20) ends at the position (20); MTP K=1 keeps it cached until 21 and cuts
    before image 1 [21, 31) one token early: 0 forever on 0.24-0.32."""
    scheduler, request = setup({0}, (10, 10), (21, 10))
    stalled, to_free = speculative_stall.stalled_inputs(scheduler, request, 20, 1, Streak(20, 1, 0))
    assert (stalled, to_free) == (True, (0,))
    asked: list[tuple[int, ...]] = []

    def check(sched: Any, req: Any, computed: int, n: int, budget: int, shift: int) -> Any:
        asked.append((computed, n, budget, shift))
        return ([1], 1 if not sched.encoder_cache_manager.held else 0, budget)

    retry = speculative_stall.release(
        check, EncoderCall(scheduler, request, 20, 11, 100, 1), to_free, 256
    )
    assert retry is not None and retry[1] == 1
    assert scheduler.encoder_cache_manager.freed == [0]
    assert asked == [(20, 11, 100, 0)]
    assert counters.stats()["speculative_stalls_released"] == 1


def test_no_shift_or_nothing_held_near_is_no_stall() -> None:
    scheduler, request = setup({0}, (10, 10), (21, 10))
    assert speculative_stall.stalled_inputs(scheduler, request, 20, 0, Streak(20, 5, 0)) == (
        False, (),
    )  # fmt: skip
    scheduler, request = setup({0}, (100, 10), (200, 10))
    assert not speculative_stall.stalled_inputs(scheduler, request, 20, 1, Streak(20, 5, 0))[0]


def test_two_uncached_images_within_the_shift_need_the_unshifted_cut_once_repeated() -> None:
    """A warm repeat: a prefix hit one token before an evicted image's end, the next right
    after; looked for only on the second 0 at the position."""
    scheduler, request = setup(set(), (10, 10), (20, 10))
    assert not speculative_stall.stalled_inputs(scheduler, request, 19, 1, Streak(19, 1, 0))[0]
    assert speculative_stall.stalled_inputs(scheduler, request, 19, 1, Streak(19, 2, 0)) == (
        True, (),
    )  # fmt: skip


def test_a_retry_that_still_gives_0_is_no_answer() -> None:
    scheduler, request = setup({0}, (10, 10), (21, 10))

    def check(*args: Any) -> Any:
        return ([], 0, 100)

    assert (
        speculative_stall.release(check, EncoderCall(scheduler, request, 20, 11, 100, 1), (0,), 256)
        is None
    )
    assert counters.stats()["speculative_stalls_released"] == 0
