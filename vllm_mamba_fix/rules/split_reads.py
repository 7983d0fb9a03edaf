"""What the split rule reads beyond one call's numbers, kept out of its module: of the split
method when it is wrapped (its known parameters, the scope's test), and of the scheduler on the
rule's slow path (issue 44 item 4, docs/reliability.md "Steps against stock and 0.28"):

- the references a waiting request's encoder check took where its split answers 0: dropped,
  as 0.28 (which splits first) never takes them;
- a token budget's sub-block remainder from the last cacheable boundary under EAGLE on
  0.15-0.26: it waits, as 0.28 floors it.

The third such answer, whether an encoder stop's tail frees its input's room, is
``split_rule.tail_frees_room_at``: a corrected call enters at most four package files. No
vLLM import; the scheduler and request are vLLM's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from vllm_mamba_fix.facts.targets import KNOWN_SPLIT_TRAILING_PARAMETERS, SPLIT_LEADING_PARAMETERS


def eagle_remainder_waits(call: Any, start: int) -> bool:
    """Whether a token budget's sub-block remainder from the last cacheable boundary under
    EAGLE waits for a step that gives a block, as 0.28 floors it (0.15-0.26 only).

    Those releases back the last cacheable position off a block under EAGLE
    (``last_cache_position - block_size``) and leave a chunk from there unfloored: [96, 101)
    of a 153-token prompt in block 48. Its next chunk crosses 144 from mid-block (vLLM
    #51113), which the re-align splits at a step's cost; 0.28 answers 0 there and takes the
    block next step. Only where a step can give a block (budget and threshold at least one)
    and the token budget, not an encoder input, cut the chunk."""
    request, size, answer = call.request, call.state.size, call.answer
    if answer >= size or start % size or getattr(call.scheduler, "use_eagle", False) is not True:
        return False
    tokens = request.num_tokens
    last = max(tokens - tokens % size - size, 0)
    prefill_end = max(request.num_prompt_tokens, tokens - 1)
    if start != last or start + size >= prefill_end:
        return False
    # An input at the chunk's end (or one look-ahead token past it): the encoder check may
    # have cut it, and 0.28's order may give that chunk; read from positions, not from the
    # encoder note (the split rule's), and erring towards leaving the chunk as it is.
    end = start + answer
    if any(end <= f.mm_position.offset <= end + 1 for f in request.mm_features or ()):
        return False
    # A step can give a block: read here, not through facts.blocks.longest_chunk (one file
    # fewer on a corrected call), the same budget and threshold.
    scheduler = call.scheduler
    budget = getattr(scheduler, "max_num_scheduled_tokens", None)
    threshold = getattr(
        getattr(scheduler, "scheduler_config", None), "long_prefill_token_threshold", 0
    )
    limits = [x for x in (budget, threshold) if isinstance(x, int) and x > 0]
    return bool(limits) and size <= min(limits)


def drop_waiting_references(scheduler: Any, request: Any) -> bool:
    """A waiting request whose chunk is 0 lets go of the cached inputs it took a reference on.

    Through 0.27.1 ``schedule()`` runs the encoder check before the split, also in its waiting
    loop, and the check takes a reference on every cached input in the chunk (a copy's, a
    repeat's): where the split then answers 0, the request stays waiting and its references
    hold those inputs while another request's input does not fit. 0.28 splits first and takes
    none. A running request keeps its own: it holds them until its tokens are computed.
    The next step's check takes them again where the inputs are still cached. Returns whether
    it dropped any (the split rule counts it: the run differs from stock's)."""
    if getattr(getattr(request, "status", None), "name", "RUNNING") == "RUNNING":
        return False
    manager = getattr(scheduler, "encoder_cache_manager", None)
    cached = getattr(manager, "cached", None)  # None: encoder-decoder's manager, no references
    if not isinstance(cached, dict):
        return False
    rid, dropped = request.request_id, False
    for i, feature in enumerate(request.mm_features or ()):
        if rid in cached.get(feature.identifier, ()):
            manager.free_encoder_input(request, i)
            dropped = True
    return dropped


def has_known_parameters(method: Callable[..., int]) -> bool:
    parameters = list(inspect.signature(method).parameters.values())[
        len(SPLIT_LEADING_PARAMETERS) :
    ]
    names = tuple(p.name for p in parameters)
    known = KNOWN_SPLIT_TRAILING_PARAMETERS
    return names in (known[:2], known) and all(
        p.kind is p.POSITIONAL_OR_KEYWORD and p.default == 0 for p in parameters
    )
