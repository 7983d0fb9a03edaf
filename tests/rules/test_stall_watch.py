"""rules/stall_watch.py and its look, rules/stall_look.py: the stall watchdog once per step,
under a clock the test moves.

The scheduler and the step's ``scheduler_output`` are stand-ins with the fields the watchdog
reads (vLLM's names); every wait of the clock is longer than the bound it tests. What the
watchdog does on the real Scheduler (every mode, the split rule on and off):
tests/scheduler/test_stall_hearing.py.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tests.stall_end_helpers import count_samples
from vllm_mamba_fix.changes import Changes, installation
from vllm_mamba_fix.decide.stalls import Streak
from vllm_mamba_fix.facts.blocks import BLOCK_ATTR
from vllm_mamba_fix.observe import counters
from vllm_mamba_fix.rules import stall_look, stall_watch
from vllm_mamba_fix.rules.stall_look import SAMPLE_SECONDS

SECONDS = 30.0
BUDGET = 1000
BLOCK = 256


class Scheduler:
    """The fields the watchdog reads, vLLM's names; no wrapper of the split (no split rule)."""

    def __init__(self, max_running: int = 8) -> None:
        self.cache_config = SimpleNamespace(block_size=BLOCK)
        setattr(self, BLOCK_ATTR, BLOCK)
        self.encoder_cache_manager = SimpleNamespace(
            cache_size=100, num_free_slots=0, get_cached_input_ids=lambda request: set()
        )
        self.requests: dict[str, Any] = {}
        self.running: list[Any] = []
        self.waiting: list[Any] = []
        self.max_num_running_reqs = max_running
        self.max_num_scheduled_tokens = BUDGET
        self.scheduler_config = SimpleNamespace(
            max_num_batched_tokens=BUDGET, long_prefill_token_threshold=0
        )


def request(rid: str = "r", computed: int = 100, status: str = "RUNNING") -> Any:
    return SimpleNamespace(
        request_id=rid, num_prompt_tokens=1000, num_tokens=1000, num_computed_tokens=computed,
        mm_features=[], is_finished=lambda: False, status=SimpleNamespace(name=status),
    )  # fmt: skip


def running(scheduler: Any, *requests: Any) -> None:
    for req in requests:
        scheduler.requests[req.request_id] = req
        scheduler.running.append(req)


def output(used: int, **scheduled: int) -> Any:
    """A step that scheduled ``used`` tokens of the budget, ``scheduled`` by request."""
    return SimpleNamespace(num_scheduled_tokens=dict(scheduled), total_num_scheduled_tokens=used)


LEFT_A_BLOCK = BUDGET - BLOCK  # used: exactly a block of budget left
USED = BUDGET - BLOCK + 1  # used: less than a block left


class Clock:
    def __init__(self, per_call: float = 0.0) -> None:
        self.now = 0.0
        self.per_call = per_call
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        self.now += self.per_call
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch, session: Changes) -> Clock:
    fake = Clock()
    monkeypatch.setattr(stall_watch, "clock", fake)
    return fake


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


def observer(end_after: float | None) -> Any:
    """The look the update wrapper builds, with the rule's module."""
    return stall_look.make_observer(stall_look.Watching(SECONDS, end_after, stall_watch))


def streak_of(scheduler: Any, rid: str = "r") -> Any:
    watch = installation.memory[stall_look.Watches].get(scheduler)
    return None if watch is None else watch.store.by_request.get(rid)


def test_a_stop_is_named_once_after_three_samples_and_the_bound(
    clock: Clock, records: list[logging.LogRecord]
) -> None:
    observe = observer(None)
    scheduler, req = Scheduler(), request()
    running(scheduler, req)
    for step in range(3):
        observe(scheduler, output(LEFT_A_BLOCK))
        clock.now += SECONDS / 2 + 1  # each wait longer than half the bound
        assert not named_lines(records) or step == 2
    observe(scheduler, output(LEFT_A_BLOCK))
    assert len(named_lines(records)) == 1
    assert counters.stats()["stalls_detected"] == 1
    clock.now += SECONDS
    observe(scheduler, output(LEFT_A_BLOCK))
    assert len(named_lines(records)) == 1  # once per stall
    req.num_computed_tokens += 64  # scheduled in the step: it moves
    clock.now += SAMPLE_SECONDS
    observe(scheduler, output(64, r=64))
    assert counters.stats()["stalls_resolved"] == 1
    assert streak_of(scheduler) is None


