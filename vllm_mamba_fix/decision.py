"""The correction rule, as a pure function of plain integers.

No vLLM import here: everything the rule needs is passed in as numbers, so it
can be tested exhaustively without a scheduler.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class Action(enum.Enum):
    """What the wrapper did to the stock result."""

    UNCHANGED = "unchanged"
    # Stock floored a sub-block chunk to 0; the request would never progress.
    COLLAPSE_PREVENTED = "collapse-prevented"
    # The chunk started mid-block and would have crossed the next boundary,
    # caching a block whose Mamba state belongs to an earlier position.
    REALIGNED = "realigned"


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
    in_prefill: bool,
) -> Decision:
    """Correct the stock result of ``_mamba_block_aligned_split``.

    ``stock_tokens`` is what vLLM's method returned for a chunk of at most
    ``num_new_tokens`` tokens starting at ``start`` (computed tokens so far).

    - Collapse: stock returned 0 for a prefill chunk that had tokens to give.
      Schedule what fits before the next boundary, so the request progresses.
    - Re-align: a prefill chunk starting mid-block stops at the next boundary,
      so the block there is cached with the state that belongs to it.
    """
    if not in_prefill or num_new_tokens <= 0 or block_size <= 0 or stock_tokens < 0:
        return Decision(stock_tokens, Action.UNCHANGED)
    room = tokens_to_next_boundary(start, block_size)
    if stock_tokens == 0:
        return Decision(min(num_new_tokens, room), Action.COLLAPSE_PREVENTED)
    if start % block_size and stock_tokens > room:
        return Decision(room, Action.REALIGNED)
    return Decision(stock_tokens, Action.UNCHANGED)


def in_prefill_by_output_tokens(num_output_tokens: int) -> bool:
    """Prefill gate of vLLM 0.15-0.16: a request with output is never split."""
    return num_output_tokens == 0


def in_prefill_by_position(start: int, num_prompt_tokens: int, num_tokens: int) -> bool:
    """Prefill gate of vLLM 0.17+, which also covers resumed requests."""
    return start < max(num_prompt_tokens, num_tokens - 1)
