"""Settling the split wrapper once per scheduler, at its first split.

:func:`settle` reads the block unit (:func:`vllm_mamba_fix.facts.blocks.settle_split`), marks a
scheduler where no rule can act ``quiet``, and binds vLLM's own split to a scheduler as its
instance attribute where calls need no look: every call where it is quiet, the text
requests' where only multimodal requests can need a rule (the encoder wrapper unbinds it
before each multimodal request's split). Those calls cost what stock's cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from vllm_mamba_fix.decide.scope import builtin_scope
from vllm_mamba_fix.facts.blocks import (
    BLOCK_ATTR,
    SPLIT_ATTR,
    BlockUnit,
    SplitState,
    settle_split,
    with_bypass,
)
from vllm_mamba_fix.facts.config import ENV_BLOCK_RULE, Scope
from vllm_mamba_fix.facts.targets import ENCODER_METHOD, MARKER, SPLIT_METHOD

# The split wrapper's options (rules/split_rule.py, WrapOptions): read by attribute, so this
# module stays below the corrector in the import graph.
SplitOptions = Any

# Where vLLM's own schedule() lives: it calls the encoder check under
# ``request.has_encoder_inputs``, right before that request's split, in every release.
VLLM_SCHEDULE_MODULES = frozenset({"vllm.v1.core.sched.scheduler"})


def settle(
    scheduler: Any, options: SplitOptions, original: Callable[..., int] | None = None
) -> tuple[SplitState, BlockUnit]:
    """The first split of ``scheduler``: meet it if it was built before the patch, then settle.

    Given vLLM's ``original`` split, a scheduler whose calls need no look (quiet), or whose
    text requests need none, gets it bound as its instance attribute: those calls cost
    what stock's do.
    """
    if getattr(scheduler, BLOCK_ATTR, None) is None:
        # Built before the plugin loaded: run the per-construction check now.
        on_built = getattr(type(scheduler).__init__, MARKER, None)
        if callable(on_built):
            on_built(scheduler)
    state, unit = settle_split(
        scheduler, options.block_rule, ENV_BLOCK_RULE, options.advances_sub_block
    )
    # With the sizes agreeing, a call looks at nothing unless a rule of this class can act.
    acts = options.deadlock_rules or options.hears_split_zeros
    acts = acts or (options.block_rule and options.realign and options.realign_others)
    if state.view is None and not (acts and state.size):
        state = dataclasses.replace(state, quiet=True)
    if original is not None and _wrapper_resolves(scheduler, SPLIT_METHOD, options):
        if state.quiet:
            state = with_bypass(scheduler, state, original, armed=False)
        elif _only_multimodal_requests_looked_at(scheduler, options, state):
            state = with_bypass(scheduler, state, original, armed=True)
    setattr(scheduler, SPLIT_ATTR, state)
    return state, unit


def _wrapper_resolves(scheduler: Any, name: str, options: Any = None) -> bool:
    """Whether ``scheduler``'s class resolves ``name`` to a plugin wrapper (with ``options``)."""
    marker = getattr(getattr(type(scheduler), name, None), MARKER, None)
    return marker is not None if options is None else marker is options


def _only_multimodal_requests_looked_at(
    scheduler: Any, options: SplitOptions, state: SplitState
) -> bool:
    """Whether a text request's split can only ever be vLLM's answer here, and every
    multimodal request's split meets the wrapper: the split rule acts on multimodal
    requests alone (the built-in scope), nothing re-aligns text, the sizes agree (a text
    request's split 0 is then a wait for token budget, which the watchdog does not hear), and
    vLLM's own ``schedule()`` asks the wrapped encoder check of every request with encoder
    inputs right before its split (the arm)."""
    schedule = getattr(type(scheduler), "schedule", None)
    return (
        state.view is None
        and state.size > 0
        and options.deadlock_rules
        and not (options.block_rule and options.realign and options.realign_others)
        and builtin_scope(options.scope) is Scope.MULTIMODAL
        and getattr(schedule, "__module__", None) in VLLM_SCHEDULE_MODULES
        and _wrapper_resolves(scheduler, ENCODER_METHOD)
    )
