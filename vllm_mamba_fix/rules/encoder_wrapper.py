# Rule:     speculative-stall (Rule.SPECULATIVE_STALL in rules/table.py; off with VLLM_MAMBA_FIX=0)
# Answers:  the speculative stall under EAGLE-type speculation: from 0.24.0 vLLM frees an
#           encoder input only past the drafter's look-ahead (vLLM #46315) and cuts before the
#           next one by that shift, so a request whose images sit closer than that parks at 0
#           tokens (reported on vLLM #47738 and vllm-ascend #17195).
# Runs on:  0.24.0-0.32.x; before 0.24 the model runner asserts on an encoder-cache miss, so
#           the watchdog names such a stall and the stall end ends it instead.
# Decided:  by the scheduler class's code (facts/evidence.py: an encoder free deferred by a
#           look-ahead), by the version where it cannot tell (decide/policy.py:
#           speculative_verdict).
# Removed:  0.33.0 frees without the delay and cuts without the shift: the rule goes with the
#           last supported 0.32. This wrapper stays the watchdog's ear on the encoder-input
#           check while the watchdog runs (rules/stall_watch.py).
"""The wrapper of ``Scheduler._try_schedule_encoder_inputs``: the speculative-stall rule,
the stall watchdog and the stall end's decision (:mod:`vllm_mamba_fix.rules.stall_end` ends the
request), and the split rule's ear: every call's answer is noted for the split that vLLM
asks next (:mod:`vllm_mamba_fix.rules.encoder_cut`). Only a result of
0 tokens is looked at; every other call returns vLLM's result after a dict check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_mamba_fix._log import failure_reporter
from vllm_mamba_fix.decide import stalls
from vllm_mamba_fix.decide.decision import Action, speculative_stall_release, unshifted_cut_needed
from vllm_mamba_fix.decide.scope import ScopePolicy
from vllm_mamba_fix.decide.stalls import REPEATED, ZeroStreaks, watchdog_due
from vllm_mamba_fix.facts.blocks import block_size_of
from vllm_mamba_fix.facts.targets import MARKER
from vllm_mamba_fix.observe import counters
from vllm_mamba_fix.rules import encoder_cut, stall_watch
from vllm_mamba_fix.rules.stall_watch import log_moving_again


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


EncoderResult = tuple[Any, ...]


def make_encoder_wrapper(
    original: Callable[..., EncoderResult], options: EncoderOptions
) -> Callable[..., EncoderResult]:
    """Wrap ``_try_schedule_encoder_inputs``; only a result of 0 tokens is looked at."""
    zeros = ZeroStreaks()
    streaks = zeros.by_request
    fall_back = failure_reporter("the encoder-input check")

    def on_progress(request: Any) -> None:
        streak = zeros.clear(request.request_id)
        if streak is not None and streak.warned:
            log_moving_again(request.request_id, streak.position)

    def on_zero(
        self: Any,
        request: Any,
        num_computed_tokens: int,
        num_new_tokens: int,
        encoder_compute_budget: int,
        shift_computed_tokens: int,
        result: EncoderResult,
    ) -> EncoderResult:
        # The watchdog hears every request's 0; the speculative-stall rule acts in scope only.
        if options.stall_seconds is None and not options.scope.in_scope(request):
            return result
        rid = request.request_id
        now = stalls.clock()
        streak, moved = zeros.zero(rid, num_computed_tokens, now)
        if moved is not None and moved.warned:
            log_moving_again(rid, moved.position)
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
        retried = (
            options.release_speculative_stalls
            and stalled
            and repeated
            and options.scope.in_scope(request)
        )
        if retried:
            for input_id in release.to_free:
                _free_encoder_input(self, request, input_id)
            retry = original(
                self, request, num_computed_tokens, num_new_tokens, encoder_compute_budget, 0
            )
            if retry[1]:
                zeros.clear(rid)
                counters.record(
                    Action.SPECULATIVE_STALL_RELEASED, rid, num_computed_tokens, retry[1],
                    block_size_of(self),
                )  # fmt: skip
                return retry
        seconds = options.stall_seconds
        if seconds is None:
            return result
        end_after = options.end_stalls_after
        # The smallest chunk vLLM would not cut to 0: one token past the look-ahead
        # vLLM checks (none where the speculative rule retried without it).
        window_end = num_computed_tokens + 1 + (0 if retried else shift_computed_tokens)
        if streak.warned:
            if end_after is not None:
                stall_watch.consider(self, request, zeros, streak, now, end_after, window_end)
        elif watchdog_due(streak, now, seconds):
            stall_watch.name_stall(
                self, request, zeros, streak, now, end_after, window_end, stalled
            )
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
            else:
                result = on_zero(
                    self,
                    request,
                    num_computed_tokens,
                    num_new_tokens,
                    encoder_compute_budget,
                    shift_computed_tokens,
                    result,
                )
            encoder_cut.note(self, request, num_computed_tokens, num_new_tokens, result[1])
            return result
        except Exception as exc:
            return fall_back(exc, result)

    functools.update_wrapper(wrapper, original)
    setattr(wrapper, MARKER, options)
    return wrapper
