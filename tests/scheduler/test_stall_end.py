"""Issue 21 item 1 on the real scheduler: a stall no rule can end is ended, and only that one.

The watchdog names a request that gets 0 tokens at one position (30 s, 3 steps);
once the stall has lasted VLLM_MAMBA_FIX_END_STALLS_AFTER past the naming and the
request's own encoder inputs cannot be scheduled whatever other requests do, the
plugin finishes it the way vLLM finishes a request it fails itself
(``finish_requests`` at the start of ``update_from_output``, one finished output):
abort with the cause as the stop reason (0.15-0.32), an error carrying it (0.33).

Time is a clock the test advances 5 s per engine step (tests/stall_end_helpers.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.scheduler.test_speculative_stall import _speculative_stall_on_stock
from tests.stall_end_helpers import (
    ENDED_PREFIX,
    Clock,
    Finish,
    assert_pools_clean,
    capture_finishes,
    ended,
    install_clock,
    load_with_stall_end,
    update_without_end,
    update_wrapped,
)
from tools import sched_harness as harness
from tools.release_facts import facts_for
from tools.scenarios import ISSUE_CONFIG, image_request, text_request
from tools.sched_harness import HarnessConfig, Mode, RequestSpec
from vllm_mamba_fix.facts.versions import Family, release_of
from vllm_mamba_fix.observe import counters

STEP_SECONDS = 5.0
BOUND = 30.0  # VLLM_MAMBA_FIX_END_STALLS_AFTER in these tests


def _run(
    cfg: HarnessConfig,
    clock: Clock,
    first: tuple[RequestSpec, ...],
    behind: tuple[RequestSpec, ...],
    max_steps: int = 200,
) -> tuple[harness.Harness, dict[str, Finish]]:
    """``first`` at step 0, ``behind`` one step later; 5 s of clock per step."""
    h = harness.Harness(cfg)
    finishes = capture_finishes(h.scheduler)
    h.add(*first)
    h.step()
    clock.advance(STEP_SECONDS)
    h.add(*behind)
    while len(h.finished) < len(h.requests) and h.step_index < max_steps:
        h.advance()
        clock.advance(STEP_SECONDS)
    return h, finishes


def _env(end_after: str, **extra: str) -> dict[str, str]:
    return {
        "VLLM_MAMBA_FIX_STALL_SECONDS": "30",
        "VLLM_MAMBA_FIX_END_STALLS_AFTER": end_after,
        **extra,
    }


def _assert_ended(finish: Finish, *needles: str) -> None:
    """The client's view: a finish with an abort (0.15-0.32) or an error (0.33) and the cause."""
    from vllm.v1.engine import EngineCoreOutput, FinishReason

    assert isinstance(finish.stop_reason, str) and finish.stop_reason.startswith(ENDED_PREFIX)
    carries_errors = "error" in EngineCoreOutput.__struct_fields__
    assert (finish.error is not None) == carries_errors, finish
    if carries_errors:  # 0.33: EngineCoreOutput.error
        assert finish.finish_reason == FinishReason.ERROR
        assert finish.error.message == finish.stop_reason and not finish.error.retryable
    else:
        assert finish.finish_reason == FinishReason.ABORT
    for needle in ("likely cause:", "remedy:", *needles):
        assert needle in finish.stop_reason, (needle, finish.stop_reason)


def _assert_completed(finishes: dict[str, Finish], *request_ids: str) -> None:
    from vllm.v1.engine import FinishReason

    for rid in request_ids:
        assert finishes[rid].finish_reason == FinishReason.LENGTH, (rid, finishes.get(rid))


