"""Issue 35 item 3 on the real scheduler: the watchdog hears every request that stops, and
ends one request of a hold across requests, never one that waits for token budget.

The mutual hold: each request holds its first image in the encoder cache while it waits
for space for its second, which the others' first images take (stock 0.15-0.27 floor the
cut before it to 0 for good). Its own images fit the cache, so only the proof across
requests can end it: every request holding the space it needs is a named stall too.

Time is a clock the test advances 5 s per engine step (tests/stall_end_helpers.py); the
watchdog names at 30 s and the stall end acts 30 s after the naming.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.stall_end_helpers import (
    Clock,
    Finish,
    assert_pools_clean,
    capture_finishes,
    count_samples,
    ended,
    install_clock,
    update_wrapped,
)
from tools import sched_harness as harness
from tools.release_facts import facts_for
from tools.scenarios import image_request
from tools.sched_harness import HarnessConfig, Mode, RequestSpec
from vllm_mamba_fix.facts.versions import Family
from vllm_mamba_fix.observe import counters

STEP_SECONDS = 5.0
BOUND = 30.0
ENV = {"VLLM_MAMBA_FIX_STALL_SECONDS": "30", "VLLM_MAMBA_FIX_END_STALLS_AFTER": str(BOUND)}

HOLD_CONFIG = HarnessConfig(
    block_size=64, max_num_batched_tokens=256, long_prefill_token_threshold=128,
    encoder_cache_tokens=1000, encoder_compute_tokens=1000, max_model_len=4096,
)  # fmt: skip
# text 10, image 400, text 2, image 400, text 20: 832 tokens, images [10, 410), [412, 812).
PROMPT = 832
STOCK_STOP = 384  # 3 chunks of 128; the cut before 412 floors to 0


def _holders(n: int) -> tuple[RequestSpec, ...]:
    return tuple(image_request(f"hold{i}", (10, 2, 20), image_tokens=400) for i in range(n))


def _drive(
    h: harness.Harness, clock: Clock | None, behind: tuple[RequestSpec, ...] = (),
    max_steps: int = 120,
) -> None:  # fmt: skip
    """Step (``behind`` added after the first step) until every request finished."""
    h.step()
    if clock is not None:
        clock.advance(STEP_SECONDS)
    h.add(*behind)
    while len(h.finished) < len(h.requests) and h.step_index < max_steps:
        h.advance()
        if clock is not None:
            clock.advance(STEP_SECONDS)


def _watchdog_seconds() -> float | None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_mamba_fix.facts.targets import MARKER, UPDATE_METHOD

    options = getattr(getattr(Scheduler, UPDATE_METHOD, None), MARKER, None)
    return getattr(options, "stall_seconds", None)


def _needs_the_hold(family: Family) -> None:
    if not facts_for(family).image_deadlock:
        pytest.skip(f"family {family.name}: the split runs before the encoder cut, no hold")


def _named(vllm_log: list[str], rid: str) -> list[str]:
    return [m for m in vllm_log if f"request {rid} stalled at token" in m]


def _ended_lines(vllm_log: list[str]) -> list[str]:
    return [m for m in vllm_log if m.startswith("vllm-mamba-fix: ended request")]


def _completed(finishes: dict[str, Finish]) -> set[str]:
    from vllm.v1.engine import FinishReason

    return {rid for rid, f in finishes.items() if f.finish_reason == FinishReason.LENGTH}


def _harness(family: Family, cfg: Any) -> harness.Harness:
    """The harness, or a skip where the release rejects the configuration (0.17 asserts
    ``long_prefill_token_threshold`` against the block in ``VllmConfig``)."""
    try:
        return harness.Harness(cfg)
    except (ValueError, harness.ModeUnsupported) as exc:
        pytest.skip(f"vLLM {family.name} rejects this configuration: {exc}")


@pytest.mark.parametrize("n", [2, 3])
def test_stock_stops_in_the_mutual_hold(family: Family, sched_mode: Mode, n: int) -> None:
    """The premise: stock stops every running request at 384 of 832 for good, and the third
    is never admitted."""
    _needs_the_hold(family)
    h = _harness(family, sched_mode.apply(HOLD_CONFIG))
    h.add(*_holders(n))
    result = h.run(max_steps=100)
    assert not result.finished
    stops = sorted(result.stall_at.values(), reverse=True)
    assert stops[:2] == [STOCK_STOP, STOCK_STOP] and set(stops[2:]) <= {0}, result.stall_at


@pytest.mark.parametrize("n", [2, 3])
def test_mutual_hold_is_named_and_one_request_ended(
    family: Family, sched_mode: Mode, load_plugin: Any, vllm_log: list[str],
    monkeypatch: pytest.MonkeyPatch, n: int,
) -> None:  # fmt: skip
    """The split rule off: every stopped request is named, exactly one is ended with its
    cause, and the others complete."""
    _needs_the_hold(family)
    clock = install_clock(monkeypatch)
    load_plugin(**ENV, VLLM_MAMBA_FIX_SPLIT_RULE="0")
    if _watchdog_seconds() is None:
        pytest.skip("the plugin runs no watchdog with the split rule off on this release")
    with update_wrapped(BOUND):
        h = _harness(family, sched_mode.apply(HOLD_CONFIG))
        finishes = capture_finishes(h.scheduler)
        h.add(*_holders(n))
        _drive(h, clock)
    rids = set(h.requests)
    for rid in sorted(rids):
        assert _named(vllm_log, rid), (rid, vllm_log)
    assert len(ended(finishes)) == 1, finishes
    (victim,) = ended(finishes)
    reason = finishes[victim].stop_reason
    for needle in ("likely cause:", "remedy:", "a deadlock across requests"):
        assert needle in reason, (needle, reason)
    assert _completed(finishes) == rids - {victim}, finishes
    assert_pools_clean(h.scheduler)
    assert counters.stats()["stalls_ended"] == 1
    (line,) = _ended_lines(vllm_log)
    assert f"ended request {victim}: 0 tokens at token {STOCK_STOP} of {PROMPT}" in line


def _stock_split_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    """The split rule stays registered and on, its pure decision neutralised: stock's answer,
    unchanged. A stop the rule believes it handles."""
    from vllm_mamba_fix.decide.decision import Action, Decision
    from vllm_mamba_fix.rules import split_rule

    def stock_answer(stock: int, *args: Any, **kwargs: Any) -> Decision:
        return Decision(stock, Action.UNCHANGED)

    monkeypatch.setattr(split_rule, "decide", stock_answer)


def test_stop_the_split_rule_believes_it_handles_is_named(
    family: Family, sched_mode: Mode, load_plugin: Any, vllm_log: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The split rule on (its decision neutralised): the requests it leaves in the mutual
    hold are named. Not ended: with the rule on, a chunk that stops at the next input is
    not floored, so no input proves the hold (the rule's own window), and the watchdog ends
    nothing it cannot prove."""
    _needs_the_hold(family)
    clock = install_clock(monkeypatch)
    _stock_split_decision(monkeypatch)
    assert load_plugin(**ENV), "the split rule is not installed"
    assert _watchdog_seconds() is not None
    with update_wrapped(BOUND):
        h = _harness(family, sched_mode.apply(HOLD_CONFIG))
        finishes = capture_finishes(h.scheduler)
        h.add(*_holders(2))
        _drive(h, clock, max_steps=60)
    assert not h.finished, "the neutralised rule let the hold complete"
    for rid in h.requests:
        (line,) = _named(vllm_log, rid)
        assert f"stalled at token {STOCK_STOP} of {PROMPT}" in line, line
        assert "other requests' inputs hold the space it needs" in line, line
    assert not ended(finishes) and not _ended_lines(vllm_log)


