"""What a request's own encoder inputs need, read from the scheduler: the proof that a 0
can never clear, whatever other requests do.

Both the split rule (is this encoder cut a wait, or the request's own deadlock?) and the
watchdog's stall end ask it. Reads vLLM's objects, imports no vLLM; the arithmetic is
:func:`vllm_mamba_fix.decide.stalls.own_inputs_block`'s.
"""

from __future__ import annotations

from typing import Any

from vllm_mamba_fix.decide.stalls import own_inputs_block


def num_embeds(request: Any, input_id: int) -> int:
    getter = getattr(request, "get_num_encoder_embeds", None)
    if getter is not None:
        return int(getter(input_id))
    return int(request.mm_features[input_id].mm_position.length)


def _has_embeds(position: Any, lo: int, hi: int) -> bool:
    """Whether placeholder tokens ``[lo, hi)`` (relative) hold embeddings vLLM schedules."""
    mask = getattr(position, "is_embed", None)
    if mask is None:
        return True
    part = mask[lo:hi]
    return bool(part.any()) if hasattr(part, "any") else any(part)


OwnInputs = tuple[dict[Any, int], dict[Any, int], int, "int | None"]


def own_inputs(scheduler: Any, request: Any, start: int, end: int) -> OwnInputs | None:
    """(held, needed, cache size, per-step budget) of :func:`stalls.own_inputs_block` for the
    chunk ``[start, end)``, the smallest vLLM would not return as 0 (its shift included);
    None where nothing can be proven."""
    if getattr(scheduler, "is_encoder_decoder", False) or not request.mm_features:
        return None
    manager = scheduler.encoder_cache_manager
    cache_size = int(manager.cache_size)
    # An EC connector loads inputs outside the compute budget: the budget proves nothing.
    budget = None
    if getattr(scheduler, "ec_connector", None) is None:
        budget = int(getattr(scheduler, "max_num_encoder_input_tokens", cache_size))
    held_ids = manager.get_cached_input_ids(request)
    held: dict[Any, int] = {}
    needed: dict[Any, int] = {}
    for i, feature in enumerate(request.mm_features):
        key = getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)
        if key is None:
            return None  # a repeated image could be one cache entry: no proof
        position = feature.mm_position
        lo, hi = max(start, position.offset), min(end, position.offset + position.length)
        if i in held_ids:
            held[key] = num_embeds(request, i)
        elif lo < hi and _has_embeds(position, lo - position.offset, hi - position.offset):
            needed[key] = num_embeds(request, i)
    return held, needed, cache_size, budget


def own_inputs_proof(scheduler: Any, request: Any, start: int, end: int) -> str | None:
    """Why ``request`` can never get the tokens ``[start, end)`` whatever others do, or None."""
    facts = own_inputs(scheduler, request, start, end)
    return None if facts is None else own_inputs_block(*facts)
