# Carrier of: speculative-stall (rules/speculative_stall.py), the stall-watchdog's ear on the
#             encoder check (rules/stall_watch.py), the split rule's ear (rules/encoder_cut.py).
"""The wrapper of ``Scheduler._try_schedule_encoder_inputs``: the carrier of the
speculative-stall rule (:mod:`vllm_mamba_fix.rules.speculative_stall`), the watchdog's ear on the
encoder-input check (:mod:`vllm_mamba_fix.rules.stall_watch`), and the split rule's ear: every
call's answer is noted for the split that vLLM asks next
(:mod:`vllm_mamba_fix.rules.encoder_cut`).

Per call: vLLM's answer; a result with tokens returns after a dict check (and ends a streak of
0s the request had); a result of 0 tokens is counted and handed to the rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_mamba_fix._log import failure_reporter
from vllm_mamba_fix.decide.scope import ScopePolicy
from vllm_mamba_fix.decide.stalls import REPEATED
from vllm_mamba_fix.rules import encoder_cut, speculative_stall, stall_watch
from vllm_mamba_fix.rules.marking import marked
from vllm_mamba_fix.rules.speculative_stall import EncoderResult
from vllm_mamba_fix.rules.split_settle import block_size_of
from vllm_mamba_fix.rules.stall_watch import log_moving_again
from vllm_mamba_fix.rules.zero_streaks import ZeroStreaks


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


def make_encoder_wrapper(
    original: Callable[..., EncoderResult], options: EncoderOptions
) -> Callable[..., EncoderResult]:
    """Wrap ``_try_schedule_encoder_inputs``; only a result of 0 tokens is looked at."""
    zeros = ZeroStreaks()
    streaks = zeros.by_request
    on_zero = _zero_handler(original, options, zeros)
    fall_back = failure_reporter("the encoder-input check")

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
            if not result[1] and num_new_tokens:
                result = on_zero(
                    self, request, num_computed_tokens, num_new_tokens,
                    encoder_compute_budget, shift_computed_tokens, result,
                )  # fmt: skip
            elif streaks and request.request_id in streaks:
                streak = zeros.clear(request.request_id)
                if streak is not None and streak.warned:
                    log_moving_again(request.request_id, streak.position)
            encoder_cut.note(self, request, num_computed_tokens, num_new_tokens, result[1])
            return result
        except Exception as exc:
            return fall_back(exc, result)

    return marked(wrapper, original, options)


def _zero_handler(
    original: Callable[..., EncoderResult], options: EncoderOptions, zeros: ZeroStreaks
) -> Callable[..., EncoderResult]:
    """What a 0 of the check meets: its streak, the speculative-stall rule, the watchdog."""
    scope = options.scope
    seconds = options.stall_seconds
    end_after = options.end_stalls_after

    def on_zero(
        self: Any,
        request: Any,
        computed: int,
        asked: int,
        encoder_budget: int,
        shift: int,
        result: EncoderResult,
    ) -> EncoderResult:
        # The watchdog hears every request's 0; the speculative-stall rule acts in scope only.
        if seconds is None and not scope.in_scope(request):
            return result
        rid = request.request_id
        now = stall_watch.clock()
        streak, moved = zeros.zero(rid, computed, now)
        if moved is not None and moved.warned:
            log_moving_again(rid, moved.position)
        stalled, to_free = speculative_stall.stalled_inputs(self, request, computed, shift, streak)
        # The second 0 at the same position: a one-step defer (async's lagging free) has
        # cleared by then, a stall has not.
        retried = (
            options.release_speculative_stalls
            and stalled
            and streak.steps >= REPEATED
            and scope.in_scope(request)
        )
        if retried:
            retry = speculative_stall.release(
                original, self, request, computed, asked, encoder_budget, to_free,
                block_size_of(self),
            )  # fmt: skip
            if retry is not None:
                zeros.clear(rid)
                return retry
        if seconds is not None:
            # The smallest chunk vLLM would not cut to 0: one token past the look-ahead vLLM
            # checks (none where the speculative rule retried without it).
            window_end = computed + 1 + (0 if retried else shift)
            stall_watch.hear(
                self, request, zeros, streak, now, seconds, end_after, window_end, stalled
            )
        return result

    return on_zero