# Budget starved behind long prefills (tests/properties/test_regressions.py): an image
# request that gets a sub-block remainder of the budget while a long text prefills, and two
# images that never fit the cache together behind a 6,000-token prefill (which only the
# split rule completes).
STARVED_CONFIG = HarnessConfig(block_size=256, max_num_batched_tokens=300, max_model_len=8192)
BUDGET_WAIT = (
    (RequestSpec("long-text", 3000),),
    (RequestSpec("image", 700, ((50, 200),)),),
    200,
)
BEHIND_A_PREFILL = (
    (RequestSpec("long-text", 6000),),
    (RequestSpec("two-images", 700, ((50, 100), (160, 120))),),
    120,
)
# Starved of budget and of cache space by a request that moves: "holder" prefills through a
# 2,000-token image (the cache keeps it all the while), "image" needs 400 of the 200 left.
HELD_BY_A_MOVER = (
    (RequestSpec("holder", 2600, ((10, 2000),)),),
    (RequestSpec("image", 700, ((50, 400),)),),
    2200,
)


@pytest.mark.parametrize(
    ("shape", "split_rule"),
    [
        (BUDGET_WAIT, "1"),
        (BUDGET_WAIT, "0"),
        (BEHIND_A_PREFILL, "1"),
        (HELD_BY_A_MOVER, "1"),
        (HELD_BY_A_MOVER, "0"),
    ],
    ids=[
        "budget-wait-rule-on",
        "budget-wait-rule-off",
        "behind-a-prefill-rule-on",
        "held-by-a-mover-rule-on",
        "held-by-a-mover-rule-off",
    ],
)
def test_budget_starved_request_is_never_ended(
    family: Family, sched_mode: Mode, load_plugin: Any, vllm_log: list[str],
    monkeypatch: pytest.MonkeyPatch, shape: Any, split_rule: str,
) -> None:  # fmt: skip
    """Never named, never ended: the requests complete. The clock moves 100 s on every
    reading, so every bound is past at once (the most eager the stall end can be), and the
    watchdog samples every step."""
    import dataclasses

    from vllm_mamba_fix.rules import stall_watch

    first, behind, cache = shape
    load_plugin(**ENV, VLLM_MAMBA_FIX_SPLIT_RULE=split_rule)
    if _watchdog_seconds() is None:
        pytest.skip("the plugin runs no watchdog with the split rule off on this release")
    if split_rule == "1" and not harness.split_rule_installed():
        pytest.skip("no split rule on this release")
    monkeypatch.setattr(stall_watch, "clock", Clock(per_call=100.0))
    cfg = dataclasses.replace(STARVED_CONFIG, encoder_cache_tokens=cache,
                              encoder_compute_tokens=cache)  # fmt: skip
    with update_wrapped(BOUND):
        h = _harness(family, sched_mode.apply(cfg))
        finishes = capture_finishes(h.scheduler)
        h.add(*first)
        _drive(h, None, behind, max_steps=200)
    starved = behind[0].request_id
    # A wait is not a stop: the steps it got 0 tokens in left less than a block of budget,
    # so the watchdog's look counts none of them (issue 44; before, every split 0 was heard
    # and the starved request named).
    assert not _named(vllm_log, starved), _named(vllm_log, starved)
    assert not ended(finishes) and not _ended_lines(vllm_log), finishes
    assert _completed(finishes) == set(h.requests), (finishes, h.result().stall_at)


