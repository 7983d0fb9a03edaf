# Rule:     speculative-stall (Rule.SPECULATIVE_STALL in rules/table.py; off with VLLM_MAMBA_FIX=0)
# Answers:  the speculative stall under EAGLE-type speculation: from 0.24.0 vLLM frees an
#           encoder input only past the drafter's look-ahead (vLLM #46315) and cuts before the
#           next one by that shift, so a request whose images sit closer than that parks at 0
#           tokens (reported on vLLM #47738 and vllm-ascend #17195).
# Runs on:  0.24.0-0.32.x; before 0.24 the model runner asserts on an encoder-cache miss, so
#           the watchdog names such a stall and the stall end ends it instead.
# Decided:  by the scheduler class's code (facts/evidence.py: an encoder free deferred by a
#           look-ahead), by the version where it cannot (decide/policy.py: speculative_verdict).
# Removed:  0.33.0 frees without the delay and cuts without the shift: the rule goes with the
#           last supported 0.32 (its carrier stays the split rule's ear while that rule runs).
"""The speculative-stall rule, per 0 of the encoder-input check (carried by
``encoder_wrapper``): where ``stalled_inputs`` says the 0 is the stall, it frees the held
inputs the request is past and asks again without the shift; a retry with tokens is the answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from vllm_mamba_fix.decide.decision import Action
from vllm_mamba_fix.observe import counters

# Whether a 0 is the speculative stall: encoder_facts.py's, which the watchdog asks too.
from vllm_mamba_fix.rules.encoder_facts import stalled_inputs as stalled_inputs

EncoderResult = tuple[Any, ...]


class EncoderCall(NamedTuple):  # one call of vLLM's encoder-input check
    scheduler: Any
    request: Any
    computed: int  # num_computed_tokens
    asked: int  # num_new_tokens
    encoder_budget: int  # encoder_compute_budget
    shift: int  # shift_computed_tokens: the drafter's look-ahead (0 without EAGLE)


def release(
    check: Callable[..., EncoderResult],
    call: EncoderCall,
    to_free: tuple[int, ...],
    block_size: int,
) -> EncoderResult | None:
    """Free ``to_free``, ask ``check`` again unshifted: its answer if it gives tokens, else None."""
    scheduler, request, computed = call.scheduler, call.request, call.computed
    # vLLM's own path, so the freed entry reaches the workers (0.32+: the EC connector too).
    free = getattr(scheduler, "_free_encoder_input", None)
    for input_id in to_free:
        (free or scheduler.encoder_cache_manager.free_encoder_input)(request, input_id)
    retry = check(scheduler, request, computed, call.asked, call.encoder_budget, 0)
    if not retry[1]:
        return None
    counters.record(
        Action.SPECULATIVE_STALL_RELEASED, request.request_id, computed, retry[1], block_size
    )
    return retry
