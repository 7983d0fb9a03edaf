"""The wrappers around ``Scheduler`` methods; :mod:`vllm_mamba_fix.patch` installs them.

- ``_mamba_block_aligned_split`` (the split and block-unit rules): calls the
  original with the caller's arguments (through a ``cache_config`` view with the
  cache's block where the block-unit rule engaged), then corrects the result through
  :func:`vllm_mamba_fix.decision.decide`, in units of the block the Mamba cache
  really stores (:mod:`vllm_mamba_fix.blocks`); a final 0 is told to the watchdog.
- ``_try_schedule_encoder_inputs``: in :mod:`vllm_mamba_fix.encoder_wrapper`.
- ``__init__``: runs the per-scheduler check once the scheduler is built.
- ``_free_request``: per-request state ends with the request.

Each original stays reachable as ``__wrapped__``. A wrapper never raises anything
of its own into vLLM: vLLM's own exceptions propagate, the plugin's never do.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_mamba_fix import counters, record
from vllm_mamba_fix._log import failure_reporter
from vllm_mamba_fix.blocks import (
    BLOCK_ATTR,
    CACHE_CONFIG_ATTR,
    SPLIT_ATTR,
    CacheConfigView,
    SplitState,
    settle_split,
)
from vllm_mamba_fix.config import ENV_BLOCK_RULE
from vllm_mamba_fix.decision import (
    Action,
    can_need_correction,
    decide,
    in_prefill_by_output_tokens,
    in_prefill_by_position,
    tokens_to_next_boundary,
)
from vllm_mamba_fix.scope import ScopePolicy
from vllm_mamba_fix.stalls import REPEATED, ZeroStreaks, forget_request, split_moved, split_zero
from vllm_mamba_fix.targets import (
    EXTRA_COMPUTED_PARAMETERS,
    KNOWN_SPLIT_TRAILING_PARAMETERS,
    MARKER,
    SPLIT_LEADING_PARAMETERS,
    SPLIT_METHOD,
)
from vllm_mamba_fix.versions import PrefillGate

# Requests the split wrapper remembers as zeroed; a bound like the streaks'.
MAX_ZEROED = 4096


@dataclass(frozen=True)
class WrapOptions:
    """Options of the split wrapper: which of its rules it carries."""

    prefill_gate: PrefillGate
    scope: ScopePolicy
    # The split rule: collapse, re-align and encoder stop for in-scope requests.
    deadlock_rules: bool = True
    # The block-unit rule: vLLM's split asked in the cache's block where the sizes
    # differ, and any request that starts mid-block re-aligned.
    block_rule: bool = True
    # Tests switch this off to show what the re-align rule prevents.
    realign: bool = True


# Methods with exactly the known trailing parameters get the fast wrapper, with no
# *args/**kwargs forwarding (that alone costs about 0.6 us a call).
_NOT_GIVEN: Any = object()


def _extra_computed_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    extra = sum(args[: len(EXTRA_COMPUTED_PARAMETERS)])
    for name in EXTRA_COMPUTED_PARAMETERS[len(args) :]:
        extra += kwargs.get(name, 0)
    return extra


def _encoder_input_starts_at(request: Any, position: int) -> bool:
    """Whether an encoder input's placeholder starts at ``position``.

    vLLM cuts a chunk there, less the cut shift, when that input cannot be scheduled.
    """
    return any(feature.mm_position.offset == position for feature in request.mm_features)


def encoder_cut_shift(scheduler: Any) -> int:
    """The tokens vLLM leaves before an encoder input it cannot schedule, as it computes them.

    0.28+ pass ``num_prefill_lookahead`` (num_spec_tokens for multi-module
    MTP); 0.15-0.27 pass ``1 if use_eagle else 0``.
    """
    lookahead = getattr(scheduler, "num_prefill_lookahead", None)
    if lookahead is not None:
        return int(lookahead)
    return 1 if getattr(scheduler, "use_eagle", False) else 0


def has_known_parameters(method: Callable[..., int]) -> bool:
    parameters = list(inspect.signature(method).parameters.values())[
        len(SPLIT_LEADING_PARAMETERS) :
    ]
    names = tuple(p.name for p in parameters)
    known = KNOWN_SPLIT_TRAILING_PARAMETERS
    return names in (known[:2], known) and all(
        p.kind is p.POSITIONAL_OR_KEYWORD and p.default == 0 for p in parameters
    )


Corrector = Callable[[Any, Any, int, int, int, int, tuple[Any, ...], dict[str, Any]], int]


def _make_corrector(
    original: Callable[..., int], options: WrapOptions, text_zeros: ZeroStreaks
) -> Corrector:
    """The rare path: decide, ask the scope hook, count and log.

    ``text_zeros`` counts the 0s of text requests (scope all) at one position.
    """
    by_position = options.prefill_gate is PrefillGate.BEFORE_PREFILL_END
    scope = options.scope
    deadlock_rules = options.deadlock_rules
    # Only the block-unit rule's re-align applies to a request the split rule leaves.
    realign_others = options.block_rule and options.realign

    def correct(
        self: Any,
        request: Any,
        num_new_tokens: int,
        stock: int,
        start: int,
        block_size: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> int:
        ruled_out = not deadlock_rules or scope.rules_out(request)
        if ruled_out and not realign_others:
            return stock
        in_prefill = (
            in_prefill_by_position(start, request.num_prompt_tokens, request.num_tokens)
            if by_position
            else in_prefill_by_output_tokens(request.num_output_tokens)
        )
        if not in_prefill:
            return stock
        uncut = None
        end = start + num_new_tokens
        if (
            not ruled_out
            and stock < num_new_tokens
            and _encoder_input_starts_at(request, end + encoder_cut_shift(self))
        ):
            # Ask vLLM where it would stop if the encoder had not cut the chunk.
            reach = num_new_tokens + tokens_to_next_boundary(end, block_size)
            uncut = original(self, request, reach, *args, **kwargs)
        decision = decide(stock, num_new_tokens, start, block_size, True, uncut)
        action = decision.action
        if action is Action.UNCHANGED or (action is Action.REALIGNED and not options.realign):
            return stock
        if ruled_out or not scope.in_scope(request):
            if action is Action.REALIGNED and realign_others:
                counters.record(action, request.request_id, start, decision.num_tokens, block_size)
                return decision.num_tokens
            return stock
        if action is Action.COLLAPSE_PREVENTED and not request.has_encoder_inputs:
            # From 0.26 a 0 may be a one-step defer (the budget cannot fund a
            # block); only one that repeats at the same position is a stall.
            streak, _ = text_zeros.zero(request.request_id, start, 0.0)
            if streak.steps < REPEATED:
                return stock
            text_zeros.clear(request.request_id)
        counters.record(action, request.request_id, start, decision.num_tokens, block_size)
        return decision.num_tokens

    return correct


def _given(local: int, external: int, uncached_common_prefix: int) -> tuple[int, ...]:
    """The fast wrapper's trailing arguments, as the caller gave them."""
    if uncached_common_prefix is _NOT_GIVEN:
        return (local, external)
    return (local, external, uncached_common_prefix)