def test_a_step_that_used_its_budget_counts_no_stop(clock: Clock) -> None:
    """Issue 44: a 0 in a step that left less than a block of token budget is a wait; one in
    a step that left a block is a stop (the split would not have floored a block)."""
    observe = observer(None)
    scheduler, req = Scheduler(), request()
    running(scheduler, req)
    observe(scheduler, output(USED))
    assert streak_of(scheduler) is None
    clock.now += SAMPLE_SECONDS
    observe(scheduler, output(LEFT_A_BLOCK))
    counted = streak_of(scheduler)
    assert counted is not None and counted.steps == 1
    # Another step that used its budget leaves the streak as it is: not counted, not reset.
    clock.now += SAMPLE_SECONDS
    observe(scheduler, output(USED))
    assert streak_of(scheduler) is counted and counted.steps == 1
    # Steps between two samples all count, at the next stop counted.
    for _ in range(4):
        observe(scheduler, output(LEFT_A_BLOCK))
    clock.now += SAMPLE_SECONDS
    observe(scheduler, output(LEFT_A_BLOCK))
    assert streak_of(scheduler) is counted and counted.steps == 6


def test_the_least_chunk_is_the_longest_chunk_where_that_is_shorter(clock: Clock) -> None:
    observe = observer(None)
    scheduler, req = Scheduler(), request()
    scheduler.scheduler_config.long_prefill_token_threshold = 100
    running(scheduler, req)
    assert stall_look.least_chunk(scheduler) == 100
    observe(scheduler, output(BUDGET - 100))
    assert streak_of(scheduler) is not None


def test_a_scheduled_or_decoding_request_is_no_candidate(clock: Clock) -> None:
    observe = observer(None)
    scheduler = Scheduler()
    decoding = request("decoding", computed=1000)
    scheduled = request("scheduled")
    running(scheduler, decoding, scheduled)
    observe(scheduler, output(LEFT_A_BLOCK - 1, scheduled=1))
    assert streak_of(scheduler, "decoding") is None and streak_of(scheduler, "scheduled") is None


def test_the_waiting_head_counts_only_where_the_waiting_loop_ran(clock: Clock) -> None:
    """Behind max_num_seqs (every running slot taken) or a preemption the waiting loop does
    not run: its head's 0 says nothing. With a free slot, the head (not the one behind it)."""
    observe = observer(None)
    scheduler = Scheduler(max_running=1)
    running(scheduler, request("decoding", computed=1000))
    head, behind = request("head", 0, "WAITING"), request("behind", 0, "WAITING")
    scheduler.waiting += [head, behind]
    observe(scheduler, output(1))
    assert streak_of(scheduler, "head") is None
    scheduler.max_num_running_reqs = 2
    clock.now += SAMPLE_SECONDS
    preempted = output(1)
    preempted.preempted_req_ids = {"other"}
    observe(scheduler, preempted)
    assert streak_of(scheduler, "head") is None
    clock.now += SAMPLE_SECONDS
    observe(scheduler, output(1))
    assert streak_of(scheduler, "head") is not None and streak_of(scheduler, "behind") is None


def test_a_zero_that_moves_to_another_position_starts_a_new_streak(clock: Clock) -> None:
    observe = observer(None)
    scheduler, req = Scheduler(), request()
    running(scheduler, req)
    observe(scheduler, output(LEFT_A_BLOCK))
    clock.now += 2 * SECONDS
    req.num_computed_tokens = 101
    observe(scheduler, output(LEFT_A_BLOCK))
    streak = streak_of(scheduler)
    assert streak.position == 101 and streak.steps == 1


