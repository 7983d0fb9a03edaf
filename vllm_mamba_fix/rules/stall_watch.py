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
"""The watchdog: its look (``stall_look``, once per step) hands a long streak here to be named
(one WARNING, :func:`name_stall`); a named stall still there ``end_stalls_after`` seconds and
two samples later is ordered to end (:func:`consider`) if its own encoder inputs keep it there
whatever others do, or it is the one victim of stalls holding the space each other needs. The
order is carried out at the next step (``stall_end``). No vLLM import."""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from vllm_mamba_fix._log import fields, logger
from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.decide.stalls import (
    CAUSE_TEXT,
    StallCause,
    StallReport,
    Streak,
    end_due,
    own_inputs_block,
    stall_cause,
)
from vllm_mamba_fix.facts.blocks import known_block_size
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
)
from vllm_mamba_fix.rules.end_order import EndOrder, order_end, ordered, support_of
from vllm_mamba_fix.rules.zero_streaks import ZeroStreaks

RECHECK_SECONDS = 1.0  # an unproven stall is looked at again once a second, not on every step
clock: Callable[[], float] = time.monotonic  # read once per step by its look; tests put theirs


class Named(weakref.WeakKeyDictionary[Any, dict[str, tuple[ZeroStreaks, Streak]]]):
    """The session's memory: per scheduler, request id -> (store, streak) of a named stall."""


def _held_by_others(scheduler: Any, facts: OwnInputs | None) -> bool:
    """Whether the inputs it needs fit alone but not in the space others leave now."""
    if facts is None:
        return False
    held, needed, _, _ = facts
    due = sum(n for key, n in needed.items() if key not in held)
    return due > int(getattr(scheduler.encoder_cache_manager, "num_freeable_slots", due))


def _named_stalls(scheduler: Any) -> dict[str, Stalled]:
    """The stalls named on ``scheduler`` still there (the others are forgotten)."""
    named = installation.memory[Named].get(scheduler) or {}
    stalled: dict[str, Stalled] = {}
    for rid, (store, streak) in list(named.items()):
        request = scheduler.requests.get(rid)
        if request is None or store.by_request.get(rid) is not streak or request.is_finished():
            del named[rid]  # it moved, finished or was freed
        # A waiting request counts from 0 (its prefix hit is not computed yet).
        elif streak.window_end is not None and request.num_computed_tokens in (0, streak.position):
            stalled[rid] = (request, streak.position, streak.window_end)
    return stalled


def _split_rule(scheduler: Any) -> Any:
    options = getattr(getattr(type(scheduler), SPLIT_METHOD, None), MARKER, None)
    return options if getattr(options, "deadlock_rules", False) else None


def split_window_end(scheduler: Any, request: Any, position: int) -> int:
    """End of the smallest chunk the split does not floor to 0: where the split rule acts, one
    token past the cut's look-ahead (0.28's order); else the next boundary."""
    options = _split_rule(scheduler)
    if options is not None and options.scope.in_scope(request):
        end = position + 1 + encoder_cut_shift(scheduler)
        return min(end, int(request.num_prompt_tokens))
    return _boundary_end(scheduler, request, position)


def _boundary_end(scheduler: Any, request: Any, position: int) -> int:
    units = [int(scheduler.cache_config.block_size)]
    with contextlib.suppress(Exception):
        units.append(known_block_size(scheduler))
    unit = min(u for u in units if u > 0)
    return min((position // unit + 1) * unit, int(request.num_prompt_tokens))


def _report(scheduler: Any, request: Any, streak: Streak, now: float) -> StallReport:
    manager, position = scheduler.encoder_cache_manager, streak.position
    held_ids = manager.get_cached_input_ids(request)
    spans = [(f.mm_position.offset, f.mm_position.length) for f in request.mm_features]
    waited = next(
        (i for i, (o, n) in enumerate(spans) if i not in held_ids and o + n > position), None
    )
    waited_facts = None if waited is None else (*spans[waited], num_embeds(request, waited))
    budget = int(getattr(scheduler, "max_num_encoder_input_tokens", manager.cache_size))
    return StallReport(
        request.request_id, position, request.num_prompt_tokens, streak.steps,
        now - streak.since, tuple(spans[i] for i in sorted(held_ids)), waited_facts,
        manager.cache_size, manager.num_free_slots, budget, streak.cause or StallCause.UNKNOWN,
    )  # fmt: skip


class Heard(NamedTuple):
    store: ZeroStreaks  # the scheduler's streaks
    streak: Streak
    now: float  # the watchdog's clock
    end_after: float | None  # VLLM_MAMBA_FIX_END_STALLS_AFTER (None: named only)
    window_end: int  # end of the smallest chunk the split does not floor to 0


def name_stall(scheduler: Any, request: Any, heard: Heard, speculative: bool | None) -> None:
    """One WARNING; ``speculative`` as ``stall_look.speculative_zero`` says (None: split floor)."""
    store, streak, now, end_after, window_end = heard
    streak.warned, streak.named_at, streak.window_end = True, now, window_end
    _named_stalls(scheduler)  # forget the stalls that ended since
    installation.memory[Named].setdefault(scheduler, {})[request.request_id] = (store, streak)
    counters.record_stall(request_id=request.request_id, stalled_for=now - streak.since)
    report = _report(scheduler, request, streak, now)
    waited = report.waited[2] if report.waited else None
    cause = stall_cause(bool(speculative), waited, report.cache_size, report.compute_budget)
    facts = own_inputs(scheduler, request, streak.position, window_end)
    proof = None if facts is None else own_inputs_block(*facts)
    split_floor = speculative is None and request.mm_features and _split_rule(scheduler) is None
    if split_floor and cause is StallCause.UNKNOWN:
        cause = StallCause.SPLIT_FLOOR
    elif cause is StallCause.UNKNOWN and proof is None:
        # What keeps stock's split at 0 here (the cause, not the proof): the boundary's.
        if speculative is None:
            end = _boundary_end(scheduler, request, streak.position)
            facts = own_inputs(scheduler, request, streak.position, end)
        if _held_by_others(scheduler, facts):
            cause = StallCause.SHARED_CACHE
    streak.cause = cause
    note = "" if end_after is None else _end_note(scheduler, proof, end_after)
    report = report._replace(cause=cause, end_note=note)
    extra = fields(
        "stall-named", request_id=report.request_id, position=report.position,
        prompt_tokens=report.prompt_tokens, cause=cause.value, seconds=round(report.seconds, 3),
        steps=report.steps,
    )  # fmt: skip
    logger.warning("vllm-mamba-fix: %s", report.message(), extra=extra)


def _end_note(scheduler: Any, proof: str | None, end_after: float) -> str:
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


def consider(scheduler: Any, request: Any, heard: Heard) -> None:
    """Another 0 of a named stall: order its end once the bound is past and it is proven."""
    store, streak, now, end_after, window_end = heard
    if end_after is None:
        return
    streak.steps_named += 1
    streak.window_end = window_end
    if not end_due(streak, now, end_after) or now < streak.unproven_until:
        return
    proof = own_inputs_proof(scheduler, request, streak.position, window_end)
    if proof is None:
        proof = cross_hold_proof(scheduler, request, _named_stalls(scheduler), ordered(scheduler))
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


def log_moving_again(request_id: str, position: int) -> None:
    counters.record_stall(resolved=True, request_id=request_id)
    extra = fields("stall-moved", request_id=request_id, position=position)
    line = "vllm-mamba-fix: request %s moves again (was stalled at token %d)"
    logger.info(line, request_id, position, extra=extra)
