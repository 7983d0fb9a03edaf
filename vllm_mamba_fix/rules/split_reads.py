"""What the split rule reads beyond one call's numbers: the split method's known parameters,
and on the slow path the references a waiting request's encoder check took where its split
answers 0 (dropped, as 0.28 never takes them; issue 44 item 4). No vLLM import."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from vllm_mamba_fix.facts.targets import EXTRA_COMPUTED_PARAMETERS, SPLIT_LEADING_PARAMETERS


def drop_waiting_references(scheduler: Any, request: Any) -> bool:
    """A waiting request whose chunk is 0 lets go of the cached inputs it referenced (through
    0.27.1 the encoder check runs before the split there too, and those references hold inputs
    another request's needs the room of); the next step's check takes them again."""
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
    """The two trailing parameters of every release but 0.24-0.25 (which add a third)."""
    parameters = list(inspect.signature(method).parameters.values())
    parameters = parameters[len(SPLIT_LEADING_PARAMETERS) :]
    return tuple(p.name for p in parameters) == EXTRA_COMPUTED_PARAMETERS and all(
        p.kind is p.POSITIONAL_OR_KEYWORD and p.default == 0 for p in parameters
    )
