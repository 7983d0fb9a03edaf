# Carrier of: split (rules/split_rule.py) and block-unit (rules/block_unit.py).
"""The wrappers around ``Scheduler`` methods; :mod:`vllm_mamba_fix.install.patch` installs them.

- ``_mamba_block_aligned_split``: the carrier of the split and block-unit rules. Per call,
  top to bottom: the scheduler's settled state (:mod:`vllm_mamba_fix.rules.split_settle`);
  a scheduler where no rule can act gets vLLM's answer; one where the block-unit rule
  engaged asks vLLM through the cache's block (:mod:`vllm_mamba_fix.rules.block_unit`);
  then :func:`make_look` returns an answer no rule acts on after a few comparisons, and
  hands the others to the split rule's corrector (:mod:`vllm_mamba_fix.rules.split_rule`).
- ``_try_schedule_encoder_inputs``: in :mod:`vllm_mamba_fix.rules.encoder_wrapper`.
- ``__init__``: runs the per-scheduler check once the scheduler is built.
- ``_free_request``: per-request state ends with the request.

Each original stays reachable as ``__wrapped__``. A wrapper never raises anything of its own
into vLLM: vLLM's own exceptions propagate, the plugin's never do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from vllm_mamba_fix._log import failure_reporter
from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.decide.decision import can_need_correction, crosses_next_boundary
from vllm_mamba_fix.decide.scope import builtin_scope
from vllm_mamba_fix.facts.blocks import SPLIT_ATTR, SplitState
from vllm_mamba_fix.facts.config import Scope
from vllm_mamba_fix.facts.targets import MARKER, SPLIT_METHOD, Args, Kwargs
from vllm_mamba_fix.observe import counters, record
from vllm_mamba_fix.rules import block_unit
from vllm_mamba_fix.rules.block_unit import Engaged, Look
from vllm_mamba_fix.rules.marking import marked
from vllm_mamba_fix.rules.split_rule import (
    NOT_GIVEN,
    WrapOptions,
    extra_computed_tokens,
    has_known_parameters,
    make_corrector,
)
from vllm_mamba_fix.rules.split_settle import settle
from vllm_mamba_fix.rules.zero_streaks import forget_request

StateOf = Callable[[Any], SplitState]
NO_KWARGS: Kwargs = {}  # the known signature's keywords: none (only ever unpacked, never changed)


def settle_if_differs(scheduler: Any) -> None:
    """At construction, where the block sizes already differ: settle the split now."""
    wrapper = getattr(type(scheduler), SPLIT_METHOD, None)
    options = getattr(wrapper, MARKER, None)
    if isinstance(options, WrapOptions):
        _, unit = settle(scheduler, options)
        record.note_block_unit(type(scheduler), unit)


def make_wrapper(original: Callable[..., int], options: WrapOptions) -> Callable[..., int]:
    """Wrap the split ``original``; vLLM's own exceptions propagate, the wrapper's never do."""
    # One report per wrapper, whichever step of a call fails first (then vLLM's answer).
    fall_back = failure_reporter("correction")
    state_of = make_state_of(options)
    look = make_look(original, options, fall_back)
    engaged = block_unit.make_engaged(original, options.absolute_end, look, fall_back)
    parts = SplitParts(original, options, state_of, engaged, look, fall_back)
    wrapper = _known_signature(parts) if has_known_parameters(original) else _any_signature(parts)
    return marked(wrapper, original, options)


def make_state_of(options: WrapOptions) -> StateOf:
    """The settled state of a scheduler the wrapper meets unsettled (or settled by another)."""
    settle_failed = failure_reporter("settling the split of a new scheduler")

    def state_of(scheduler: Any) -> SplitState:
        try:
            state, unit = settle(scheduler, options)
            record.note_block_unit(type(scheduler), unit)
            return state
        except Exception as exc:
            settle_failed(exc, None)
            state = SplitState(0, quiet=True, settled_for=options)  # stand down, once
            installation.set_on(scheduler, SPLIT_ATTR, state)
            return state

    return state_of


class SplitParts(NamedTuple):
    """What a split wrapper is made of: vLLM's split and the steps of a call."""

    original: Callable[..., int]
    options: WrapOptions
    state_of: StateOf  # the scheduler's settled state
    engaged: Engaged  # the block-unit rule's call (rules/block_unit.py)
    look: Look  # what becomes of vLLM's answer (make_look)
    fall_back: Callable[[Exception, Any], Any]  # the wrapper's one failure report


