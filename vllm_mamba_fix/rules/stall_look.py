"""The stall watchdog's look, once per step from the ``update_from_output`` wrapper; nothing
of it runs in the split or the encoder check. Per step: one clock read and a compare. Once
:data:`SAMPLE_SECONDS` passed, one :func:`sample`: streaks whose request moved end; then, if the
step left the smallest chunk of its budget unused (else a 0 is a wait for budget), each request
that stopped counts the steps since; a streak long enough is named, a named one considered for
its end (:mod:`vllm_mamba_fix.rules.stall_watch`). Imports no vLLM.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.decide.decision import in_prefill_by_position
from vllm_mamba_fix.decide.stalls import Streak, watchdog_due
from vllm_mamba_fix.facts.blocks import known_block_size, longest_chunk
from vllm_mamba_fix.rules.encoder_facts import encoder_cut_shift, stalled_inputs
from vllm_mamba_fix.rules.zero_streaks import ZeroStreaks

# The least time between two samples of one scheduler.
SAMPLE_SECONDS = 1.0
_ADMITTED = ("WAITING", "PREEMPTED")  # the statuses the waiting loop takes


class Watching(NamedTuple):
    """What a sample needs beyond the step: the rule's bounds and the rule itself."""

    seconds: float  # of 0 tokens before a stall is named
    end_after: float | None  # after the naming before an end is considered; None: off
    # rules/stall_watch.py, read at each use (tests patch it): not imported, so the chain of
    # imports from the table stays within the limit.
    rule: Any


class _Watch:
    """One scheduler's watchdog: its streaks, and the steps and time since its last sample."""

    def __init__(self, store: ZeroStreaks) -> None:
        self.store, self.last, self.steps = store, float("-inf"), 0


class Watches(weakref.WeakKeyDictionary[Any, _Watch]):
    """The session's memory: per scheduler, weakly, its watch (the streaks counted there)."""


Observer = Callable[[Any, Any], None]


def make_observer(watching: Watching) -> Observer:
    """The watchdog's per-step look, for the ``update_from_output`` wrapper to call with the
    scheduler and the step's ``scheduler_output``."""
    # The session's watches, held here (the session that made the wrapper removes it), read
    # through the weak dictionary's own dict: its get is Python code, a frame a step.
    rule, watches, ref = watching.rule, installation.memory[Watches], weakref.ref
    by_ref = watches.data

    def observe(scheduler: Any, scheduler_output: Any) -> None:
        watch = by_ref.get(ref(scheduler))
        if watch is None:
            watch = watches[scheduler] = _Watch(ZeroStreaks())
        watch.steps += 1
        now = rule.clock()
        if now - watch.last < SAMPLE_SECONDS:
            return
        steps, watch.steps, watch.last = watch.steps, 0, now
        sample(scheduler, scheduler_output, watch.store, now, steps, watching)

    return observe


def sample(
    scheduler: Any, scheduler_output: Any, store: ZeroStreaks, now: float, steps: int,
    watching: Watching,
) -> None:  # fmt: skip
    """One look: a streak whose request moved ends ("moves again" if named; a gone one is
    dropped); each request that stopped in a step that left token budget unused counts
    ``steps`` 0s (a step that used its budget says nothing of who waits for it)."""
    for rid, streak in list(store.by_request.items()):
        request = scheduler.requests.get(rid)
        if request is not None and not request.is_finished():
            if start_of(scheduler, request) == streak.position:
                continue
            if streak.warned:
                watching.rule.log_moving_again(rid, streak.position)
        store.clear(rid)
    used = int(scheduler_output.total_num_scheduled_tokens)
    if int(scheduler.max_num_scheduled_tokens) - used < least_chunk(scheduler):
        return
    for request in candidates(scheduler, scheduler_output):
        _count(scheduler, request, store, now, steps, watching)


