"""The correction rules, as pure functions of plain integers.

No vLLM import here: everything a rule needs is passed in as numbers, so it
can be tested exhaustively without a scheduler.

- :func:`decide` (the split rule): through 0.27.1 vLLM budgets encoder inputs
  before the Mamba split, so a chunk cut short before an image is floored to 0
  and the request never moves. Upstream moved the split first in 0.28.0
  (vLLM #51603); the rule is needed there only under a scheduler whose own
  ``schedule()`` keeps the old order. Blocks are the cache's
  (:mod:`vllm_mamba_fix.facts.blocks`).
- :func:`speculative_stall_release` and the unshifted cut (the speculative-stall
  rule): from 0.24.0 vLLM frees an encoder input only past the drafter's
  look-ahead (vLLM #46315) and cuts before an input by that shift; 0.33.0 does
  neither, so the rule stops being needed there.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from typing import NamedTuple


class Action(enum.Enum):
    """What the wrapper did to the stock result."""

    UNCHANGED = "unchanged"
    # Stock floored a sub-block chunk to 0; the request would never progress.
    COLLAPSE_PREVENTED = "collapse-prevented"
    # The chunk started mid-block and would have crossed the next boundary,
    # caching a block whose Mamba state belongs to an earlier position.
    REALIGNED = "realigned"
    # Stock floored a chunk cut short at an encoder input; upstream (0.28+)
    # ends it at that input, saving a step.
    STOPPED_AT_ENCODER_INPUT = "stopped-at-encoder-input"
    # EAGLE-type speculation parked the request at an encoder input it holds
    # itself (shifted cut, deferred free), or at two it must encode within the
    # shift (a warm repeat); ended the 0.33 way.
    SPECULATIVE_STALL_RELEASED = "speculative-stall-released"
    # The block-unit rule: vLLM's split, asked with the cache's block, ended the
    # chunk elsewhere than with cache_config.block_size (vLLM #54076).
    BLOCK_ALIGNED = "block-aligned"
    # A waiting request whose split answered 0 let go of the cached encoder inputs its
    # encoder check took a reference on (0.28 splits first and takes none).
    ENCODER_REFERENCES_DROPPED = "encoder-references-dropped"


class Decision(NamedTuple):
    num_tokens: int
    action: Action


def tokens_to_next_boundary(start: int, block_size: int) -> int:
    """Tokens from ``start`` up to and including the next block boundary."""
    return block_size - start % block_size


def decide(
    stock_tokens: int,
    num_new_tokens: int,
    start: int,
    block_size: int,
    uncut_stock_tokens: int | None = None,
    tail_frees: bool | None = None,
) -> Decision:
    """Correct the stock result of ``_mamba_block_aligned_split``.

    Only for a prefill chunk: the caller asks it in prefill (as each release defines it).

    ``stock_tokens`` is what vLLM's method returned for a chunk of at most
    ``num_new_tokens`` tokens starting at ``start`` (computed tokens so far).
    ``uncut_stock_tokens`` is given when the chunk was cut short at the start
    of an encoder input that could not be scheduled: what vLLM returns for the
    chunk extended past the next boundary after that cut (its own stops kept).

    - Collapse: stock returned 0 for a prefill chunk that had tokens to give.
      Schedule what fits, so the request progresses.
    - Re-align: a prefill chunk starting mid-block ends at or before the next
      boundary, so the block there is cached with the state that belongs to it.
    - Encoder stop: a chunk cut at an encoder input ends at that input, as it
      does upstream, where the split runs before encoder budgeting. Not past a
      whole-block answer to a mid-block cut when ``tail_frees`` is False (the tail
      frees none of the room the input at the cut waits for, :func:`tail_frees_room`):
      that input waits on another request or the step's encoder budget, which may
      clear by the next step, and a chunk ended mid-block costs a re-aligned chunk
      then (issue 44 item 4). ``None`` (not known): the encoder stop, as 0.28.
    """
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
    """Whether computing a cut chunk's tail (past the split's whole-block answer, up to the
    encoder input at the cut) frees the encoder-cache room that input waits for.

    ``need``: the input's encoder tokens; ``room``: the cache's slots left to it once every
    input another request references and every input of its own stays (free and freeable
    slots alike); ``own_in_tail``: the slots of its own inputs that end inside the tail,
    freed once it is computed. True only where the input does not fit now and fits once the
    tail's inputs are freed: the request waits on itself (issue 2's two images in a block),
    and only the encoder stop moves it. Else the input fits already (the step's encoder
    budget kept it out, spent anew next step) or waits on another request either way.
    """
    return room < need <= room + own_in_tail


def can_need_correction(
    stock_tokens: int, num_new_tokens: int, start: int, block_size: int
) -> bool:
    """False when :func:`decide` keeps the stock result whatever else holds.

    The wrapper's fast path: a full chunk that stays inside its block or starts
    on a boundary (every decode step and most prefill chunks).
    """
    return stock_tokens != num_new_tokens or crosses_next_boundary(start, stock_tokens, block_size)


def whole_chunks_may_cross(
    realigns: bool, split_stops_mid_block: bool, split_block: int, cache_block: int
) -> bool:
    """Whether a chunk vLLM's split returns whole can cross a cache boundary from mid-block,
    so that the re-align rule must look at every whole chunk.

    Never where no re-align rule runs (``realigns``). Else only where vLLM's split keeps a
    mid-block start misaligned (0.15-0.26), or stops it at the boundaries of another block
    than the cache's (``split_block``: the block its answer is floored in).
    """
    return realigns and (not split_stops_mid_block or split_block != cache_block)


def crosses_next_boundary(start: int, tokens: int, block_size: int) -> bool:
    """Whether ``tokens`` from a mid-block ``start`` pass the next boundary (a chunk the
    re-align rule stops there)."""
    offset = start % block_size
    return offset != 0 and offset + tokens > block_size


def configured_floor_differs(
    start: int,
    num_new_tokens: int,
    chunk: int,
    configured_block: int,
    absolute_end: bool,
    final: bool,
) -> bool:
    """Whether vLLM's floor to ``configured_block`` ends ``[start, start + num_new_tokens)``
    elsewhere than ``start + chunk``: a chunk the block-unit rule changed.

    By arithmetic, not by asking vLLM again: the other stops of the split are the same in
    both blocks. ``absolute_end``: 0.26+ floor the chunk's end and stop a mid-block start
    at the next boundary; 0.15-0.25 floor its length. ``final``: the chunk reaches the end
    of prefill, which no release floors.
    """
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
    # Held inputs the request has computed past: 0.33 would have freed them.
    to_free: tuple[int, ...]


def speculative_stall_release(
    computed: int, shift: int, held: Mapping[int, tuple[int, int]]
) -> StallRelease:
    """Whether a request that got 0 tokens is parked by its own encoder input.

    ``held`` maps the ids of the request's inputs in the encoder cache to their
    placeholder ``(offset, length)``; ``shift`` is the drafter's look-ahead that
    vLLM subtracts at an encoder cut (0 without EAGLE-type speculation).

    Under speculation vLLM 0.24-0.32 cut a chunk ``shift`` tokens before an
    input it cannot schedule, and free a held input only ``shift`` tokens after
    its end. A held input that ends within ``computed + shift`` therefore keeps
    the cache full for the input that is next, and neither moves again:

    - it ends at or before ``computed``: only the deferred free holds it, so
      free it now (0.33 frees it there);
    - it ends after ``computed``: the shifted cut keeps the request from
      computing its last tokens, so cut without the shift (0.33's cut).
    """
    if shift <= 0:
        return StallRelease(False, ())
    ends = {input_id: offset + length for input_id, (offset, length) in held.items()}
    if not any(end <= computed + shift for end in ends.values()):
        return StallRelease(False, ())
    return StallRelease(True, tuple(sorted(i for i, end in ends.items() if end <= computed)))


def unshifted_cut_needed(
    computed: int,
    shift: int,
    inputs: Mapping[int, tuple[int, int]],
    held: Collection[int],
) -> bool:
    """Whether a request that got 0 tokens at ``computed`` needs 0.33's unshifted cut.

    ``inputs`` maps the ids of all the request's encoder inputs to their
    placeholder ``(offset, length)``; ``held`` are the ids it has in the encoder
    cache; ``shift`` is as in :func:`speculative_stall_release`.

    vLLM 0.15-0.32 budget the inputs up to ``shift`` tokens past the chunk and
    cut the chunk ``shift`` tokens before the first one that does not fit. When
    two inputs that are not cached lie within ``computed + shift``, the second
    starts after ``computed`` and, if the cache cannot hold both, the cut is 0
    on every step, with nothing held. A warm repeat lands there: a prefix hit
    one token before the end of an evicted image, the next image right after it.
    Without the shift the cut is the tokens up to that second input, at least 1.
    """
    if shift <= 0:
        return False
    reached = 0
    for input_id, (offset, length) in inputs.items():
        if input_id not in held and offset <= computed + shift and offset + length > computed:
            reached += 1
    return reached >= 2