def _calls_into_the_watchdog() -> tuple[list[str], list[str]]:
    """Every call of a function of rules/stall_watch.py or rules/stall_look.py from now until
    the profile is removed: (callers that are the update wrapper, callers inside the split or
    the encoder check). Returned lists fill as the scheduler runs."""
    import sys
    from pathlib import Path

    from vllm_mamba_fix.rules import encoder_wrapper, stall_end, stall_look, stall_watch, wrappers

    watch = {stall_watch.__file__, stall_look.__file__}
    inside = {wrappers.__file__, encoder_wrapper.__file__}
    carrier = stall_end.__file__
    from_update: list[str] = []
    from_inside: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or frame.f_code.co_filename not in watch:
            return
        caller = frame.f_back
        while caller is not None and caller.f_code.co_filename in watch:
            caller = caller.f_back
        outer = frame.f_back
        while outer is not None:
            if outer.f_code.co_filename in inside:
                from_inside.append(f"{Path(outer.f_code.co_filename).name}:{frame.f_code.co_name}")
                return
            outer = outer.f_back
        if caller is not None and caller.f_code.co_filename == carrier:
            from_update.append(frame.f_code.co_name)

    sys.setprofile(profile)
    return from_update, from_inside


@pytest.mark.parametrize("split_rule", ["0", "1"])
def test_the_split_and_the_encoder_check_call_nothing_of_the_watchdog(
    family: Family, sched_mode: Mode, load_plugin: Any, vllm_log: list[str],
    monkeypatch: pytest.MonkeyPatch, split_rule: str,
) -> None:  # fmt: skip
    """Issue 44: nothing of the watchdog runs inside the split or the encoder check; it looks
    once per step from update_from_output, and still names the mutual hold."""
    import sys

    _needs_the_hold(family)
    clock = install_clock(monkeypatch)
    if split_rule == "1":
        _stock_split_decision(monkeypatch)
    load_plugin(**ENV, VLLM_MAMBA_FIX_SPLIT_RULE=split_rule)
    if _watchdog_seconds() is None:
        pytest.skip("the plugin runs no watchdog on this release")
    with update_wrapped(BOUND):
        h = _harness(family, sched_mode.apply(HOLD_CONFIG))
        h.add(*_holders(2))
        from_update, from_inside = _calls_into_the_watchdog()
        try:
            _drive(h, clock, max_steps=60)
        finally:
            sys.setprofile(None)
    assert not from_inside, sorted(set(from_inside))
    assert "observe" in from_update, sorted(set(from_update))
    for rid in h.requests:
        assert _named(vllm_log, rid), (rid, vllm_log)


def test_the_watchdog_samples_at_most_once_a_second(
    family: Family, sched_mode: Mode, load_plugin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cost bound on the real scheduler: a clock that moves 0.1 s per read, 30 steps of
    the mutual hold (a stop in every step): one read per step, at most 4 samples."""
    from vllm_mamba_fix.rules import stall_watch

    _needs_the_hold(family)
    clock = install_clock(monkeypatch, per_call=0.1)
    reads = 0
    read = clock.__call__

    def counted_clock() -> float:
        nonlocal reads
        reads += 1
        return read()

    monkeypatch.setattr(stall_watch, "clock", counted_clock)
    samples = count_samples(monkeypatch)
    load_plugin(**ENV, VLLM_MAMBA_FIX_SPLIT_RULE="0")
    if _watchdog_seconds() is None:
        pytest.skip("the plugin runs no watchdog with the split rule off on this release")
    with update_wrapped(BOUND):
        h = _harness(family, sched_mode.apply(HOLD_CONFIG))
        h.add(*_holders(2))
        for _ in range(30):
            h.step()
    assert 25 <= reads <= 30, reads  # one per update_from_output (async: one fewer at first)
    assert 1 <= len(samples) <= 4, samples
