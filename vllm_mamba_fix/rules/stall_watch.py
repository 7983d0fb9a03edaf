# Rule:     stall-watchdog (Rule.STALL_WATCHDOG in rules/table.py; VLLM_MAMBA_FIX_STALL_SECONDS,
#           30 s by default, off with "off")
# Answers:  no vLLM issue of its own: a prefill that gets 0 tokens forever looks healthy from
#           outside (GPU idle, /health 200, no log line). The watchdog names it, with its cause
#           and remedy, whichever rule or setting left it there.
# Runs on:  wherever a fix rule runs (split or speculative-stall): 0.15.0-0.32.x, and any
#           scheduler that keeps the old order.
# Decided:  by its setting, and on only where the split or the speculative-stall rule is
#           (decide/policy.py: watchdog_verdict).
# Removed:  with the last fix rule it watches.
"""The watchdog: one look per step from ``update_from_output``, and the stall end's decision.

Its carrier is the ``update_from_output`` wrapper (:mod:`vllm_mamba_fix.rules.stall_end`),
which hands it each step's ``scheduler_output``; nothing of it runs inside the split or the
encoder-input check. Per step it reads its clock once; once :data:`SAMPLE_SECONDS` passed
since the scheduler's last sample it samples: the streaks whose request moved end, and, if
the step left at least the smallest chunk of its token budget unused (:func:`budget_left`: a
0 there is not a token-budget wait), each request that stopped in it (:func:`candidates`:
running prefills not scheduled, and the waiting queue's head where its loop ran) counts the
steps since the last sample in its streak, per scheduler, weakly. A streak long enough is
named (one WARNING); a named stall still there ``end_stalls_after`` seconds and two samples
later is ordered to end if :func:`own_inputs_proof` shows that its own encoder inputs keep it
there whatever other requests do, or :func:`cross_hold_proof` that it is the one victim of
named stalls that hold the encoder cache space each other needs.
:mod:`vllm_mamba_fix.rules.stall_end` executes the order at the next step. Reads the
scheduler, imports no vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
from collections.abc import Callable
from typing import Any

from vllm_mamba_fix._log import fields, logger
from vllm_mamba_fix.decide.decision import in_prefill_by_position
from vllm_mamba_fix.decide.stalls import (
    CAUSE_TEXT,
    StallCause,
    StallReport,
    Streak,
    end_due,
    own_inputs_block,
    stall_cause,
    watchdog_due,
)
from vllm_mamba_fix.facts.blocks import known_block_size, longest_chunk
from vllm_mamba_fix.facts.config import ENV_END_STALLS_AFTER
from vllm_mamba_fix.facts.targets import MARKER, SPLIT_METHOD
from vllm_mamba_fix.observe import counters
from vllm_mamba_fix.rules.encoder_facts import (
    OwnInputs,
    Stalled,
    cross_hold_proof,
    encoder_cut_shift,
    num_embeds,
    own_inputs,
    own_inputs_proof,
    stalled_inputs,
)
from vllm_mamba_fix.rules.end_order import EndOrder, order_end, ordered, support_of
from vllm_mamba_fix.rules.zero_streaks import ZeroStreaks

RECHECK_SECONDS = 1.0
# The least time between two samples of one scheduler.
SAMPLE_SECONDS = 1.0
# The watchdog's time, read once per step (``now`` goes on to decide/stalls.py's pure
# functions); tests put a clock they advance here.
clock: Callable[[], float] = time.monotonic
# Per scheduler, weakly: request id -> (store, streak) of each stall named there.
_named: weakref.WeakKeyDictionary[Any, dict[str, tuple[ZeroStreaks, Streak]]] = (
    weakref.WeakKeyDictionary()
)

# -- reading the scheduler ---------------------------------------------------------------


def _held_by_others(scheduler: Any, facts: OwnInputs | None) -> bool:
    """Whether the inputs it needs fit alone but not in the space others leave now."""
    if facts is None:
        return False
    held, needed, _, _ = facts
    due = sum(n for key, n in needed.items() if key not in held)
    return due > int(getattr(scheduler.encoder_cache_manager, "num_freeable_slots", due))


def _named_stalls(scheduler: Any) -> dict[str, Stalled]:
    """The stalls named on ``scheduler`` still there (the others are forgotten)."""
    named = _named.get(scheduler)
    if not named:
        return {}
    stalled: dict[str, Stalled] = {}
    for rid, (store, streak) in list(named.items()):
        request = scheduler.requests.get(rid)
        if request is None or store.by_request.get(rid) is not streak or request.is_finished():
            del named[rid]  # it moved, finished or was freed
        # A waiting request counts from 0 (its prefix hit is not computed yet).
        elif streak.window_end is not None and request.num_computed_tokens in (0, streak.position):
            stalled[rid] = (request, streak.position, streak.window_end)
    return stalled


def _cross_proof(scheduler: Any, request: Any) -> str | None:
    return cross_hold_proof(scheduler, request, _named_stalls(scheduler), ordered(scheduler))


def split_window_end(scheduler: Any, request: Any, position: int) -> int:
    """End of the smallest chunk the split does not floor to 0.

    Where the split rule acts on the request, a chunk that stops at the next encoder input
    is not floored (0.28's order): one token past the cut's look-ahead, as the encoder
    check's. Else the next boundary of the smallest unit any split floors to (a smaller
    unit only shrinks the proof's window).
    """
    options = getattr(getattr(type(scheduler), SPLIT_METHOD, None), MARKER, None)
    if getattr(options, "deadlock_rules", False) and options.scope.in_scope(request):
        end = position + 1 + encoder_cut_shift(scheduler)
        return min(end, int(request.num_prompt_tokens))
    return _boundary_end(scheduler, request, position)


def _boundary_end(scheduler: Any, request: Any, position: int) -> int:
    units = [int(scheduler.cache_config.block_size)]
    with contextlib.suppress(Exception):
        units.append(known_block_size(scheduler))
    unit = min(u for u in units if u > 0)
    return min((position // unit + 1) * unit, int(request.num_prompt_tokens))


def _report(
    scheduler: Any, request: Any, computed: int, streak: Streak, now: float, note: str
) -> StallReport:
    manager = scheduler.encoder_cache_manager
    held_ids = manager.get_cached_input_ids(request)
    features = request.mm_features
    waited = next(
        (
            i
            for i, feature in enumerate(features)
            if i not in held_ids
            and feature.mm_position.offset + feature.mm_position.length > computed
        ),
        None,
    )
    waited_facts = None
    if waited is not None:
        position = features[waited].mm_position
        waited_facts = (position.offset, position.length, num_embeds(request, waited))
    held = tuple(
        (features[i].mm_position.offset, features[i].mm_position.length) for i in sorted(held_ids)
    )
    return StallReport(
        request_id=request.request_id,
        position=computed,
        prompt_tokens=request.num_prompt_tokens,
        steps=streak.steps,
        seconds=now - streak.since,
        held=held,
        waited=waited_facts,
        cache_size=manager.cache_size,
        cache_free=manager.num_free_slots,
        compute_budget=int(getattr(scheduler, "max_num_encoder_input_tokens", manager.cache_size)),
        cause=streak.cause or StallCause.UNKNOWN,
        end_note=note,
    )


# -- naming a stall and considering its end ---------------------------------------------------


def name_stall(
    scheduler: Any,
    request: Any,
    store: ZeroStreaks,
    streak: Streak,
    now: float,
    end_after: float | None,
    window_end: int,
    speculative: bool | None,
) -> None:
    """The watchdog names the stall (one WARNING); ``speculative`` as
    :func:`speculative_zero` says (None: a cut only the split floors to 0)."""
    streak.warned = True
    streak.named_at = now
    streak.window_end = window_end
    _named_stalls(scheduler)  # forget the stalls that ended since
    _named.setdefault(scheduler, {})[request.request_id] = (store, streak)
    counters.record_stall(request_id=request.request_id, stalled_for=now - streak.since)
    manager = scheduler.encoder_cache_manager
    budget = int(getattr(scheduler, "max_num_encoder_input_tokens", manager.cache_size))
    report = _report(scheduler, request, streak.position, streak, now, "")
    waited = report.waited[2] if report.waited else None
    cause = stall_cause(bool(speculative), waited, manager.cache_size, budget)
    facts = own_inputs(scheduler, request, streak.position, window_end)
    proof = None if facts is None else own_inputs_block(*facts)
    split_options = getattr(getattr(type(scheduler), SPLIT_METHOD, None), MARKER, None)
    split_rule = bool(getattr(split_options, "deadlock_rules", False))
    split_floor = speculative is None and request.mm_features and not split_rule
    if split_floor and cause is StallCause.UNKNOWN:
        cause = StallCause.SPLIT_FLOOR
    elif cause is StallCause.UNKNOWN and proof is None:
        # What keeps stock's split at 0 here (the cause, not the proof): the boundary's.
        if speculative is None:
            facts = own_inputs(
                scheduler, request, streak.position,
                _boundary_end(scheduler, request, streak.position),
            )  # fmt: skip
        if _held_by_others(scheduler, facts):
            cause = StallCause.SHARED_CACHE
    streak.cause = cause
    note = "" if end_after is None else _end_note(scheduler, proof, end_after)
    report = dataclasses.replace(report, cause=cause, end_note=note)
    extra = fields(
        "stall-named", request_id=report.request_id, position=report.position,
        prompt_tokens=report.prompt_tokens, cause=cause.value, seconds=round(report.seconds, 3),
        steps=report.steps,
    )  # fmt: skip
    logger.warning("vllm-mamba-fix: %s", report.message(), extra=extra)


def _end_note(scheduler: Any, proof: str | None, end_after: float) -> str:
    """What the stall end will do with a stall just named, for its WARNING."""
    if proof is None:
        return (
            "; not ended while its own encoder inputs fit and it may be waiting for "
            "cache space or budget that a request which can still move holds: only if "
            "every request holding that space is stalled on a hold too (a deadlock)"
        )
    why_not = support_of(scheduler)
    if why_not:
        return f"; {proof}; not ended: {why_not}"
    return (
        f"; {proof}; the plugin ends it {end_after:g} s from now if it has not moved "
        f"({ENV_END_STALLS_AFTER}=off keeps it)"
    )


def consider(
    scheduler: Any,
    request: Any,
    store: ZeroStreaks,
    streak: Streak,
    now: float,
    end_after: float,
    window_end: int,
) -> None:
    """Another 0 of a named stall: order its end once the bound is past and it is proven."""
    streak.steps_named += 1
    streak.window_end = window_end
    # An unproven stall is looked at again once a second, not on every step.
    if not end_due(streak, now, end_after) or now < streak.unproven_until:
        return
    proof = own_inputs_proof(scheduler, request, streak.position, window_end)
    if proof is None:
        proof = _cross_proof(scheduler, request)
        if proof is not None and streak.cause in (None, StallCause.UNKNOWN):
            streak.cause = StallCause.SHARED_CACHE
    if proof is None or support_of(scheduler) is not None:
        streak.unproven_until = now + RECHECK_SECONDS
        return
    streak.ordered = True
    cause = streak.cause or StallCause.UNKNOWN
    why, remedy = CAUSE_TEXT[cause]
    named_for = now - (streak.named_at or now)
    rid = request.request_id
    where = f"token {streak.position} of {request.num_prompt_tokens}"
    log_line = (
        f"ended request {rid}: 0 tokens at {where} for {now - streak.since:.0f} s, "
        f"{named_for:.0f} s after it was named ({ENV_END_STALLS_AFTER}={end_after:g}); "
        f"{proof}; cause: {cause.value}; remedy: {remedy}"
    )
    message = (
        f"vllm-mamba-fix ended this request: it could not get past prompt {where} "
        f"({proof}); likely cause: {why}; remedy: {remedy}"
    )
    order = EndOrder(rid, streak.position, request.num_computed_tokens, store, streak,
                     log_line, message)  # fmt: skip
    order_end(scheduler, order)


# -- the watchdog's one look per step: the update wrapper's -----------------------------------


@dataclasses.dataclass
class _Watch:
    """One scheduler's watchdog: its streaks, and the steps and time since its last sample."""

    store: ZeroStreaks
    last: float = float("-inf")
    steps: int = 0


# Per scheduler, weakly: its watch (the streaks of the stops counted there).
_watches: weakref.WeakKeyDictionary[Any, _Watch] = weakref.WeakKeyDictionary()
Observer = Callable[[Any, Any], None]


def make_observer(seconds: float, end_after: float | None) -> Observer:
    """The watchdog's per-step look, for the ``update_from_output`` wrapper to call with the
    scheduler and the step's ``scheduler_output``: one clock read and a compare per step, and
    a sample (one pass over the requests that can stop) once ``SAMPLE_SECONDS`` passed."""

    def observe(scheduler: Any, scheduler_output: Any) -> None:
        watch = _watches.get(scheduler)
        if watch is None:
            watch = _watches[scheduler] = _Watch(ZeroStreaks())
        watch.steps += 1
        now = clock()
        if now - watch.last < SAMPLE_SECONDS:
            return
        steps, watch.steps, watch.last = watch.steps, 0, now
        sample(scheduler, scheduler_output, watch.store, now, steps, (seconds, end_after))

    return observe


def sample(
    scheduler: Any,
    scheduler_output: Any,
    store: ZeroStreaks,
    now: float,
    steps: int,
    bounds: tuple[float, float | None],
) -> None:
    """One look: the streaks that moved end; each request that stopped in a step that left
    token budget unused counts ``steps`` 0s (``bounds``: the naming seconds, the end's)."""
    _end_moved(scheduler, store)
    if not budget_left(scheduler, scheduler_output):
        return  # a step that used its budget says nothing of who waits for it
    for request in candidates(scheduler, scheduler_output):
        _count(scheduler, request, store, now, steps, bounds)


def _end_moved(scheduler: Any, store: ZeroStreaks) -> None:
    """A streak whose request moved ends ("moves again" if named); a gone one is dropped."""
    for rid, streak in list(store.by_request.items()):
        request = scheduler.requests.get(rid)
        if request is not None and not request.is_finished():
            if start_of(scheduler, request) == streak.position:
                continue
            if streak.warned:
                log_moving_again(rid, streak.position)
        store.clear(rid)


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


def budget_left(scheduler: Any, scheduler_output: Any) -> bool:
    """Whether the step left at least the smallest chunk of its token budget unused."""
    used = int(scheduler_output.total_num_scheduled_tokens)
    return int(scheduler.max_num_scheduled_tokens) - used >= least_chunk(scheduler)


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
    hit = manager.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
    return int(hit[1])


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
        head = _waiting_head(scheduler)
        if head is not None and head.request_id not in scheduled and _in_prefill(head):
            found.append(head)
    return found


def _waiting_head(scheduler: Any) -> Any:
    """The first unfinished request the waiting loop would take (waiting or preempted)."""
    for request in scheduler.waiting:
        if not request.is_finished() and request.status.name in _ADMITTED:
            return request
    return None


_ADMITTED = ("WAITING", "PREEMPTED")


def _count(
    scheduler: Any,
    request: Any,
    store: ZeroStreaks,
    now: float,
    steps: int,
    bounds: tuple[float, float | None],
) -> None:
    """A stop of ``request``: its streak counts; named once due, then its end considered."""
    seconds, end_after = bounds
    rid, position = request.request_id, start_of(scheduler, request)
    streak, moved = store.zero(rid, position, now, steps)
    if moved is not None and moved.warned:
        log_moving_again(rid, moved.position)
    if not streak.warned and not watchdog_due(streak, now, seconds):
        return
    window_end = split_window_end(scheduler, request, position)
    if streak.warned:
        if end_after is not None:
            consider(scheduler, request, store, streak, now, end_after, window_end)
        return
    speculative = speculative_zero(scheduler, request, position, streak)
    name_stall(scheduler, request, store, streak, now, end_after, window_end, speculative)


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


def log_moving_again(request_id: str, position: int) -> None:
    counters.record_stall(resolved=True, request_id=request_id)
    logger.info(
        "vllm-mamba-fix: request %s moves again (was stalled at token %d)",
        request_id,
        position,
        extra=fields("stall-moved", request_id=request_id, position=position),
    )


def forget_named() -> None:
    """Drop every named stall and every scheduler's watch (unregister(), tests)."""
    _named.clear()
    _watches.clear()
