"""Shared by the stall-end tests (issue 21 item 1): a clock the test advances, the plugin's
``update_from_output`` wrapper (the stall end's, and the watchdog's look's), and what a
scheduler hands the engine core.

The watchdog reads ``vllm_mamba_fix.rules.stall_watch.clock``; tests put a :class:`Clock` there
instead of sleeping for minutes. :func:`update_wrapped` checks that the plugin's loader
installed its own ``update_from_output`` wrapper on ``Scheduler``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from vllm_mamba_fix.facts.targets import MARKER, UPDATE_METHOD
from vllm_mamba_fix.rules import stall_watch
from vllm_mamba_fix.rules.stall_end import EndOptions

ENDED_PREFIX = "vllm-mamba-fix ended this request"


class Clock:
    """Monotonic seconds that move only when told, or by ``per_call`` on every reading."""

    def __init__(self, per_call: float = 0.0) -> None:
        self.now = 1000.0
        self.per_call = per_call

    def __call__(self) -> float:
        self.now += self.per_call
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def install_clock(monkeypatch: pytest.MonkeyPatch, per_call: float = 0.0) -> Clock:
    """The watchdog's clock, for the rest of the test."""
    fake = Clock(per_call)
    monkeypatch.setattr(stall_watch, "clock", fake)
    return fake


def count_samples(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The watchdog's samples from now on, each as the steps it counted (stall_look.sample)."""
    from vllm_mamba_fix.rules import stall_look

    samples: list[int] = []
    real_sample = stall_look.sample

    def counting(*args: Any) -> None:
        samples.append(args[4])
        real_sample(*args)

    monkeypatch.setattr(stall_look, "sample", counting)
    return samples


def stall_end_installed() -> bool:
    """Whether the plugin's update wrapper is on ``Scheduler`` and carries the stall end (it
    also carries the watchdog's look, with or without the end)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    options = getattr(Scheduler.__dict__.get(UPDATE_METHOD), MARKER, None)
    return isinstance(options, EndOptions) and options.end_stalls_after is not None


def load_with_stall_end(load: Callable[..., object]) -> None:
    """``load(**env)`` the plugin; where the release installs no stall end by default (0.33+
    runs no fix rule, so no watchdog to end from), again forced, as an operator can. Skips
    where even forcing installs none."""
    from tools import sched_harness as harness

    load()
    if not stall_end_installed():
        harness.unload_plugin()
        load(VLLM_MAMBA_FIX="force")
    if not stall_end_installed():
        pytest.skip("the plugin installs no stall end on this release, even forced")


@contextlib.contextmanager
def update_wrapped(end_after: float | None = None) -> Iterator[None]:
    """Fails unless the plugin's loader put its update wrapper on ``Scheduler`` (with
    ``end_after``, if given), for the block it guards: the ends run through the table's
    wiring, not a test's."""
    from vllm.v1.core.sched.scheduler import Scheduler

    assert stall_end_installed(), f"the loader left Scheduler.{UPDATE_METHOD} unwrapped"
    options = getattr(Scheduler.__dict__[UPDATE_METHOD], MARKER)
    if end_after is not None:
        assert options.end_stalls_after == end_after, options
    yield


@contextlib.contextmanager
def update_without_end() -> Iterator[None]:
    """Fails unless ``Scheduler``'s update carries no stall end (the stall-end rule off): vLLM's
    own, or the plugin's wrapper with the watchdog's look alone."""
    from vllm.v1.core.sched.scheduler import Scheduler

    options = getattr(Scheduler.__dict__.get(UPDATE_METHOD), MARKER, None)
    assert options is None or options.end_stalls_after is None, options
    yield


@dataclass(frozen=True)
class Finish:
    finish_reason: Any
    stop_reason: Any
    error: Any


def capture_finishes(scheduler: Any) -> dict[str, Finish]:
    """Every finished output ``scheduler.update_from_output`` returns from now on, by id."""
    finishes: dict[str, Finish] = {}
    update: Callable[..., Any] = scheduler.update_from_output

    def capturing(*args: Any, **kwargs: Any) -> Any:
        outputs = update(*args, **kwargs)
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                if output.finish_reason is not None:
                    assert output.request_id not in finishes, f"{output.request_id} finished twice"
                    finishes[output.request_id] = Finish(
                        output.finish_reason, output.stop_reason, getattr(output, "error", None)
                    )
        return outputs

    scheduler.update_from_output = capturing  # the instance's: vLLM's engine core's view
    return finishes


def ended(finishes: dict[str, Finish]) -> set[str]:
    """The requests the plugin ended (its message is their stop reason)."""
    return {
        rid
        for rid, f in finishes.items()
        if isinstance(f.stop_reason, str) and f.stop_reason.startswith(ENDED_PREFIX)
    }


def assert_pools_clean(scheduler: Any) -> None:
    """No request left, every KV block free, no encoder cache entry referenced."""
    assert not scheduler.requests, list(scheduler.requests)
    assert not scheduler.running and not len(scheduler.waiting)
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # all but the null block
    manager = scheduler.encoder_cache_manager
    assert manager.num_freeable_slots == manager.cache_size
    assert not any(manager.cached.values()), manager.cached