def _known_signature(parts: SplitParts) -> Callable[..., int]:
    """The wrapper for the split's known parameters, the one vLLM calls on every release: it
    forwards positionally (no ``*args``/``**kwargs``, which alone would cost about 0.6 us a
    call) and returns a whole chunk at once unless a rule can look at it."""
    original, options, state_of, engaged, look, fall_back = parts

    def split(
        self: Any,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        num_uncached_common_prefix_tokens: int = NOT_GIVEN,
    ) -> int:
        try:
            state = self._vllm_mamba_fix_split  # split_settle.SPLIT_ATTR
        except AttributeError:
            state = state_of(self)
        if state.settled_for is not options:
            state = state_of(self)
        local, external = num_new_local_computed_tokens, num_external_computed_tokens
        uncached = num_uncached_common_prefix_tokens
        if state.view is not None:  # the block-unit rule engaged
            args = (local, external) if uncached is NOT_GIVEN else (local, external, uncached)
            return engaged(self, state, request, num_new_tokens, local + external, args, NO_KWARGS)
        if uncached is NOT_GIVEN:
            answer = original(self, request, num_new_tokens, local, external)
        else:
            answer = original(self, request, num_new_tokens, local, external, uncached)
        if state.quiet:
            return answer
        try:
            # Nothing to look at: a whole chunk that cannot cross a boundary (every decode,
            # most prefill chunks).
            if answer == num_new_tokens and not state.whole_chunks_cross:
                return answer
            start = request.num_computed_tokens + local + external
        except Exception as exc:
            return fall_back(exc, answer)
        args = (local, external) if uncached is NOT_GIVEN else (local, external, uncached)
        return look(self, request, num_new_tokens, answer, start, state, args, NO_KWARGS)

    return split


def _any_signature(parts: SplitParts) -> Callable[..., int]:
    """The wrapper for a split whose trailing parameters the plugin does not know."""
    original, options, state_of, engaged, look, fall_back = parts

    def split(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> int:
        state = getattr(self, SPLIT_ATTR, None)
        if state is None or state.settled_for is not options:
            state = state_of(self)
        if state.quiet:
            return original(self, request, num_new_tokens, *args, **kwargs)
        try:
            offset = extra_computed_tokens(args, kwargs)
        except Exception as exc:
            fall_back(exc, None)
            return original(self, request, num_new_tokens, *args, **kwargs)
        if state.view is not None:
            return engaged(self, state, request, num_new_tokens, offset, args, kwargs)
        answer = original(self, request, num_new_tokens, *args, **kwargs)
        try:
            start = request.num_computed_tokens + offset
        except Exception as exc:
            return fall_back(exc, answer)
        return look(self, request, num_new_tokens, answer, start, state, args, kwargs)

    return split


def make_look(
    original: Callable[..., int], options: WrapOptions, fall_back: Callable[[Exception, Any], Any]
) -> Look:
    """What the wrapper does with vLLM's answer: returned as it is unless a rule can act on
    it (a whole chunk that crosses a boundary from mid-block, a 0 of the split rule's scope,
    any changed chunk), else corrected."""
    split_rule_takes = _split_rule_scope(options)
    correct = make_corrector(original, options)

    def look(self: Any, request: Any, asked: int, answer: int, start: int, state: SplitState,
             args: Args, kwargs: Kwargs) -> int:  # fmt: skip
        try:
            if answer == asked:
                crosses = state.whole_chunks_cross and crosses_next_boundary(
                    start, answer, state.size
                )
                if not crosses:
                    return answer
            elif not answer and (asked <= 0 or not split_rule_takes(request)):
                return answer
            if can_need_correction(answer, asked, start, state.size):
                answer = correct(self, request, asked, answer, start, state, args, kwargs)
            return answer
        except Exception as exc:
            return fall_back(exc, answer)

    return look


def _split_rule_scope(options: WrapOptions) -> Callable[[Any], bool]:
    """Whether the split rule can act on a 0 of ``request``: it is on, and the request is in
    its scope (re-aligning never touches a 0)."""
    if not options.deadlock_rules:
        return lambda request: False
    scope = options.scope
    in_scope: list[Callable[[Any], bool]] = []  # settled at the first 0: it loads the hooks

    def takes(request: Any) -> bool:
        if not in_scope:
            in_scope.append(_scope_test(scope))
        return in_scope[0](request)

    return takes


def _scope_test(scope: Any) -> Callable[[Any], bool]:
    """``not scope.rules_out(request)``, answered directly where only the built-in rule runs."""
    builtin = builtin_scope(scope)
    if builtin is Scope.MULTIMODAL:
        return lambda request: bool(request.has_encoder_inputs)
    if builtin is Scope.ALL:
        return lambda request: True
    return lambda request: not scope.rules_out(request)


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

    return marked(__init__, original, on_built)


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

    return marked(_free_request, original, True)
