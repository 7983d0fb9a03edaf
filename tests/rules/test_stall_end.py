"""The stall end's pure parts (issue 21 item 1): the own-inputs proof, the bound, and the
update wrapper's promise never to raise into vLLM (its ends, and the watchdog's look it
carries). The end itself, on the
real scheduler: tests/scheduler/test_stall_end.py and tests/properties/test_stall_end.py.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_mamba_fix._log import logger
from vllm_mamba_fix.decide.stalls import (
    REPEATED,
    StallCause,
    StallReport,
    Streak,
    end_due,
    own_inputs_block,
)
from vllm_mamba_fix.facts.targets import MARKER
from vllm_mamba_fix.rules import end_order, stall_end, stall_watch, zero_streaks


def test_the_proof_on_the_stall_shapes() -> None:
    # 0.23 under MTP, images 0 apart: image 1 held, image 2 due, 16384 slots.
    assert "23688 cache tokens together" in (
        own_inputs_block({"a": 11844}, {"b": 11844}, 16384, 16384) or ""
    )
    # The request waiting behind it: its image fits alone (others hold the space).
    assert own_inputs_block({}, {"c": 11844}, 16384, 16384) is None
    # One input larger than the cache, or than one step's encoder budget.
    assert "has 600 tokens" in (own_inputs_block({}, {"d": 600}, 512, 1024) or "")
    assert "has 600 tokens" in (own_inputs_block({}, {"d": 600}, 1024, 512) or "")
    # Two due inputs over one step's budget (each fits alone).
    assert "one step's encoder budget" in (own_inputs_block({}, {"e": 300, "f": 300}, 1024, 512)
                                           or "")  # fmt: skip
    # An EC connector: the budget bounds nothing.
    assert own_inputs_block({}, {"e": 300, "f": 300}, 1024, None) is None
    # A repeated image is one cache entry: held and due under one key counts once.
    assert own_inputs_block({"a": 600}, {"a": 600}, 1000, 1000) is None


@given(
    held=st.dictionaries(st.integers(0, 5), st.integers(1, 3000), max_size=4),
    needed=st.dictionaries(st.integers(0, 5), st.integers(1, 3000), max_size=4),
    cache=st.integers(1, 8000),
    budget=st.one_of(st.none(), st.integers(1, 8000)),
)
def test_the_proof_matches_its_definition(
    held: dict[int, int], needed: dict[int, int], cache: int, budget: int | None
) -> None:
    due = {k: n for k, n in needed.items() if k not in held}
    bound = cache if budget is None else min(cache, budget)
    never = (
        any(n > bound for n in due.values())
        or (budget is not None and sum(due.values()) > budget)
        or sum(due.values()) + sum(held.values()) > cache
    )
    assert (own_inputs_block(held, needed, cache, budget) is not None) == never


@given(
    steps_named=st.integers(0, 5),
    since_named=st.floats(0, 100),
    bound=st.floats(0.001, 100),
    ordered=st.booleans(),
)
def test_the_bound_needs_time_and_repeated_zeros_after_naming(
    steps_named: int, since_named: float, bound: float, ordered: bool
) -> None:
    streak = Streak(7, 3, 0.0)
    streak.warned, streak.named_at, streak.steps_named = True, 0.0, steps_named
    streak.ordered = ordered
    due = end_due(streak, since_named, bound)
    assert due == (not ordered and steps_named >= REPEATED and since_named >= bound)
    assert not end_due(Streak(7, 9, 0.0), 1e9, bound)  # never named


@pytest.mark.usefixtures("session")
def test_the_watchdogs_look_never_raises_into_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler the look cannot read: vLLM's result, one warning, every step."""

    class Broken(_Host):
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(name)

    clock = iter(range(0, 1000, 2))
    monkeypatch.setattr(stall_watch, "clock", lambda: float(next(clock)))
    options = stall_end.EndOptions(30.0, 30.0)
    wrapper = stall_end.make_update_from_output_wrapper(_Host.update_from_output, options)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    host, out = Broken(), _Output()
    try:
        for _ in range(3):
            assert wrapper(host, out, "runner") == {"outputs": (out, "runner")}
    finally:
        logger.removeHandler(handler)
    failed = [r.getMessage() for r in records if "the stall watchdog failed" in r.getMessage()]
    assert len(failed) == 1, failed
    assert not zero_streaks.tracked_requests() & {"never-seen"}


