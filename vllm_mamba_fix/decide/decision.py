"""The correction rules as pure functions of plain integers (no vLLM: tested exhaustively):
:func:`decide` for the split rule, :func:`speculative_stall_release` and the unshifted cut for
the speculative-stall rule; why each exists is its module's header (rules/)."""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from typing import NamedTuple


class Action(enum.Enum):
    UNCHANGED = "unchanged"
    COLLAPSE_PREVENTED = "collapse-prevented"  # stock floored a sub-block chunk to 0
    REALIGNED = "realigned"  # a mid-block chunk would cross the next boundary (a stale state)
    STOPPED_AT_ENCODER_INPUT = "stopped-at-encoder-input"  # at the input, as 0.28+
    # Parked by EAGLE's shifted cut and deferred free, or a warm repeat; ended the 0.33 way.
    SPECULATIVE_STALL_RELEASED = "speculative-stall-released"
    BLOCK_ALIGNED = "block-aligned"  # block-unit: ends off cache_config's floor (vLLM #54076)
    # A waiting request's split answered 0: it let go of its encoder check's references.
    ENCODER_REFERENCES_DROPPED = "encoder-references-dropped"


class Decision(NamedTuple):
    num_tokens: int
    action: Action


def tokens_to_next_boundary(start: int, block_size: int) -> int:
    return block_size - start % block_size


def decide(
    stock_tokens: int,
    num_new_tokens: int,
    start: int,
    block_size: int,
    uncut_stock_tokens: int | None = None,
    tail_frees: bool | None = None,
) -> Decision:
    """Correct vLLM's split answer (``uncut_stock_tokens``: its answer for the chunk asked,
    where the encoder check cut it). An encoder cut ends at the input, as 0.28; not past a
    whole-block answer to a mid-block cut when ``tail_frees`` is False: a chunk ended mid-block
    costs a re-aligned chunk next step (issue 44 item 4)."""
    if num_new_tokens <= 0 or block_size <= 0 or stock_tokens < 0:
        return Decision(stock_tokens, Action.UNCHANGED)
    room = tokens_to_next_boundary(start, block_size)
    mid_block = start % block_size != 0
    # The furthest this chunk may end without breaking the re-align rule.
    limit = min(num_new_tokens, room) if mid_block else num_new_tokens
    upstream = stock_tokens if uncut_stock_tokens is None else min(uncut_stock_tokens, limit)
    if stock_tokens == 0:
        tokens = upstream if upstream > 0 else min(num_new_tokens, room)
        return Decision(tokens, Action.COLLAPSE_PREVENTED)
    if mid_block and stock_tokens > room:
        return Decision(room, Action.REALIGNED)
    if upstream > stock_tokens and not (
        tail_frees is False
        and (start + stock_tokens) % block_size == 0
        and (start + upstream) % block_size != 0
    ):
        return Decision(upstream, Action.STOPPED_AT_ENCODER_INPUT)
    return Decision(stock_tokens, Action.UNCHANGED)


def tail_frees_room(need: int, room: int, own_in_tail: int) -> bool:
    """Whether computing a cut chunk's tail frees the cache room the input at the cut waits for
    (``room``: the slots left while every reference stays)."""
    return room < need <= room + own_in_tail


def can_need_correction(
    stock_tokens: int, num_new_tokens: int, start: int, block_size: int
) -> bool:
    """False: :func:`decide` keeps stock (a full chunk inside its block or from a boundary)."""
    if stock_tokens != num_new_tokens:
        return True
    offset = start % block_size
    return offset != 0 and offset + stock_tokens > block_size


def whole_chunks_may_cross(
    realigns: bool, split_stops_mid_block: bool, split_block: int, cache_block: int
) -> bool:
    """Whether a whole chunk can cross a cache boundary from mid-block: where a re-align rule
    runs and vLLM's split keeps it misaligned (0.15-0.26) or floors in another block."""
    return realigns and (not split_stops_mid_block or split_block != cache_block)


def configured_floor_differs(
    start: int,
    num_new_tokens: int,
    chunk: int,
    configured_block: int,
    absolute_end: bool,
    final: bool,
) -> bool:
    """Whether vLLM's floor to ``configured_block`` ends the chunk elsewhere than ``start +
    chunk`` (the block-unit rule changed it): ``absolute_end``, 0.26+ floor the end and stop a
    mid-block start at the next boundary, 0.15-0.25 the length; ``final``, no floor."""
    if chunk <= 0 or configured_block <= 0:
        return False
    if final:
        configured_end = start + num_new_tokens
    elif not absolute_end:
        configured_end = start + num_new_tokens // configured_block * configured_block
    else:
        configured_end = (start + num_new_tokens) // configured_block * configured_block
    if absolute_end and start % configured_block:
        configured_end = min(
            configured_end, start + tokens_to_next_boundary(start, configured_block)
        )
    return max(configured_end, start) != start + chunk


def in_prefill_by_output_tokens(num_output_tokens: int) -> bool:
    """Prefill gate of vLLM 0.15-0.16: a request with output is never split."""
    return num_output_tokens == 0


def in_prefill_by_position(start: int, num_prompt_tokens: int, num_tokens: int) -> bool:
    """Prefill gate of vLLM 0.17+, which also covers resumed requests."""
    return start < max(num_prompt_tokens, num_tokens - 1)


class StallRelease(NamedTuple):
    stalled: bool
    to_free: tuple[int, ...]  # held inputs the request computed past: 0.33 would have freed them


def speculative_stall_release(
    computed: int, shift: int, held: Mapping[int, tuple[int, int]]
) -> StallRelease:
    """Whether a request that got 0 tokens is parked by its own held inputs (``(offset,
    length)`` each): vLLM 0.24-0.32 cut ``shift`` tokens before an input and free a held one
    only ``shift`` past its end, so one ending within ``computed + shift`` keeps the cache
    full; one ending by ``computed`` is freed now, else the cut drops the shift (as 0.33)."""
    if shift <= 0:
        return StallRelease(False, ())
    ends = {input_id: offset + length for input_id, (offset, length) in held.items()}
    if not any(end <= computed + shift for end in ends.values()):
        return StallRelease(False, ())
    return StallRelease(True, tuple(sorted(i for i, end in ends.items() if end <= computed)))


def unshifted_cut_needed(
    computed: int, shift: int, inputs: Mapping[int, tuple[int, int]], held: Collection[int]
) -> bool:
    """Whether a request that got 0 tokens needs 0.33's unshifted cut: vLLM 0.15-0.32 cut
    ``shift`` tokens before the first input that does not fit, so two uncached inputs within
    ``computed + shift`` cut 0 on every step (a warm repeat: a hit one token before an evicted
    image's end, the next image after it)."""
    reached = [
        i for i, (offset, length) in inputs.items()
        if i not in held and offset <= computed + shift and offset + length > computed
    ]  # fmt: skip
    return shift > 0 and len(reached) >= 2
