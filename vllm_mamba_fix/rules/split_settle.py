"""Settling the split wrapper once per scheduler, at its first split.

:func:`settle` reads the block unit (:func:`vllm_mamba_fix.facts.blocks.settle_split`) and marks
a scheduler where no rule can act ``quiet``: its calls return vLLM's answer after one
attribute read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_mamba_fix.facts.blocks import BLOCK_ATTR, SPLIT_ATTR, BlockUnit, SplitState, settle_split
from vllm_mamba_fix.facts.config import ENV_BLOCK_RULE
from vllm_mamba_fix.facts.targets import MARKER

# The split wrapper's options (rules/split_rule.py, WrapOptions): read by attribute, so this
# module stays below the corrector in the import graph.
SplitOptions = Any


def settle(scheduler: Any, options: SplitOptions) -> tuple[SplitState, BlockUnit]:
    """The first split of ``scheduler``: meet it if it was built before the patch, then settle."""
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
    quiet = state.view is None and not (acts and state.size)
    state = dataclasses.replace(state, quiet=quiet, settled_for=options)
    setattr(scheduler, SPLIT_ATTR, state)
    return state, unit