def test_without_the_watchdog_the_wrapper_never_reads_its_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_clock() -> float:
        raise AssertionError("the watchdog is off")

    monkeypatch.setattr(stall_watch, "clock", no_clock)
    wrapper, host, out = _wrapped(), _Host(), _Output()
    assert wrapper(host, out, "runner") == {"outputs": (out, "runner")}


def test_the_report_says_what_the_plugin_does() -> None:
    report = StallReport("r", 5, 9, 3, 31.0, (), None, 10, 0, 10, StallCause.SPLIT_FLOOR,
                         end_note="; the plugin ends it 30 s from now")  # fmt: skip
    message = report.message()
    assert "likely cause: vLLM's block-aligned split floors" in message
    assert message.endswith("remedy: turn the split rule on (unset VLLM_MAMBA_FIX_SPLIT_RULE), "
                            "upgrade to vLLM 0.28+, or raise --max-num-batched-tokens"
                            "; the plugin ends it 30 s from now")  # fmt: skip


class _Host:
    """A host with vLLM's update_from_output shape; what it returns is its own."""

    def __init__(self, raises: BaseException | None = None) -> None:
        self.raises = raises
        self.requests: dict[str, Any] = {}

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if self.raises is not None:
            raise self.raises
        return {"outputs": (scheduler_output, model_runner_output)}


class _Output:
    def __init__(self) -> None:
        self.num_scheduled_tokens: dict[str, int] = {}


def _wrapped() -> Any:
    options = stall_end.EndOptions(None, 30.0)
    wrapper = stall_end.make_update_from_output_wrapper(_Host.update_from_output, options)
    assert getattr(wrapper, MARKER) == options
    assert wrapper.__wrapped__ is _Host.update_from_output  # type: ignore[attr-defined]
    return wrapper


def test_no_orders_is_vllms_result() -> None:
    wrapper, host, out = _wrapped(), _Host(), _Output()
    assert wrapper(host, out, "runner") == {"outputs": (out, "runner")}


@pytest.mark.parametrize("exc", [ValueError("vllm's"), KeyboardInterrupt()])
def test_vllms_exceptions_propagate(exc: BaseException) -> None:
    wrapper = _wrapped()
    with pytest.raises(type(exc)):
        wrapper(_Host(raises=exc), _Output(), "runner")


def test_a_failing_end_gives_one_warning_and_vllms_result() -> None:
    # vLLM's logging config, applied on its first import (inside the end), resets the handlers
    # of existing child loggers: import it before listening.
    pytest.importorskip("vllm.v1.engine")
    wrapper, host, out = _wrapped(), _Host(), _Output()
    host.requests = None  # type: ignore[assignment]  # reading it fails inside the end
    streak = Streak(3, 5, 0.0)
    order = end_order.EndOrder("r", 3, 3, zero_streaks.ZeroStreaks(), streak, "line", "message")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        for _ in range(2):
            end_order.order_end(host, order)
            assert wrapper(host, out, "runner") == {"outputs": (out, "runner")}
            assert not end_order.ordered(host)  # dropped, not retried forever
    finally:
        logger.removeHandler(handler)
    messages = [r.getMessage() for r in records]
    assert [m for m in messages if "ending a stalled request failed" in m] == [
        "vllm-mamba-fix: ending a stalled request failed (AttributeError: 'NoneType' object "
        "has no attribute 'get'); using vLLM's result"
    ], messages


def test_support_names_what_is_missing() -> None:
    assert "has no update_from_output" in (end_order.support(type("Bare", (), {})) or "")
    only_update = type("OnlyUpdate", (), {"update_from_output": lambda self: None})
    assert "has no finish_requests" in (end_order.support(only_update) or "")


def test_an_end_that_fails_for_one_order_leaves_every_order_of_the_step_orderable() -> None:
    """0.4.0 stopped at the first failing order and cleared the rest with ``ordered`` still
    set, so those stalls were never ordered again."""
    pytest.importorskip("vllm.v1.engine")
    wrapper, host, out = _wrapped(), _Host(), _Output()
    host.requests = None  # type: ignore[assignment]  # every end fails to read it
    orders = {
        rid: end_order.EndOrder(rid, 3, 3, zero_streaks.ZeroStreaks(), Streak(3, 5, 0.0), "l", "m")
        for rid in ("a", "b", "c")
    }
    for order in orders.values():
        order.streak.ordered = True
    for order in orders.values():
        end_order.order_end(host, order)
    assert end_order.ordered(host) == {"a", "b", "c"}
    assert wrapper(host, out, "runner") == {"outputs": (out, "runner")}
    assert not end_order.ordered(host)
    assert [o.streak.ordered for o in orders.values()] == [False, False, False]