def _watchdog_seconds() -> float | None:
    """The watchdog's seconds as the plugin installed it (None: not installed)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_mamba_fix.facts.targets import MARKER, UPDATE_METHOD

    options = getattr(getattr(Scheduler, UPDATE_METHOD, None), MARKER, None)
    return getattr(options, "stall_seconds", None)


def _ended_lines(vllm_log: list[str]) -> list[str]:
    return [m for m in vllm_log if m.startswith("vllm-mamba-fix: ended request")]


# The speculative look-ahead stall vLLM 0.15-0.23 leave (no rule may end it there).
SPEC_FIRST = (text_request("spec-text", 3000), image_request("spec-image", (5, 0, 200)))
# Behind it: a two-image request the held image keeps out of the encoder cache, and a
# text request.
SPEC_BEHIND = (image_request("queued-image", (40, 10, 60)), text_request("queued-text", 3000))


def _unendable_speculative(family: Family, mode: Mode) -> Mode:
    if not mode.speculative:
        pytest.skip(f"{mode}: no speculative decoding, no look-ahead stall")
    if not _speculative_stall_on_stock(family, 0) or family.drafter_fallback:
        pytest.skip(f"family {family.name}: a rule ends the look-ahead stall or there is none")
    return mode


@pytest.mark.parametrize("end_after", [str(BOUND), "off"])
def test_speculative_stall_is_ended(
    family: Family,
    sched_mode: Mode,
    load_plugin: Any,
    vllm_log: list[str],
    monkeypatch: pytest.MonkeyPatch,
    end_after: str,
) -> None:
    mode = _unendable_speculative(family, sched_mode)
    clock = install_clock(monkeypatch)
    load_plugin(**_env(end_after))
    with update_without_end() if end_after == "off" else update_wrapped(BOUND):
        h, finishes = _run(mode.apply(ISSUE_CONFIG), clock, SPEC_FIRST, SPEC_BEHIND)
    if end_after == "off":
        # Stock's hang, named and left: the image request waits, and so does the image
        # request its held image keeps out of the encoder cache.
        assert {"spec-image", "queued-image"} <= set(h.result().stall_at)
        assert not ended(finishes) and not _ended_lines(vllm_log)
        return
    assert ended(finishes) == {"spec-image"}
    _assert_ended(finishes["spec-image"], "EAGLE-type speculative decoding", "0.33+")
    _assert_completed(finishes, "spec-text", "queued-image", "queued-text")
    assert h.result().completed
    assert_pools_clean(h.scheduler)
    assert counters.stats()["stalls_ended"] == 1
    (line,) = _ended_lines(vllm_log)
    assert "ended request spec-image: 0 tokens at token 11848 of" in line
    assert f"after it was named (VLLM_MAMBA_FIX_END_STALLS_AFTER={BOUND:g})" in line
    # Named once and ended within the bound plus one step of its naming.
    named = [m for m in vllm_log if "request spec-image stalled at token" in m]
    assert len(named) == 1 and "the plugin ends it 30 s from now" in named[0]
    waited = float(line.split(" s after it was named")[0].rsplit(", ", 1)[1])
    assert BOUND <= waited <= BOUND + STEP_SECONDS


# The split's own hang, the split rule off (stock's split; the watchdog looks per step).
SPLIT_FIRST = (image_request("running-image", (100, 50, 200)),)
SPLIT_BEHIND = (image_request("one-image", (40, 60)), text_request("queued-text", 3000))


def test_split_floor_stall_is_ended(
    family: Family,
    sched_mode: Mode,
    load_plugin: Any,
    vllm_log: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not facts_for(family).image_deadlock:
        pytest.skip(f"family {family.name}: stock's split does not hang on two images")
    if sched_mode.speculative:
        pytest.skip("the look-ahead stall is test_speculative_stall_is_ended's")
    clock = install_clock(monkeypatch)
    load_plugin(**_env(str(BOUND), VLLM_MAMBA_FIX_SPLIT_RULE="0"))
    if _watchdog_seconds() is None:
        pytest.skip("the plugin runs no watchdog with the split rule off on this release")
    with update_wrapped(BOUND):
        h, finishes = _run(sched_mode.apply(ISSUE_CONFIG), clock, SPLIT_FIRST, SPLIT_BEHIND)
    assert ended(finishes) == {"running-image"}
    _assert_ended(finishes["running-image"], "block-aligned split", "VLLM_MAMBA_FIX_SPLIT_RULE")
    _assert_completed(finishes, "one-image", "queued-text")
    assert_pools_clean(h.scheduler)
    # The image request kept waiting by the stalled one's image was named, never ended.
    named = [m for m in vllm_log if "request one-image stalled at token" in m]
    assert named and "not ended while its own encoder inputs fit" in named[0]
    assert len(_ended_lines(vllm_log)) == 1


def test_input_larger_than_the_cache_is_ended(
    sched_mode: Mode, load_plugin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An image the encoder cache can never hold, beside a text request, in every family
    (a budget of 2048: 0.17 rejects budgets below the 1056 block it derives):
    the shape 0.33 still has (an error carrying the message there)."""
    clock = install_clock(monkeypatch)
    load_with_stall_end(lambda **env: load_plugin(**_env(str(BOUND)), **env))
    cfg = HarnessConfig(
        block_size=256, max_num_batched_tokens=2048, encoder_cache_tokens=512,
        max_model_len=8192,
    )  # fmt: skip
    big = image_request("big-image", (300, 100), image_tokens=600)
    with update_wrapped(BOUND):
        h, finishes = _run(
            sched_mode.apply(cfg), clock, (big, text_request("beside", 700)),
            (text_request("behind", 900),),
        )  # fmt: skip
    assert ended(finishes) == {"big-image"}
    _assert_ended(finishes["big-image"], "has 600 tokens (encoder cache 512")
    _assert_completed(finishes, "beside", "behind")
    assert_pools_clean(h.scheduler)


def test_an_order_for_a_moving_request_is_dropped(
    load_plugin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The finish's own guard: an end order (as the decision places one) for a request that
    moved since, or is in the batch being updated, is dropped. One request, sync, so it is
    scheduled in every step until it finishes; an order before each step."""
    from vllm_mamba_fix.rules import end_order, zero_streaks

    install_clock(monkeypatch)
    load_with_stall_end(lambda **env: load_plugin(**_env(str(BOUND)), **env))
    with update_wrapped(BOUND):
        h = harness.Harness(ISSUE_CONFIG)
        finishes = capture_finishes(h.scheduler)
        h.add(image_request("healthy", (100, 50)))
        request = h.requests["healthy"]
        store = zero_streaks.ZeroStreaks()
        orders = 0
        while not request.is_finished() and h.step_index < 50:
            streak, _ = store.zero("healthy", request.num_computed_tokens, 0.0)
            order = end_order.EndOrder(
                "healthy", request.num_computed_tokens, request.num_computed_tokens, store,
                streak, "test order", f"{ENDED_PREFIX}: test",
            )  # fmt: skip
            end_order.order_end(h.scheduler, order)
            orders += 1
            h.step()
    assert request.is_finished() and orders >= 3
    assert not ended(finishes)
    _assert_completed(finishes, "healthy")
    assert not end_order.ordered(h.scheduler)


def test_every_scheduler_class_can_end(family: Family) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_mamba_fix.rules.end_order import support

    assert support(Scheduler) is None
    assert support(AsyncScheduler) is None
    assert "has no update_from_output" in (support(type("Odd", (), {})) or "")
    assert release_of(harness.vllm_version()) is not None
