# Carrier of: speculative-stall (rules/speculative_stall.py) and the split rule's ear.
"""The wrapper of ``Scheduler._try_schedule_encoder_inputs``: the speculative-stall rule's
carrier, and the split rule's ear (a cut is noted for the split vLLM asks next). Per call: a
result with tokens ends the request's streak of 0s; an in-scope 0 counts for the rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from vllm_mamba_fix._log import failure_reporter
from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.decide.scope import ScopePolicy
from vllm_mamba_fix.decide.stalls import REPEATED
from vllm_mamba_fix.rules import encoder_cut, speculative_stall
from vllm_mamba_fix.rules.marking import marked
from vllm_mamba_fix.rules.speculative_stall import EncoderCall, EncoderResult
from vllm_mamba_fix.rules.split_settle import block_size_of
from vllm_mamba_fix.rules.zero_streaks import ZeroStreaks


class EncoderOptions(NamedTuple):
    """Options of the encoder wrapper."""

    scope: ScopePolicy
    # End the EAGLE encoder-cache deadlock (0.24-0.32).
    release_speculative_stalls: bool


def make_encoder_wrapper(
    original: Callable[..., EncoderResult], options: EncoderOptions
) -> Callable[..., EncoderResult]:
    """Wrap ``_try_schedule_encoder_inputs``; only a result of 0 tokens is looked at."""
    zeros = ZeroStreaks()
    streaks = zeros.by_request
    on_zero = _zero_handler(original, options, zeros)
    fall_back = failure_reporter("the encoder-input check")
    # The session's note, held to forget a cut at every uncut answer (a cut, rare, is noted
    # through encoder_cut.note); the session that made the wrapper removes it.
    cuts = installation.memory[encoder_cut.EncoderNote]

    def wrapper(
        self: Any,
        request: Any,
        num_computed_tokens: int,
        num_new_tokens: int,
        encoder_compute_budget: int,
        shift_computed_tokens: int = 0,
    ) -> EncoderResult:
        result = original(self, request, num_computed_tokens, num_new_tokens,
                          encoder_compute_budget, shift_computed_tokens)  # fmt: skip
        try:
            given = result[1]
            if given >= num_new_tokens:  # uncut: no note for the split vLLM asks next
                cuts.last = None
            else:
                if not given and on_zero is not None:
                    call = EncoderCall(
                        self, request, num_computed_tokens, num_new_tokens,
                        encoder_compute_budget, shift_computed_tokens,
                    )  # fmt: skip
                    result = on_zero(call, result)
                    given = result[1]
                encoder_cut.note(self, request, num_computed_tokens, num_new_tokens, given)
                if not given:
                    return result  # a 0: its streak goes on
            if streaks and request.request_id in streaks:
                zeros.clear(request.request_id)
            return result
        except Exception as exc:
            return fall_back(exc, result)

    return marked(wrapper, original, options)


def _zero_handler(
    original: Callable[..., EncoderResult], options: EncoderOptions, zeros: ZeroStreaks
) -> Callable[..., EncoderResult] | None:
    """What a 0 of the check meets: its streak and the speculative-stall rule (None: off)."""
    if not options.release_speculative_stalls:
        return None
    scope = options.scope

    def on_zero(call: EncoderCall, result: EncoderResult) -> EncoderResult:
        self, request, computed = call.scheduler, call.request, call.computed
        if not scope.in_scope(request):
            return result  # the rule acts in scope only
        rid = request.request_id
        streak, _ = zeros.zero(rid, computed, 0.0)  # the repeat counts, not the time
        # The second 0 at the same position: a one-step defer (async's lagging free) has
        # cleared by then, a stall has not.
        if streak.steps < REPEATED:
            return result
        stalled, to_free = speculative_stall.stalled_inputs(
            self, request, computed, call.shift, streak
        )
        if not stalled:
            return result
        retry = speculative_stall.release(original, call, to_free, block_size_of(self))
        if retry is None:
            return result
        zeros.clear(rid)
        return retry

    return on_zero