def test_it_samples_at_most_once_a_second(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost bound: one clock read per step, one pass over the requests per second. A
    clock that moves 0.1 s per read, 30 steps: 3 s, so at most 4 samples."""
    clock.per_call = 0.1
    samples = count_samples(monkeypatch)
    observe = observer(None)
    scheduler = Scheduler()
    running(scheduler, request())
    for _ in range(30):
        observe(scheduler, output(LEFT_A_BLOCK))
    assert clock.reads == 30
    assert 1 <= len(samples) <= 4, samples
    assert samples[0] == 1  # the first step samples
    assert sum(samples) <= 30


def test_the_named_stalls_live_beside_the_scheduler_not_on_it(clock: Clock) -> None:
    """No coupling through a scheduler's attributes: naming sets none, and a scheduler that
    goes takes its streaks and named stalls with it."""
    observe = observer(60.0)
    scheduler, req = Scheduler(), request()
    running(scheduler, req)
    before = set(vars(scheduler))
    for _ in range(4):
        observe(scheduler, output(LEFT_A_BLOCK))
        clock.now += SECONDS
    assert set(vars(scheduler)) == before
    assert "r" in stall_watch._named_stalls(scheduler)
    gone = weakref.ref(scheduler)
    del scheduler
    gc.collect()
    assert gone() is None
    assert len(installation.memory[stall_watch.Named]) == 0
    assert len(installation.memory[stall_look.Watches]) == 0


def test_a_freed_request_leaves_no_streak(clock: Clock) -> None:
    from vllm_mamba_fix.rules.zero_streaks import forget_request, tracked_requests

    observe = observer(None)
    scheduler, req = Scheduler(), request("freed")
    running(scheduler, req)
    observe(scheduler, output(LEFT_A_BLOCK))
    assert "freed" in tracked_requests()
    forget_request("freed")
    assert "freed" not in tracked_requests()


def image(offset: int, length: int) -> Any:
    return SimpleNamespace(mm_position=SimpleNamespace(offset=offset, length=length))


def test_the_cause_reads_what_the_request_stands_at(clock: Clock) -> None:
    """At an input the check cannot schedule: the check's own 0 (False); before it, a cut
    only the split floors (None); no speculative shift, so never the speculative stall."""
    scheduler = Scheduler()
    streak = Streak(100, 3, 0.0)
    at_input = request()
    at_input.mm_features = [image(100, 50)]
    assert stall_look.speculative_zero(scheduler, at_input, 100, streak) is False
    before_input = request()
    before_input.mm_features = [image(120, 50)]
    assert stall_look.speculative_zero(scheduler, before_input, 100, streak) is None
    # An input it holds is no wait: the next one decides.
    scheduler.encoder_cache_manager.get_cached_input_ids = lambda request: {0}
    both = request()
    both.mm_features = [image(90, 20), image(130, 10)]
    assert stall_look.speculative_zero(scheduler, both, 100, streak) is None


def test_a_waiting_request_stands_at_its_prefix_hit(clock: Clock) -> None:
    """A request with nothing computed starts at its local prefix-cache hit (read from the
    coordinator, as vLLM's get_computed_blocks, without its stats), where vLLM asks for it."""
    scheduler, waiting = Scheduler(), request("w", 0, "WAITING")
    waiting.block_hashes = ["h0", "h1"]
    asked: list[Any] = []

    def find_longest_cache_hit(hashes: Any, max_length: int) -> tuple[Any, int, int]:
        asked.append((hashes, max_length))
        return (), 256, 0

    scheduler.kv_cache_manager = SimpleNamespace(
        enable_caching=True,
        coordinator=SimpleNamespace(find_longest_cache_hit=find_longest_cache_hit),
    )
    assert stall_look.start_of(scheduler, waiting) == 256
    assert asked == [(["h0", "h1"], 999)]
    waiting.skip_reading_prefix_cache = True
    assert stall_look.start_of(scheduler, waiting) == 0
    scheduler.kv_cache_manager.enable_caching = False
    waiting.skip_reading_prefix_cache = False
    assert stall_look.start_of(scheduler, waiting) == 0
    assert stall_look.start_of(scheduler, request()) == 100  # computed tokens: no lookup
    assert len(asked) == 1
    # The head is counted there, and its streak holds while the hit stays.
    scheduler.kv_cache_manager.enable_caching = True
    scheduler.waiting.append(waiting)
    scheduler.requests["w"] = waiting
    observe = observer(None)
    observe(scheduler, output(0))
    assert streak_of(scheduler, "w").position == 256
    clock.now += SAMPLE_SECONDS
    observe(scheduler, output(0))
    assert streak_of(scheduler, "w").steps == 2
