"""rules/stall_watch.py: the stall watchdog, per 0 it hears, under a clock the test moves.

The scheduler is a stand-in with the fields the watchdog reads (vLLM's names); every wait
of the clock is longer than the bound it tests. What the watchdog does on the real Scheduler
(every mode, the split rule on and off): tests/scheduler/test_stall_hearing.py.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_mamba_fix.decide.scope import ScopePolicy
from vllm_mamba_fix.facts.blocks import BLOCK_ATTR
from vllm_mamba_fix.facts.config import Scope
from vllm_mamba_fix.facts.targets import ENCODER_METHOD, MARKER
from vllm_mamba_fix.observe import counters
from vllm_mamba_fix.rules import end_order, stall_watch
from vllm_mamba_fix.rules.encoder_wrapper import EncoderOptions
from vllm_mamba_fix.rules.zero_streaks import SPLIT_ZEROS

SECONDS = 30.0


def _check(*args: Any) -> Any:
    return None


def scheduler_class(end_after: float | None = None) -> type:
    check = lambda *args: None  # noqa: E731 - the encoder check, carrying the watchdog's options
    options = EncoderOptions(ScopePolicy(Scope.MULTIMODAL), False, SECONDS, end_after)
    setattr(check, MARKER, options)
    return type("Scheduler", (), {ENCODER_METHOD: check})


def build(cls: type) -> Any:
    scheduler = cls()
    scheduler.cache_config = SimpleNamespace(block_size=256)
    setattr(scheduler, BLOCK_ATTR, 256)
    scheduler.encoder_cache_manager = SimpleNamespace(
        cache_size=100, num_free_slots=0, get_cached_input_ids=lambda request: set()
    )
    scheduler.requests = {}
    return scheduler


def request(rid: str = "r") -> Any:
    return SimpleNamespace(
        request_id=rid, num_prompt_tokens=1000, num_computed_tokens=100, mm_features=[],
        is_finished=lambda: False,
    )  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    fake = Clock()
    monkeypatch.setattr(stall_watch, "clock", fake)
    counters.reset()
    yield fake
    SPLIT_ZEROS.clear("r")
    stall_watch.forget_named()


def named_lines(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if "stalled at token" in r.getMessage()]


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.mamba_fix")
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


def test_a_split_0_is_named_once_after_three_steps_and_the_bound(
    clock: Clock, records: list[logging.LogRecord]
) -> None:
    scheduler, req = build(scheduler_class()), request()
    scheduler.requests["r"] = req
    for step in range(3):
        stall_watch.split_zero(scheduler, req, 100)
        clock.now += SECONDS / 2 + 1  # each wait longer than half the bound
        assert not named_lines(records) or step == 2
    stall_watch.split_zero(scheduler, req, 100)
    assert len(named_lines(records)) == 1
    assert counters.stats()["stalls_detected"] == 1
    stall_watch.split_zero(scheduler, req, 100)
    assert len(named_lines(records)) == 1  # once per stall
    stall_watch.split_moved("r")
    assert counters.stats()["stalls_resolved"] == 1
    assert "r" not in SPLIT_ZEROS.by_request


def test_a_zero_that_moves_to_another_position_starts_a_new_streak(clock: Clock) -> None:
    scheduler, req = build(scheduler_class()), request()
    stall_watch.split_zero(scheduler, req, 100)
    clock.now += 2 * SECONDS
    stall_watch.split_zero(scheduler, req, 101)
    assert SPLIT_ZEROS.by_request["r"].steps == 1


def test_the_named_stalls_live_beside_the_scheduler_not_on_it(clock: Clock) -> None:
    """No coupling through a scheduler's attributes: naming sets none, and a scheduler that
    goes takes its named stalls with it."""
    scheduler, req = build(scheduler_class(end_after=60.0)), request()
    scheduler.requests["r"] = req
    before = set(vars(scheduler))
    for _ in range(4):
        stall_watch.split_zero(scheduler, req, 100)
        clock.now += SECONDS
    assert set(vars(scheduler)) == before
    assert "r" in stall_watch._named_stalls(scheduler)
    gone = weakref.ref(scheduler)
    del scheduler
    gc.collect()
    assert gone() is None
    assert len(stall_watch._named) == 0


def test_a_stall_with_the_watchdog_off_is_not_heard(clock: Clock) -> None:
    scheduler = build(type("Scheduler", (), {ENCODER_METHOD: _check}))
    for _ in range(5):
        stall_watch.split_zero(scheduler, request(), 100)
        clock.now += 2 * SECONDS
    assert "r" not in SPLIT_ZEROS.by_request
    assert not end_order.ordered(scheduler)
