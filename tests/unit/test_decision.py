"""The correction rule: one test per rule, an exhaustive sweep, and a property test."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from vllm_mamba_fix.decide.decision import (
    Action,
    Decision,
    can_need_correction,
    decide,
    in_prefill_by_output_tokens,
    in_prefill_by_position,
    tail_frees_room,
    tokens_to_next_boundary,
)

BLOCK = 1056  # Qwen3.5-35B-A3B at TP1


def test_collapse_from_aligned_start_schedules_the_sub_block_chunk() -> None:
    # Image 2 starts 700 tokens in: stock floors 700 to 0 and the request hangs.
    assert decide(0, 700, 2 * BLOCK, BLOCK) == Decision(700, Action.COLLAPSE_PREVENTED)


def test_collapse_from_mid_block_start_stops_at_the_boundary() -> None:
    start = 2 * BLOCK + 100
    assert decide(0, 5000, start, BLOCK) == Decision(BLOCK - 100, Action.COLLAPSE_PREVENTED)


def test_mid_block_chunk_crossing_the_boundary_is_realigned() -> None:
    # 0.15-0.25 keep the length a multiple of the block: 100 + 2 * 1056 crosses two boundaries.
    start = BLOCK + 100
    assert decide(2 * BLOCK, 5000, start, BLOCK) == Decision(BLOCK - 100, Action.REALIGNED)


def test_mid_block_chunk_ending_at_the_boundary_is_left_alone() -> None:
    start = BLOCK + 100
    assert decide(BLOCK - 100, 5000, start, BLOCK) == Decision(BLOCK - 100, Action.UNCHANGED)


def test_aligned_progress_is_left_alone() -> None:
    assert decide(3 * BLOCK, 8192, 0, BLOCK) == Decision(3 * BLOCK, Action.UNCHANGED)


def test_nothing_to_schedule_is_left_alone() -> None:
    assert decide(0, 0, 100, BLOCK) == Decision(0, Action.UNCHANGED)


def test_nonsense_inputs_are_left_alone() -> None:
    assert decide(0, 10, 0, 0).action is Action.UNCHANGED
    assert decide(-1, 10, 0, BLOCK).action is Action.UNCHANGED


def test_encoder_cut_ends_at_the_encoder_input_like_upstream() -> None:
    # Image 2 starts at 12000; stock floors the cut chunk to the boundary at 11616.
    start, n = 7 * BLOCK, 12000 - 7 * BLOCK
    stock, uncut = 11 * BLOCK - start, 12 * BLOCK - start
    expected = Decision(n, Action.STOPPED_AT_ENCODER_INPUT)
    assert decide(stock, n, start, BLOCK, uncut) == expected


def test_encoder_cut_keeps_vllms_own_earlier_stop() -> None:
    # vLLM would stop at 9 blocks (say, the last cacheable position) even uncut.
    start, n = 7 * BLOCK, 12000 - 7 * BLOCK
    stock = 9 * BLOCK - start
    assert decide(stock, n, start, BLOCK, stock) == Decision(stock, Action.UNCHANGED)


def test_encoder_cut_from_mid_block_stops_at_the_boundary() -> None:
    start = 5 * BLOCK + 10
    decision = decide(0, 3000, start, BLOCK, 3 * BLOCK)
    assert decision == Decision(BLOCK - 10, Action.COLLAPSE_PREVENTED)


def test_encoder_cut_to_zero_counts_as_a_prevented_collapse() -> None:
    assert decide(0, 500, 0, BLOCK, BLOCK) == Decision(500, Action.COLLAPSE_PREVENTED)


def test_prefill_gates() -> None:
    assert in_prefill_by_output_tokens(0)
    assert not in_prefill_by_output_tokens(1)
    assert in_prefill_by_position(99, 100, 100)
    assert not in_prefill_by_position(100, 100, 100)
    # A resumed request replays its output: prefill runs to num_tokens - 1.
    assert in_prefill_by_position(150, 100, 160)
    assert not in_prefill_by_position(159, 100, 160)


def test_tokens_to_next_boundary() -> None:
    assert tokens_to_next_boundary(0, 16) == 16
    assert tokens_to_next_boundary(5, 16) == 11
    assert tokens_to_next_boundary(16, 16) == 16


def _check(stock: int, n: int, start: int, block: int, uncut: int | None) -> None:
    """Invariants computed independently of the implementation (for a prefill chunk: the
    caller asks decide() in prefill only)."""
    tokens, action = decide(stock, n, start, block, uncut)
    room = block - start % block
    assert 0 <= tokens <= n
    if not can_need_correction(stock, n, start, block):
        assert (tokens, action) == (stock, Action.UNCHANGED)  # the wrapper's fast path is exact
    # Never hang: a prefill chunk with tokens to give makes progress.
    assert tokens > 0 or n == 0
    # Never poison: a chunk starting mid-block does not run past the boundary.
    if start % block:
        assert tokens <= room
    respects_boundary = start % block == 0 or stock <= room
    if stock > 0 and respects_boundary:
        if uncut is None:
            # Minimal: progress that respects the boundary is kept.
            assert (tokens, action) == (stock, Action.UNCHANGED)
        else:
            # Upstream order: vLLM's own stops first, then the encoder cut.
            furthest = min(n, room) if start % block else n
            assert tokens == max(stock, min(uncut, furthest))
    if stock > 0 and not respects_boundary:
        assert (tokens, action) == (room, Action.REALIGNED)
    if stock == 0 and n > 0:
        assert action is Action.COLLAPSE_PREVENTED
    if action is Action.UNCHANGED:
        assert tokens == stock


def test_exhaustive_small_grid() -> None:
    for block, start, n in itertools.product(range(1, 9), range(0, 25), range(0, 20)):
        uncut_values = (None, *range(0, n + 2 * block))
        for stock, uncut in itertools.product(range(0, n + 1), uncut_values):
            _check(stock, n, start, block, uncut)


@given(
    block=st.integers(1, 4096),
    start=st.integers(0, 1 << 20),
    n=st.integers(0, 1 << 16),
    stock_fraction=st.floats(0, 1),
    uncut=st.none() | st.integers(0, 1 << 17),
)
def test_invariants_hold_for_realistic_sizes(
    block: int, start: int, n: int, stock_fraction: float, uncut: int | None
) -> None:
    _check(int(n * stock_fraction), n, start, block, uncut)


# Issue 44 item 4: the encoder stop past a whole-block answer (tests/properties/test_regressions.py,
# WHOLE_BLOCK_KEPT_BEFORE_ANOTHERS_IMAGE and SELF_HELD_TAIL for the real scheduler).


def test_a_whole_block_is_kept_where_the_tail_frees_nothing_the_cut_input_needs() -> None:
    # Block 16, a 41-token chunk cut at an image at 17: stock floors to [0, 16).
    assert decide(16, 17, 0, 16, 32, tail_frees=False) == Decision(16, Action.UNCHANGED)
    # Unknown (the wrapper as it is) and a tail that frees the room: 0.28's [0, 17).
    for tail in (None, True):
        decision = decide(16, 17, 0, 16, 32, tail_frees=tail)
        assert decision == Decision(17, Action.STOPPED_AT_ENCODER_INPUT)


def test_a_stop_on_a_boundary_or_after_a_zero_is_kept_whatever_the_tail() -> None:
    # The cut on a boundary: whole blocks either way, the longer chunk is kept.
    assert decide(16, 32, 0, 16, 48, tail_frees=False).num_tokens == 32
    # Stock's 0: the collapse is prevented as before (a 0 may never clear).
    assert decide(0, 1, 16, 16, 32, tail_frees=False).num_tokens == 1
    # A mid-block start: stock's answer ends on the boundary and the limit is that boundary.
    assert decide(15, 15, 17, 16, 31, tail_frees=False).num_tokens == 15


def test_tail_frees_room() -> None:
    assert tail_frees_room(need=20, room=10, own_in_tail=20)  # issue 2: its own image holds it
    assert not tail_frees_room(need=20, room=25, own_in_tail=20)  # fits now: the step's budget
    assert not tail_frees_room(need=33, room=-13, own_in_tail=29)  # another request holds it
    assert not tail_frees_room(need=20, room=10, own_in_tail=0)  # nothing of its own in the tail


def test_exhaustive_small_grid_with_the_tail_known() -> None:
    for block, start, n in itertools.product(range(1, 7), range(0, 14), range(0, 14)):
        for stock, uncut, tail in itertools.product(
            range(0, n + 1), range(0, n + 2 * block), (True, False)
        ):
            tokens, action = decide(stock, n, start, block, uncut, tail_frees=tail)
            base = decide(stock, n, start, block, uncut)
            kept = (
                not tail and stock > 0 and (start + stock) % block == 0
                and base.action is Action.STOPPED_AT_ENCODER_INPUT
                and (start + base.num_tokens) % block != 0
            )  # fmt: skip
            assert (tokens, action) == ((stock, Action.UNCHANGED) if kept else base)
            assert tokens > 0 or n == 0  # never hang
