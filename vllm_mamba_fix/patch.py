"""The one place that touches vLLM: wrapping two ``Scheduler`` methods.

- ``_mamba_block_aligned_split`` (the split rule): the wrapper calls the
  original with the caller's arguments, then corrects the result through
  :func:`vllm_mamba_fix.decision.decide`.
- ``_try_schedule_encoder_inputs`` (the speculative-stall rule and the stall
  watchdog): only a result of 0 tokens is looked at.

Patching is idempotent and undoable; each original stays reachable as
``__wrapped__``. A wrapper never raises anything of its own into vLLM.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_mamba_fix import counters
from vllm_mamba_fix._log import logger
from vllm_mamba_fix.decision import (
    Action,
    can_need_correction,
    decide,
    in_prefill_by_output_tokens,
    in_prefill_by_position,
    speculative_stall_release,
    tokens_to_next_boundary,
)
from vllm_mamba_fix.scope import ScopePolicy
from vllm_mamba_fix.stalls import (
    REPEATED,
    StallReport,
    ZeroStreaks,
    stall_cause,
    watchdog_due,
)
from vllm_mamba_fix.versions import PrefillGate

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
SCHEDULER_CLASS = "Scheduler"
METHOD_NAME = "_mamba_block_aligned_split"
EXPECTED_LEADING_PARAMETERS = ("self", "request", "num_new_tokens")
ENCODER_METHOD_NAME = "_try_schedule_encoder_inputs"
# Every release from 0.15 to 0.33 has exactly these.
ENCODER_PARAMETERS = (
    "self", "request", "num_computed_tokens", "num_new_tokens", "encoder_compute_budget",
    "shift_computed_tokens",
)  # fmt: skip
# The extra computed-token arguments the waiting loop passes, in order.
EXTRA_COMPUTED_PARAMETERS = ("num_new_local_computed_tokens", "num_external_computed_tokens")
# Set on our wrappers, so a second patch recognises them.
MARKER = "__vllm_mamba_fix__"
# Set on the ``__init_subclass__`` that reports subclasses defined after patching.
SUBCLASS_WATCH = "__vllm_mamba_fix_watch__"


@dataclass(frozen=True)
class WrapOptions:
    """Options of the split wrapper."""

    prefill_gate: PrefillGate
    policy: ScopePolicy
    # Tests switch this off to show what the re-align rule prevents.
    realign: bool = True


@dataclass(frozen=True)
class EncoderOptions:
    """Options of the encoder wrapper."""

    policy: ScopePolicy
    # End the EAGLE encoder-cache deadlock (0.24-0.32).
    release_speculative_stalls: bool
    # Seconds of 0 tokens before the watchdog names a stall; None: off.
    stall_seconds: float | None


# Trailing parameters of every release's method (0.24-0.25 add the third).
# Methods with exactly these get the fast wrapper, with no *args/**kwargs
# forwarding (that alone costs about 0.6 us a call).
KNOWN_TRAILING_PARAMETERS = (*EXTRA_COMPUTED_PARAMETERS, "num_uncached_common_prefix_tokens")
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
        len(EXPECTED_LEADING_PARAMETERS) :
    ]
    names = tuple(p.name for p in parameters)
    return names in (KNOWN_TRAILING_PARAMETERS[:2], KNOWN_TRAILING_PARAMETERS) and all(
        p.kind is p.POSITIONAL_OR_KEYWORD and p.default == 0 for p in parameters
    )


Corrector = Callable[[Any, Any, int, int, int, int, tuple[Any, ...], dict[str, Any]], int]


def _make_corrector(original: Callable[..., int], options: WrapOptions) -> Corrector:
    """The rare path: decide, ask the scope hook, count and log."""
    by_position = options.prefill_gate is PrefillGate.BEFORE_PREFILL_END
    # Text requests (scope all) whose 0 repeats at the same position.
    text_zeros = ZeroStreaks()

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
        if options.policy.rules_out(request):
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
        if stock < num_new_tokens and _encoder_input_starts_at(
            request, end + encoder_cut_shift(self)
        ):
            # Ask vLLM where it would stop if the encoder had not cut the chunk.
            reach = num_new_tokens + tokens_to_next_boundary(end, block_size)
            uncut = original(self, request, reach, *args, **kwargs)
        decision = decide(stock, num_new_tokens, start, block_size, True, uncut)
        if decision.action is Action.UNCHANGED or (
            decision.action is Action.REALIGNED and not options.realign
        ):
            return stock
        if not options.policy.in_scope(request):
            return stock
        if decision.action is Action.COLLAPSE_PREVENTED and not request.has_encoder_inputs:
            # From 0.26 a 0 may be a one-step defer (the budget cannot fund a
            # block); only one that repeats at the same position is a stall.
            streak, _ = text_zeros.zero(request.request_id, start, 0.0)
            if streak.steps < REPEATED:
                return stock
            text_zeros.clear(request.request_id)
        counters.record(decision.action, request.request_id, start, decision.num_tokens, block_size)
        return decision.num_tokens

    return correct


def _make_failure_reporter(what: str) -> Callable[[Exception, Any], Any]:
    reported = False

    def fall_back(exc: Exception, stock: Any) -> Any:
        # Never break the host: vLLM's own answer stands.
        nonlocal reported
        if not reported:
            reported = True
            logger.warning(
                "vllm-mamba-fix: %s failed (%s: %s); using vLLM's result",
                what,
                type(exc).__name__,
                exc,
            )
        return stock

    return fall_back


def make_wrapper(original: Callable[..., int], options: WrapOptions) -> Callable[..., int]:
    """Wrap the split ``original``; vLLM's own exceptions propagate, the wrapper's never do."""
    correct = _make_corrector(original, options)
    fall_back = _make_failure_reporter("correction")

    def fast(
        self: Any,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        num_uncached_common_prefix_tokens: int = _NOT_GIVEN,
    ) -> int:
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
            start = (
                request.num_computed_tokens
                + num_new_local_computed_tokens
                + num_external_computed_tokens
            )
            block_size = self.cache_config.block_size
            # can_need_correction(), inlined: this runs for every request on every step.
            offset = start % block_size
            if stock == num_new_tokens and (not offset or offset + stock <= block_size):
                return stock
            extra: tuple[int, ...] = (num_new_local_computed_tokens, num_external_computed_tokens)
            if num_uncached_common_prefix_tokens is not _NOT_GIVEN:
                extra += (num_uncached_common_prefix_tokens,)
            return correct(self, request, num_new_tokens, stock, start, block_size, extra, {})
        except Exception as exc:
            return fall_back(exc, stock)

    def generic(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> int:
        stock = original(self, request, num_new_tokens, *args, **kwargs)
        try:
            start = request.num_computed_tokens + _extra_computed_tokens(args, kwargs)
            block_size = self.cache_config.block_size
            if not can_need_correction(stock, num_new_tokens, start, block_size):
                return stock
            return correct(self, request, num_new_tokens, stock, start, block_size, args, kwargs)
        except Exception as exc:
            return fall_back(exc, stock)

    wrapper = fast if has_known_parameters(original) else generic
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, MARKER, options)
    return wrapper


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
    fall_back = _make_failure_reporter("the encoder-input check")
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
        if not options.policy.in_scope(request):
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
        if options.release_speculative_stalls and release.stalled and streak.steps >= REPEATED:
            for input_id in release.to_free:
                _free_encoder_input(self, request, input_id)
            retry = original(
                self, request, num_computed_tokens, num_new_tokens, encoder_compute_budget, 0
            )
            if retry[1]:
                zeros.clear(rid)
                counters.record(
                    Action.SPECULATIVE_STALL_RELEASED, rid, num_computed_tokens, retry[1],
                    self.cache_config.block_size,
                )  # fmt: skip
                return retry
        seconds = options.stall_seconds
        if seconds is not None and watchdog_due(streak, now, seconds):
            streak.warned = True
            counters.record_stall()
            report = _stall_report(
                self, request, num_computed_tokens, held, release.stalled, streak.steps,
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


WRAPPED_METHODS = (METHOD_NAME, ENCODER_METHOD_NAME)


def is_wrapped(cls: type, name: str = METHOD_NAME) -> bool:
    return hasattr(cls.__dict__.get(name), MARKER)


def check_target(cls: type, name: str = METHOD_NAME) -> str | None:
    """Why ``cls.<name>`` cannot be patched, or None when it can."""
    method = cls.__dict__.get(name)
    qualified = f"{cls.__name__}.{name}"
    if method is None:
        return f"{qualified} does not exist"
    if hasattr(method, MARKER):
        return f"{qualified} is already patched by vllm-mamba-fix"
    if not inspect.isfunction(method):
        return f"{qualified} is a {type(method).__name__}, not a plain method"
    if hasattr(method, "__wrapped__"):
        return f"{qualified} is already wrapped by another library"
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError) as exc:
        return f"the signature of {qualified} cannot be read ({exc})"
    parameters = tuple(signature.parameters)
    if name == ENCODER_METHOD_NAME:
        shift = signature.parameters.get("shift_computed_tokens")
        if parameters == ENCODER_PARAMETERS and shift is not None and shift.default == 0:
            return None
        return (
            f"{qualified} has an unexpected signature ({', '.join(parameters)}); "
            f"expected ({', '.join(ENCODER_PARAMETERS)}=0)"
        )
    leading = parameters[: len(EXPECTED_LEADING_PARAMETERS)]
    if leading != EXPECTED_LEADING_PARAMETERS:
        return (
            f"{qualified} has an unexpected signature "
            f"({', '.join(parameters)}); expected it to start with "
            f"({', '.join(EXPECTED_LEADING_PARAMETERS)})"
        )
    return None


def wrap(cls: type, options: WrapOptions) -> None:
    """Replace the split on ``cls``; callers run :func:`check_target` first."""
    setattr(cls, METHOD_NAME, make_wrapper(cls.__dict__[METHOD_NAME], options))


def wrap_encoder(cls: type, options: EncoderOptions) -> None:
    """Replace the encoder-input check on ``cls``; callers run :func:`check_target` first."""
    method = cls.__dict__[ENCODER_METHOD_NAME]
    setattr(cls, ENCODER_METHOD_NAME, make_encoder_wrapper(method, options))


def unwrap(cls: type) -> bool:
    """Restore every original method. Returns whether anything was undone."""
    undone = False
    for name in WRAPPED_METHODS:
        method = cls.__dict__.get(name)
        if hasattr(method, MARKER):
            setattr(cls, name, method.__wrapped__)
            undone = True
    if undone:
        unwatch_subclasses(cls)
    return undone


def overridden_methods(subclass: type, names: tuple[str, ...] = WRAPPED_METHODS) -> list[str]:
    return [name for name in names if name in subclass.__dict__]


def overriding_subclasses(cls: type, names: tuple[str, ...] = (METHOD_NAME,)) -> list[type]:
    """Loaded subclasses with their own method, which a base-class patch misses."""
    found: list[type] = []
    pending = list(cls.__subclasses__())
    while pending:
        subclass = pending.pop()
        if overridden_methods(subclass, names):
            found.append(subclass)
        pending.extend(subclass.__subclasses__())
    return found


def watch_subclasses(
    cls: type, on_override: Callable[[type], None], names: tuple[str, ...] = (METHOD_NAME,)
) -> None:
    """Call ``on_override(subclass)`` for each subclass defined later that overrides the method.

    Platform schedulers (vllm-gaudi's ``HPUAsyncScheduler``) are imported when
    the engine resolves its scheduler class, after the base module was patched,
    so :func:`overriding_subclasses` cannot see them at patch time.
    """
    previous = cls.__dict__.get("__init_subclass__")

    def __init_subclass__(subclass: type, **kwargs: Any) -> None:
        if previous is not None:
            previous.__get__(None, subclass)(**kwargs)
        else:
            super(cls, subclass).__init_subclass__(**kwargs)
        if overridden_methods(subclass, names):
            with contextlib.suppress(Exception):  # a warning must not break class creation
                on_override(subclass)

    setattr(__init_subclass__, SUBCLASS_WATCH, (previous,))
    cls.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]


def unwatch_subclasses(cls: type) -> None:
    hook = getattr(cls.__dict__.get("__init_subclass__"), "__func__", None)
    saved = getattr(hook, SUBCLASS_WATCH, None)
    if saved is None:
        return
    (previous,) = saved
    if previous is None:
        delattr(cls, "__init_subclass__")
    else:
        cls.__init_subclass__ = previous  # type: ignore[method-assign]


class _NotifyingLoader(importlib.abc.Loader):
    """Runs the real loader, then a callback on the fresh module."""

    def __init__(self, loader: importlib.abc.Loader, on_loaded: Callable[[ModuleType], None]):
        self._loader = loader
        self._on_loaded = on_loaded

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module should see its real loader (for source lookups and reloads).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._on_loaded(module)


class PostImportHook(importlib.abc.MetaPathFinder):
    """Calls ``on_loaded(module)`` once, right after ``module_name`` is imported.

    Lets processes that never import the scheduler (front end, workers) skip
    the cost of importing it just to patch it.
    """

    def __init__(self, module_name: str, on_loaded: Callable[[ModuleType], None]) -> None:
        self.module_name = module_name
        self._on_loaded = on_loaded

    def install(self) -> None:
        sys.meta_path.insert(0, self)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.module_name:
            return None
        self.remove()  # one-shot, and keeps the search below from finding us
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _NotifyingLoader(spec.loader, self._on_loaded)
        return spec


_hook_lock = threading.Lock()
_pending_hook: PostImportHook | None = None


def when_scheduler_imported(callback: Callable[[ModuleType], None]) -> bool:
    """Run ``callback`` on the scheduler module now if imported, else on import.

    Returns True when the callback ran now.
    """
    global _pending_hook

    def on_import(module: ModuleType) -> None:
        global _pending_hook
        with _hook_lock:
            _pending_hook = None
        callback(module)

    with _hook_lock:
        module = sys.modules.get(SCHEDULER_MODULE)
        if module is None:
            if _pending_hook is None:
                _pending_hook = PostImportHook(SCHEDULER_MODULE, on_import)
                _pending_hook.install()
            return False
    callback(module)
    return True


def cancel_pending_hook() -> bool:
    global _pending_hook
    with _hook_lock:
        hook, _pending_hook = _pending_hook, None
    if hook is None:
        return False
    hook.remove()
    return True
