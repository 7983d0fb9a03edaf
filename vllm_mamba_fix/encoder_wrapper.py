"""The wrapper of ``Scheduler._try_schedule_encoder_inputs``: the speculative-stall rule and
the stall watchdog. Only a result of 0 tokens is looked at; every other call returns
vLLM's result after one dict check.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_mamba_fix import counters
from vllm_mamba_fix._log import logger
from vllm_mamba_fix.blocks import block_unit_of
from vllm_mamba_fix.decision import Action, speculative_stall_release, unshifted_cut_needed
from vllm_mamba_fix.scope import ScopePolicy
from vllm_mamba_fix.stalls import REPEATED, StallReport, ZeroStreaks, stall_cause, watchdog_due
from vllm_mamba_fix.targets import MARKER
from vllm_mamba_fix.wrappers import failure_reporter


@dataclass(frozen=True)
class EncoderOptions:
    """Options of the encoder wrapper."""

    scope: ScopePolicy
    # End the EAGLE encoder-cache deadlock (0.24-0.32).
    release_speculative_stalls: bool
    # Seconds of 0 tokens before the watchdog names a stall; None: off.
    stall_seconds: float | None
    # Seconds after a named stall no rule can end before its request is ended; None: off.
    end_stalls_after: float | None = None


def _num_embeds(request: Any, input_id: int) -> int:
    getter = getattr(request, "get_num_encoder_embeds", None)
    if getter is not None:
        return int(getter(input_id))
    return int(request.mm_features[input_id].mm_position.length)


def _free_encoder_input(scheduler: Any, request: Any, input_id: int) -> None:
    """Free through vLLM's own path, so the freed entry reaches the workers as usual."""
    free = getattr(scheduler, "_free_encoder_input", None)  # 0.32+: also tells the EC connector
    if free is not None:
        free(request, input_id)
    else:
        scheduler.encoder_cache_manager.free_encoder_input(request, input_id)


def _placeholder(request: Any, input_id: int) -> tuple[int, int]:
    position = request.mm_features[input_id].mm_position
    return position.offset, position.length


def _stall_report(
    scheduler: Any,
    request: Any,
    computed: int,
    held: dict[int, tuple[int, int]],
    speculative: bool,
    steps: int,
    seconds: float,
) -> StallReport:
    manager = scheduler.encoder_cache_manager
    waited = next(
        (
            i
            for i, feature in enumerate(request.mm_features)
            if i not in held and feature.mm_position.offset + feature.mm_position.length > computed
        ),
        None,
    )
    waited_facts = None
    if waited is not None:
        position = request.mm_features[waited].mm_position
        waited_facts = (position.offset, position.length, _num_embeds(request, waited))
    budget = int(getattr(scheduler, "max_num_encoder_input_tokens", manager.cache_size))
    return StallReport(
        request_id=request.request_id,
        position=computed,
        prompt_tokens=request.num_prompt_tokens,
        steps=steps,
        seconds=seconds,
        held=tuple(held[i] for i in sorted(held)),
        waited=waited_facts,
        cache_size=manager.cache_size,
        cache_free=manager.num_free_slots,
        compute_budget=budget,
        cause=stall_cause(
            speculative, waited_facts[2] if waited_facts else None, manager.cache_size, budget
        ),
    )


EncoderResult = tuple[Any, ...]


def make_encoder_wrapper(
    original: Callable[..., EncoderResult], options: EncoderOptions
) -> Callable[..., EncoderResult]:
    """Wrap ``_try_schedule_encoder_inputs``; only a result of 0 tokens is looked at."""
    zeros = ZeroStreaks()
    streaks = zeros.by_request
    fall_back = failure_reporter("the encoder-input check")
    clock = time.monotonic

    def on_progress(request: Any) -> None:
        streak = zeros.clear(request.request_id)
        if streak is not None and streak.warned:
            _log_moving_again(request.request_id, streak.position)

    def on_zero(
        self: Any,
        request: Any,
        num_computed_tokens: int,
        num_new_tokens: int,
        encoder_compute_budget: int,
        shift_computed_tokens: int,
        result: EncoderResult,
    ) -> EncoderResult:
        if not options.scope.in_scope(request):
            return result
        rid = request.request_id
        now = clock()
        streak, moved = zeros.zero(rid, num_computed_tokens, now)
        if moved is not None and moved.warned:
            _log_moving_again(rid, moved.position)
        manager = self.encoder_cache_manager
        held = {i: _placeholder(request, i) for i in sorted(manager.get_cached_input_ids(request))}
        release = speculative_stall_release(num_computed_tokens, shift_computed_tokens, held)
        # The second 0 at the same position: a one-step defer (async's lagging
        # free) has cleared by then, a stall has not.
        repeated = streak.steps >= REPEATED
        # Or two uncached inputs within the shift (a warm repeat's prefix hit);
        # looked for only once the 0 repeats.
        unshifted = (
            repeated
            and not release.stalled
            and unshifted_cut_needed(
                num_computed_tokens, shift_computed_tokens,
                {i: _placeholder(request, i) for i in range(len(request.mm_features))}, held,
            )
        )  # fmt: skip
        stalled = release.stalled or unshifted
        if options.release_speculative_stalls and stalled and repeated:
            for input_id in release.to_free:
                _free_encoder_input(self, request, input_id)
            retry = original(
                self, request, num_computed_tokens, num_new_tokens, encoder_compute_budget, 0
            )
            if retry[1]:
                zeros.clear(rid)
                counters.record(
                    Action.SPECULATIVE_STALL_RELEASED, rid, num_computed_tokens, retry[1],
                    block_unit_of(self),
                )  # fmt: skip
                return retry
        seconds = options.stall_seconds
        if seconds is not None and watchdog_due(streak, now, seconds):
            streak.warned = True
            counters.record_stall()
            report = _stall_report(
                self, request, num_computed_tokens, held, stalled, streak.steps,
                now - streak.since,
            )  # fmt: skip
            logger.warning("vllm-mamba-fix: %s", report.message())
        return result

    def wrapper(
        self: Any,
        request: Any,
        num_computed_tokens: int,
        num_new_tokens: int,
        encoder_compute_budget: int,
        shift_computed_tokens: int = 0,
    ) -> EncoderResult:
        result = original(
            self,
            request,
            num_computed_tokens,
            num_new_tokens,
            encoder_compute_budget,
            shift_computed_tokens,
        )
        try:
            if result[1] or not num_new_tokens:
                if streaks and request.request_id in streaks:
                    on_progress(request)
                return result
            return on_zero(
                self,
                request,
                num_computed_tokens,
                num_new_tokens,
                encoder_compute_budget,
                shift_computed_tokens,
                result,
            )
        except Exception as exc:
            return fall_back(exc, result)

    functools.update_wrapper(wrapper, original)
    setattr(wrapper, MARKER, options)
    return wrapper


def _log_moving_again(request_id: str, position: int) -> None:
    counters.record_stall(resolved=True)
    logger.info(
        "vllm-mamba-fix: request %s moves again (was stalled at token %d)", request_id, position
    )
