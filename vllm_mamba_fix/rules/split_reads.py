"""What the split rule reads beyond one call's numbers: the split method's known parameters,
and on the slow path the references a waiting request's encoder check took where its split
answers 0 (dropped, as 0.28 never takes them; issue 44 item 4). No vLLM import."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from vllm_mamba_fix.facts.targets import KNOWN_SPLIT_TRAILING_PARAMETERS, SPLIT_LEADING_PARAMETERS


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


def _trailing(method: Callable[..., int]) -> list[inspect.Parameter]:
    parameters = list(inspect.signature(method).parameters.values())
    return parameters[len(SPLIT_LEADING_PARAMETERS) :]


def has_known_parameters(method: Callable[..., int]) -> bool:
    parameters = _trailing(method)
    names, known = tuple(p.name for p in parameters), KNOWN_SPLIT_TRAILING_PARAMETERS
    return names in (known[:2], known) and all(
        p.kind is p.POSITIONAL_OR_KEYWORD and p.default == 0 for p in parameters
    )


def takes_third_parameter(method: Callable[..., int]) -> bool:
    """Whether a split of known parameters has 0.24-0.25's third trailing one."""
    return len(_trailing(method)) == len(KNOWN_SPLIT_TRAILING_PARAMETERS)