def least_chunk(scheduler: Any) -> int:
    """The smallest chunk the split gives a prefill that has budget: the Mamba block (the
    configured one where unreadable), or the longest chunk it is asked if that is shorter."""
    unit = 0
    with contextlib.suppress(Exception):
        unit = known_block_size(scheduler)
    if unit <= 0:
        unit = int(scheduler.cache_config.block_size)
    longest = longest_chunk(scheduler)
    return min(unit, longest) if longest else unit


def start_of(scheduler: Any, request: Any) -> int:
    """Where the request's next chunk starts: its computed tokens, or, where it has none yet
    (waiting), its local prefix-cache hit, read from the cache's coordinator as vLLM's
    ``get_computed_blocks`` does, without that method's stats and events."""
    computed = int(request.num_computed_tokens)
    if computed:
        return computed
    manager = getattr(scheduler, "kv_cache_manager", None)
    if not getattr(manager, "enable_caching", False):
        return 0
    if getattr(request, "skip_reading_prefix_cache", False):
        return 0
    try:  # (blocks, hit tokens[, ...]) on every release 0.15-0.34
        hit = manager.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        return int(hit[1])
    except Exception:  # another shape: the request stands at 0, and the watchdog still looks
        return 0


def _in_prefill(request: Any) -> bool:
    computed = request.num_computed_tokens
    return in_prefill_by_position(computed, request.num_prompt_tokens, request.num_tokens)


def candidates(scheduler: Any, scheduler_output: Any) -> list[Any]:
    """The requests that got 0 tokens in the step and could have had some: every running
    prefill not scheduled, and the head of the waiting queue where its loop ran (a free
    running slot, nothing preempted, not paused)."""
    scheduled = scheduler_output.num_scheduled_tokens
    found = [
        request
        for request in scheduler.running
        if request.request_id not in scheduled
        and not request.is_finished()
        and _in_prefill(request)
    ]
    if (
        len(scheduler.running) < scheduler.max_num_running_reqs
        and not getattr(scheduler_output, "preempted_req_ids", None)
        and getattr(getattr(scheduler, "_pause_state", None), "name", "UNPAUSED") == "UNPAUSED"
    ):
        head = next(
            (r for r in scheduler.waiting if not r.is_finished() and r.status.name in _ADMITTED),
            None,
        )  # the first the waiting loop would take (waiting or preempted)
        if head is not None and head.request_id not in scheduled and _in_prefill(head):
            found.append(head)
    return found


def _count(
    scheduler: Any, request: Any, store: ZeroStreaks, now: float, steps: int, watching: Watching
) -> None:
    """A stop of ``request``: its streak counts; named once due, then its end considered."""
    seconds, end_after, rule = watching.seconds, watching.end_after, watching.rule
    rid, position = request.request_id, start_of(scheduler, request)
    streak, moved = store.zero(rid, position, now, steps)
    if moved is not None and moved.warned:
        rule.log_moving_again(rid, moved.position)
    if not streak.warned and not watchdog_due(streak, now, seconds):
        return
    window_end = rule.split_window_end(scheduler, request, position)
    heard = rule.Heard(store, streak, now, end_after, window_end)
    if streak.warned:
        rule.consider(scheduler, request, heard)
        return
    speculative = speculative_zero(scheduler, request, position, streak)
    rule.name_stall(scheduler, request, heard, speculative)


def speculative_zero(scheduler: Any, request: Any, position: int, streak: Streak) -> bool | None:
    """What kind of 0 the request stands at, for its cause: True, the speculative stall (its
    held inputs keep the shifted cut from passing the next one); False, the encoder check's
    own 0 (it stands at an input it cannot schedule, the cut before it at or behind its
    position); None, a cut past its position that only the split floors to 0."""
    shift = encoder_cut_shift(scheduler)
    if shift and stalled_inputs(scheduler, request, position, shift, streak)[0]:
        return True
    held = scheduler.encoder_cache_manager.get_cached_input_ids(request)
    for i, feature in enumerate(request.mm_features or ()):
        offset, length = feature.mm_position.offset, feature.mm_position.length
        if i not in held and offset + length > position:
            return False if offset - shift <= position else None
    return None
