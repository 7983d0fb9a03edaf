"""What a request's encoder inputs need, read from the scheduler: the proofs that a 0 never
clears (its own inputs never fit; stalled requests hold the space each other needs), and
whether a 0 is the speculative stall. The arithmetic is ``decide/``'s; no vLLM import."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_mamba_fix.decide.decision import speculative_stall_release, unshifted_cut_needed
from vllm_mamba_fix.decide.stalls import REPEATED, Hold, Streak, cross_hold_block, own_inputs_block


def num_embeds(request: Any, input_id: int) -> int:
    getter = getattr(request, "get_num_encoder_embeds", None)
    return int(getter(input_id) if getter else request.mm_features[input_id].mm_position.length)


def encoder_cut_shift(scheduler: Any) -> int:
    """The tokens vLLM leaves before an encoder input it cannot schedule: 0.28+ pass
    ``num_prefill_lookahead``, 0.15-0.27 ``1 if use_eagle else 0``."""
    lookahead = getattr(scheduler, "num_prefill_lookahead", None)
    eagle = 1 if getattr(scheduler, "use_eagle", False) else 0
    return int(lookahead) if lookahead is not None else eagle


def _placeholder(request: Any, input_id: int) -> tuple[int, int]:
    position = request.mm_features[input_id].mm_position
    return position.offset, position.length


def stalled_inputs(
    scheduler: Any, request: Any, computed: int, shift: int, streak: Streak
) -> tuple[bool, tuple[int, ...]]:
    """Whether this 0 is the speculative stall, and the held inputs to free to end it."""
    manager = scheduler.encoder_cache_manager
    held = {i: _placeholder(request, i) for i in sorted(manager.get_cached_input_ids(request))}
    release = speculative_stall_release(computed, shift, held)
    if release.stalled:
        return True, tuple(release.to_free)
    if streak.steps < REPEATED:  # the unshifted case is looked for once the 0 repeats
        return False, ()
    placed = {i: _placeholder(request, i) for i in range(len(request.mm_features))}
    return unshifted_cut_needed(computed, shift, placed, held), tuple(release.to_free)


def _has_embeds(position: Any, lo: int, hi: int) -> bool:
    """Whether placeholder tokens ``[lo, hi)`` (relative) hold embeddings vLLM schedules."""
    mask = getattr(position, "is_embed", None)
    part = mask[lo:hi] if mask is not None else [True]
    return bool(part.any()) if hasattr(part, "any") else any(part)


def _key(feature: Any) -> Any:
    """The encoder cache's key of an input (a repeated image is one entry)."""
    return getattr(feature, "identifier", None) or getattr(feature, "mm_hash", None)


OwnInputs = tuple[dict[Any, int], dict[Any, int], int, "int | None"]


def own_inputs(scheduler: Any, request: Any, start: int, end: int) -> OwnInputs | None:
    """:func:`stalls.own_inputs_block`'s arguments for the smallest chunk ``[start, end)`` vLLM
    would not return as 0; None where nothing can be proven."""
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
        key = _key(feature)
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


# A named stall another request's proof may count on: (request, position, window end).
Stalled = tuple[Any, int, int]


def cache_holds(scheduler: Any) -> tuple[list[Hold], int] | None:
    """The cache entries requests reference, with their sizes, and the tokens free or referenced
    by none (vLLM evicts those on demand); None where it cannot be read."""
    manager = scheduler.encoder_cache_manager
    cached = getattr(manager, "cached", None)
    free = getattr(manager, "num_freeable_slots", None)
    if not isinstance(cached, dict) or free is None:
        return None
    referenced = {key: holders for key, holders in cached.items() if holders}
    sizes: dict[Any, int] = {}
    for rid in set().union(*referenced.values()):
        request = scheduler.requests.get(rid)
        for i, feature in enumerate(getattr(request, "mm_features", None) or ()):
            key = _key(feature)
            if key in referenced and key not in sizes:
                sizes[key] = num_embeds(request, i)
    if len(sizes) < len(referenced):
        return None  # an entry of no known request: no proof
    return [(sizes[key], frozenset(holders)) for key, holders in referenced.items()], int(free)


def cross_hold_proof(
    scheduler: Any, request: Any, stalled: Mapping[str, Stalled], ending: frozenset[str]
) -> str | None:
    """Why ``request`` must be ended to break named stalls' hold on each other's cache space, or
    None. A stall its own inputs keep counts as ending; one of unknown needs as free to move."""
    read = cache_holds(scheduler)
    if read is None or request.request_id not in stalled:
        return None
    holds, free = read
    cached = scheduler.encoder_cache_manager.cached
    needs: dict[str, int] = {}
    hopeless = set(ending)
    arrival: dict[str, float] = {}
    for rid, (other, start, end) in stalled.items():
        facts = own_inputs(scheduler, other, start, end)
        if facts is None:
            continue
        if own_inputs_block(*facts) is not None:
            hopeless.add(rid)
            continue
        held, needed, _, _ = facts
        # An input another request placed in the cache is referenced, not allocated.
        needs[rid] = sum(n for key, n in needed.items() if key not in held and key not in cached)
        arrival[rid] = float(getattr(other, "arrival_time", 0.0) or 0.0)
    return cross_hold_block(request.request_id, needs, holds, free, frozenset(hopeless), arrival)
