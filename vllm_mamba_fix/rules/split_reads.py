"""What the split rule reads beyond one call's numbers, kept out of its module: of the split
method when it is wrapped (its known parameters), and of the scheduler on the
rule's slow path (issue 44 item 4, docs/reliability.md "Steps against stock and 0.28"): the
references a waiting request's encoder check took where its split answers 0 are dropped, as
0.28 (which splits first) never takes them. The other two such reads,
``split_rule.tail_frees_room_at`` and ``split_rule.eagle_remainder_waits``, stay in the rule's
module: a corrected call enters at most four package files. No vLLM import; the scheduler and
request are vLLM's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from vllm_mamba_fix.facts.targets import KNOWN_SPLIT_TRAILING_PARAMETERS, SPLIT_LEADING_PARAMETERS


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
