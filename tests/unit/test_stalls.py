"""The speculative-stall rule and the zero-streak bookkeeping, as pure functions."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vllm_mamba_fix.decide.decision import speculative_stall_release
from vllm_mamba_fix.decide.stalls import (
    REPEATED,
    WATCHDOG_MIN_STEPS,
    StallCause,
    StallReport,
    stall_cause,
    watchdog_due,
)
from vllm_mamba_fix.rules.zero_streaks import ZeroStreaks


def test_release_on_the_two_stall_shapes() -> None:
    # Images [5, 11849) and [11850, ...) (gap 1), shift 1: parked at 11849,
    # image 1 computed but its free deferred to 11850.
    assert speculative_stall_release(11849, 1, {0: (5, 11844)}) == (True, (0,))
    # Gap 0: parked at 11848, one token of image 1 left behind the shifted cut.
    assert speculative_stall_release(11848, 1, {0: (5, 11844)}) == (True, ())
    # Gap 2: vLLM freed image 1 itself at 11850; nothing held, no stall.
    assert speculative_stall_release(11850, 1, {}) == (False, ())
    # Without speculation there is no shift and no such stall.
    assert speculative_stall_release(11849, 0, {0: (5, 11844)}) == (False, ())


@given(
    computed=st.integers(0, 5000),
    shift=st.integers(0, 4),
    held=st.dictionaries(
        st.integers(0, 5), st.tuples(st.integers(0, 5000), st.integers(1, 3000)), max_size=4
    ),
)
def test_release_matches_its_definition(
    computed: int, shift: int, held: dict[int, tuple[int, int]]
) -> None:
    stalled, to_free = speculative_stall_release(computed, shift, held)
    ends = {i: o + n for i, (o, n) in held.items()}
    assert stalled == (shift > 0 and any(e <= computed + shift for e in ends.values()))
    # Only what 0.33 frees (its end is computed) is freed, and only in a stall.
    assert set(to_free) == ({i for i, e in ends.items() if e <= computed} if stalled else set())
    assert list(to_free) == sorted(to_free)


def test_streaks_count_repeats_at_one_position() -> None:
    streaks = ZeroStreaks()
    assert not streaks.by_request
    first, moved = streaks.zero("r", 100, 0.0)
    assert (first.steps, moved) == (1, None)
    again, _ = streaks.zero("r", 100, 5.0)
    assert again.steps == REPEATED and again.since == 0.0
    elsewhere, moved = streaks.zero("r", 200, 6.0)
    assert elsewhere.steps == 1 and moved is not None and moved.position == 100
    assert "r" in streaks.by_request and streaks.clear("r") is elsewhere
    assert "r" not in streaks.by_request


def test_streaks_are_bounded() -> None:
    streaks = ZeroStreaks(capacity=3)
    for i in range(10):
        streaks.zero(f"r{i}", 0, 0.0)
    assert list(streaks.by_request) == ["r7", "r8", "r9"]


@given(steps=st.integers(1, 10), elapsed=st.floats(0, 100), seconds=st.floats(0, 100))
def test_watchdog_needs_both_steps_and_time(steps: int, elapsed: float, seconds: float) -> None:
    streaks = ZeroStreaks()
    for i in range(steps):
        streak, _ = streaks.zero("r", 7, 0.0 if i == 0 else elapsed)
    assert watchdog_due(streak, elapsed, seconds) == (
        steps >= WATCHDOG_MIN_STEPS and elapsed >= seconds
    )
    streak.warned = True
    assert not watchdog_due(streak, elapsed, seconds)


def test_stall_causes() -> None:
    assert stall_cause(True, 500, 1000, 1000) is StallCause.SPECULATIVE_LOOKAHEAD
    assert stall_cause(True, 2000, 1000, 4000) is StallCause.INPUT_TOO_LARGE
    assert stall_cause(False, 2000, 4000, 1000) is StallCause.INPUT_TOO_LARGE
    assert stall_cause(False, 500, 1000, 1000) is StallCause.UNKNOWN
    assert stall_cause(False, None, 1000, 1000) is StallCause.UNKNOWN


def test_report_names_every_field() -> None:
    report = StallReport(
        "req-7", 11848, 23893, 4, 31.2, ((5, 11844),), (11849, 11844, 11844), 16384, 4540,
        16384, StallCause.SPECULATIVE_LOOKAHEAD,
    )  # fmt: skip
    text = report.message()
    for needle in (
        "request req-7 stalled at token 11848 of 23893",
        "0 tokens on 4 consecutive steps over 31 s",
        "holds encoder inputs [5, 11849)",
        "waits for [11849, 23693) (11844 encoder tokens)",
        "encoder cache 16384 tokens (4540 free)",
        "likely cause: EAGLE-type speculative decoding",
        "remedy: upgrade to vLLM 0.33+, or put two or more tokens between images",
    ):
        assert needle in text, needle
