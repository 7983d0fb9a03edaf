"""rules/block_unit.py: the block-unit rule, engaged once per scheduler (vLLM #54076).

vLLM's split is a function that records the ``cache_config.block_size`` it read. Where the
cache's block differs from the configured one, the scheduler is given a view of its
``cache_config`` with the cache's block at its first split; every later call of vLLM's split
reads it with no swap and no second call; undoing the record puts the scheduler's own back.
A chunk the configured block would have ended elsewhere is counted on the slow path. The
rule on the real Scheduler of every release, against stock with the block pinned:
tests/scheduler/test_block_units.py, tests/scheduler/test_block_unit_exhaustive.py and
tests/e2e/test_cache_reuse.py.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.decide.scope import ScopePolicy
from vllm_mamba_fix.facts.blocks import BLOCK_ATTR, SPLIT_ATTR, CacheConfigView
from vllm_mamba_fix.facts.config import Scope
from vllm_mamba_fix.facts.versions import PrefillGate
from vllm_mamba_fix.observe import counters
from vllm_mamba_fix.rules.split_rule import WrapOptions, make_wrapper

CACHE_BLOCK, CONFIGURED = 256, 128
PROMPT = 1000
# The block-unit rule alone, on a release whose split stops mid-block starts itself (0.27+).
OPTIONS = WrapOptions(
    PrefillGate.BEFORE_PREFILL_END, ScopePolicy(Scope.MULTIMODAL), deadlock_rules=False,
    realign_others=False, absolute_end=True,
)  # fmt: skip


def split(self: Any, request: Any, num_new_tokens: int, *_: Any) -> int:
    """vLLM 0.26+'s floor, in whatever block ``cache_config`` says now."""
    block = self.cache_config.block_size
    self.seen.append(block)
    start = request.num_computed_tokens
    end = start + num_new_tokens
    if end >= request.num_prompt_tokens:
        return num_new_tokens
    return max(0, end // block * block - start)


def scheduler_class(method: Callable[..., int] = split, options: WrapOptions = OPTIONS) -> type:
    return type("Scheduler", (), {"_mamba_block_aligned_split": make_wrapper(method, options)})


def build(cls: type, budget: int = 8192) -> Any:
    scheduler = cls()
    scheduler.cache_config = SimpleNamespace(block_size=CONFIGURED, enable_prefix_caching=True)
    scheduler.max_num_scheduled_tokens = budget
    scheduler.scheduler_config = SimpleNamespace(long_prefill_token_threshold=0)
    setattr(scheduler, BLOCK_ATTR, CACHE_BLOCK)  # the Mamba group's block, read when built
    scheduler.seen = []
    return scheduler


def request(at: int, prompt: int = PROMPT) -> Any:
    return SimpleNamespace(
        request_id="r", num_computed_tokens=at, num_prompt_tokens=prompt, num_tokens=prompt,
        has_encoder_inputs=False,
    )  # fmt: skip


pytestmark = pytest.mark.usefixtures("session")


def test_vllms_split_floors_in_the_caches_block_with_no_swap_per_call() -> None:
    scheduler = build(scheduler_class())
    real = scheduler.cache_config
    ask = scheduler._mamba_block_aligned_split
    # [0, 300): the configured block ends it at 256 too; [0, 400): 256, not 384.
    assert ask(request(0), 300) == 256
    assert counters.stats()["block_rule_chunks"] == 0
    assert ask(request(0), 400) == 256
    assert counters.stats()["block_rule_chunks"] == 1
    assert ask(request(PROMPT), 1) == 1  # a decode: whole in either block
    assert scheduler.seen == [CACHE_BLOCK] * 3
    view = scheduler.cache_config
    assert isinstance(view, CacheConfigView) and view.block_size == CACHE_BLOCK
    assert view.enable_prefix_caching is True and real.block_size == CONFIGURED
    assert vars(scheduler)["cache_config"] is view  # the same view on every call


def test_undoing_the_record_gives_the_scheduler_its_own_cache_config_back() -> None:
    scheduler = build(scheduler_class())
    real = scheduler.cache_config
    scheduler._mamba_block_aligned_split(request(0), 400)
    assert scheduler.cache_config is not real
    assert installation.undo(lambda change: change.name == "cache_config")
    assert scheduler.cache_config is real


def known_split(
    self: Any,
    request: Any,
    num_new_tokens: int,
    num_new_local_computed_tokens: int = 0,
    num_external_computed_tokens: int = 0,
) -> int:
    """:func:`split` with the parameters of every release from 0.26 (the known wrapper's)."""
    return split(self, request, num_new_tokens)


@pytest.mark.parametrize("method", [split, known_split], ids=["any-signature", "known"])
def test_a_scheduler_living_through_the_undo_is_settled_by_the_next_wrapper(
    method: Callable[..., int],
) -> None:
    """The wrapper reads whatever state the scheduler holds, unchecked: the undo deletes it,
    so a wrapper installed later settles the scheduler again with its own options."""
    cls = scheduler_class(method)
    scheduler = build(cls)
    real = scheduler.cache_config
    assert scheduler._mamba_block_aligned_split(request(0), 400) == 256  # engaged
    assert installation.undo(lambda change: True)
    assert scheduler.cache_config is real
    off = OPTIONS._replace(block_rule=False)
    cls._mamba_block_aligned_split = make_wrapper(method, off)
    assert scheduler._mamba_block_aligned_split(request(0), 400) == 384  # vLLM's own
    assert scheduler.cache_config is real
    assert scheduler.seen == [CACHE_BLOCK, CONFIGURED]
    assert getattr(scheduler, SPLIT_ATTR).view is None  # settled again, not the first state


def test_vllms_exception_propagates() -> None:
    def raising(self: Any, *args: Any) -> int:
        raise ValueError("vLLM's own")

    scheduler = build(scheduler_class(raising))
    with pytest.raises(ValueError, match="vLLM's own"):
        scheduler._mamba_block_aligned_split(request(0), 400)


def test_starved_the_configured_answer_stops_at_the_caches_boundary() -> None:
    """A cache block longer than any chunk: asked in it, 0.15-0.26 would floor to 0 forever.
    The configured answer, stopped at the next cache boundary, is what stock schedules."""
    cls = scheduler_class(options=OPTIONS._replace(advances_sub_block=False))
    scheduler = build(cls, budget=300)
    setattr(scheduler, BLOCK_ATTR, 2048)
    ask = scheduler._mamba_block_aligned_split
    # configured: [1900, 2176); the cache's boundary at 2048 comes first
    assert ask(request(1900, prompt=5000), 300) == 148
    assert counters.stats()["block_rule_chunks"] == 1
    assert ask(request(0, prompt=5000), 300) == 256  # stock's chunk
    assert counters.stats()["block_rule_chunks"] == 1
    assert scheduler.seen == [CONFIGURED, CONFIGURED]
    assert not isinstance(scheduler.cache_config, CacheConfigView)


def test_starved_keeps_the_configured_block_where_the_split_advances_sub_block_too() -> None:
    """0.27+: pinned stock would advance sub-block through the wide block, in chunks that can
    take more steps than stock's right ones; the configured answer, stopped, is stock's."""
    scheduler = build(scheduler_class(), budget=300)
    setattr(scheduler, BLOCK_ATTR, 2048)
    assert scheduler._mamba_block_aligned_split(request(1900, prompt=5000), 300) == 148
    assert scheduler.seen == [CONFIGURED]
    assert not isinstance(scheduler.cache_config, CacheConfigView)


def test_the_arguments_reach_vllm_untouched() -> None:
    calls: list[tuple[Any, ...]] = []

    def recording(self: Any, req: Any, n: int, *args: Any, **kwargs: Any) -> int:
        calls.append((n, args, kwargs))
        return n

    scheduler = build(scheduler_class(recording))
    assert scheduler._mamba_block_aligned_split(request(990), 1, 10, 0) == 1
    assert calls == [(1, (10, 0), {})]


def test_a_cache_config_of_the_class_is_left_alone() -> None:
    """Not an instance attribute: the rule stands down (vLLM's configured split)."""
    cls = scheduler_class()
    cls.cache_config = SimpleNamespace(block_size=CONFIGURED)
    scheduler = cls()
    scheduler.max_num_scheduled_tokens = 8192
    scheduler.scheduler_config = SimpleNamespace(long_prefill_token_threshold=0)
    setattr(scheduler, BLOCK_ATTR, CACHE_BLOCK)
    scheduler.seen = []
    assert scheduler._mamba_block_aligned_split(request(0), 400) == 384
    assert "cache_config" not in vars(scheduler)