def _settle(scheduler: Any, options: WrapOptions) -> SplitState:
    """The first split of ``scheduler``: meet it if it was built before the patch, then settle."""
    if getattr(scheduler, BLOCK_ATTR, None) is None:
        # Built before the plugin loaded: run the per-construction check now.
        on_built = getattr(type(scheduler).__init__, MARKER, None)
        if callable(on_built):
            on_built(scheduler)
    state, unit = settle_split(scheduler, options.block_rule, ENV_BLOCK_RULE)
    record.note_block_unit(type(scheduler), unit)
    return state


def settle_if_differs(scheduler: Any) -> None:
    """At construction, where the block sizes already differ: settle the split now."""
    options = getattr(getattr(type(scheduler), SPLIT_METHOD, None), MARKER, None)
    if isinstance(options, WrapOptions):
        _settle(scheduler, options)


def make_wrapper(original: Callable[..., int], options: WrapOptions) -> Callable[..., int]:
    """Wrap the split ``original``; vLLM's own exceptions propagate, the wrapper's never do."""
    text_zeros = ZeroStreaks()
    text_streaks = text_zeros.by_request
    # Requests whose final answer was 0: told to the watchdog, untold when they move.
    zeroed: dict[str, None] = {}
    correct = _make_corrector(original, options, text_zeros)
    fall_back = failure_reporter("correction")
    settle_failed = failure_reporter("settling the split of a new scheduler")

    def state_of(self: Any) -> SplitState:
        try:
            return _settle(self, options)
        except Exception as exc:
            settle_failed(exc, None)
            state = SplitState(0)  # stand down for this scheduler, once
            setattr(self, SPLIT_ATTR, state)
            return state

    def after(self: Any, request: Any, num_new_tokens: int, start: int, result: int) -> None:
        """The watchdog hears of final 0s, and of the request moving again."""
        rid = request.request_id
        if result:
            if rid in zeroed:
                del zeroed[rid]
                split_moved(rid)
        elif num_new_tokens > 0:
            zeroed[rid] = None
            if len(zeroed) > MAX_ZEROED:
                del zeroed[next(iter(zeroed))]
            split_zero(self, request, start)

    def corrected(
        self: Any,
        request: Any,
        num_new_tokens: int,
        stock: int,
        start: int,
        block_size: int,
        extra: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> int:
        if stock and text_streaks and request.request_id in text_streaks:
            text_zeros.clear(request.request_id)  # it moved: a later 0 starts afresh
        if not block_size:
            return stock  # the cache's block could not be read: stand down
        if can_need_correction(stock, num_new_tokens, start, block_size):
            stock = correct(self, request, num_new_tokens, stock, start, block_size, extra, kwargs)
        if not stock or zeroed:
            after(self, request, num_new_tokens, start, stock)
        return stock

    def in_cache_block(
        self: Any, view: CacheConfigView, request: Any, num_new_tokens: int, args: Any, kw: Any
    ) -> int:
        """The block-unit rule: vLLM's split, asked with the cache's block."""
        configured = original(self, request, num_new_tokens, *args, **kw)
        real = vars(self)[CACHE_CONFIG_ATTR]
        self.cache_config = view
        try:
            stock = original(self, request, num_new_tokens, *args, **kw)
            start = request.num_computed_tokens + _extra_computed_tokens(args, kw)
            try:
                if stock != configured:
                    counters.record(
                        Action.BLOCK_ALIGNED, request.request_id, start, stock, view.block_size
                    )
                return corrected(self, request, num_new_tokens, stock, start, view.block_size,
                                 args, kw)  # fmt: skip
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
        num_uncached_common_prefix_tokens: int = _NOT_GIVEN,
    ) -> int:
        try:
            state = self._vllm_mamba_fix_split  # blocks.SPLIT_ATTR
        except AttributeError:
            state = state_of(self)
        if state.view is not None:
            return in_cache_block(
                self, state.view, request, num_new_tokens,
                _given(num_new_local_computed_tokens, num_external_computed_tokens,
                       num_uncached_common_prefix_tokens), {},
            )  # fmt: skip
        # Positional forwarding: star-unpacking here would cost more than the rest.
        if num_uncached_common_prefix_tokens is _NOT_GIVEN:
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
        try:
            block_size = state.size
            start = (
                request.num_computed_tokens
                + num_new_local_computed_tokens
                + num_external_computed_tokens
            )
            # can_need_correction(), inlined: this runs for every request on every step. Only
            # this request's own 0s matter: another's (a budget's tail floored) must not slow it.
            if stock == num_new_tokens and block_size:
                offset = start % block_size
                if not offset or offset + stock <= block_size:
                    rid = request.request_id
                    if rid not in zeroed and rid not in text_streaks:
                        return stock
            extra = _given(
                num_new_local_computed_tokens,
                num_external_computed_tokens,
                num_uncached_common_prefix_tokens,
            )
            return corrected(self, request, num_new_tokens, stock, start, block_size, extra, {})
        except Exception as exc:
            return fall_back(exc, stock)

    def generic(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> int:
        try:
            state = self._vllm_mamba_fix_split  # blocks.SPLIT_ATTR
        except AttributeError:
            state = state_of(self)
        if state.view is not None:
            return in_cache_block(self, state.view, request, num_new_tokens, args, kwargs)
        stock = original(self, request, num_new_tokens, *args, **kwargs)
        try:
            start = request.num_computed_tokens + _extra_computed_tokens(args, kwargs)
            return corrected(self, request, num_new_tokens, stock, start, state.size, args, kwargs)
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
        except Exception as exc:
            fall_back(exc, None)
        return result

    functools.update_wrapper(_free_request, original)
    setattr(_free_request, MARKER, True)
    return _free_request
