"""The one place that touches vLLM: wrapping ``Scheduler._mamba_block_aligned_split``.

The wrapper calls the original with the caller's arguments, then corrects the
result through :func:`vllm_mamba_fix.decision.decide`. Patching is idempotent
and undoable; the original stays reachable as ``__wrapped__``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import threading
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
    tokens_to_next_boundary,
)
from vllm_mamba_fix.scope import ScopePolicy
from vllm_mamba_fix.versions import PrefillGate

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
SCHEDULER_CLASS = "Scheduler"
METHOD_NAME = "_mamba_block_aligned_split"
EXPECTED_LEADING_PARAMETERS = ("self", "request", "num_new_tokens")
# The extra computed-token arguments the waiting loop passes, in order.
EXTRA_COMPUTED_PARAMETERS = ("num_new_local_computed_tokens", "num_external_computed_tokens")
# Set on our wrapper, so a second patch recognises it.
MARKER = "__vllm_mamba_fix__"
# Set on the ``__init_subclass__`` that reports subclasses defined after patching.
SUBCLASS_WATCH = "__vllm_mamba_fix_watch__"


@dataclass(frozen=True)
class WrapOptions:
    prefill_gate: PrefillGate
    policy: ScopePolicy
    # Tests switch this off to show what the re-align rule prevents.
    realign: bool = True


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

    vLLM cuts a chunk exactly there when that input cannot be scheduled.
    """
    return any(feature.mm_position.offset == position for feature in request.mm_features)


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
        if stock < num_new_tokens and _encoder_input_starts_at(request, end):
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
        counters.record(decision.action, request.request_id, start, decision.num_tokens, block_size)
        return decision.num_tokens

    return correct


def _make_failure_reporter() -> Callable[[Exception, int], int]:
    reported = False

    def fall_back(exc: Exception, stock: int) -> int:
        # Never break the host: vLLM's own answer stands.
        nonlocal reported
        if not reported:
            reported = True
            logger.warning(
                "vllm-mamba-fix: correction failed (%s: %s); using vLLM's result",
                type(exc).__name__,
                exc,
            )
        return stock

    return fall_back


def make_wrapper(original: Callable[..., int], options: WrapOptions) -> Callable[..., int]:
    """Wrap ``original``; vLLM's own exceptions propagate, the wrapper's never do."""
    correct = _make_corrector(original, options)
    fall_back = _make_failure_reporter()

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


def is_wrapped(cls: type) -> bool:
    return hasattr(cls.__dict__.get(METHOD_NAME), MARKER)


def check_target(cls: type) -> str | None:
    """Why ``cls`` cannot be patched, or None when it can."""
    method = cls.__dict__.get(METHOD_NAME)
    if method is None:
        return f"{cls.__name__}.{METHOD_NAME} does not exist"
    if hasattr(method, MARKER):
        return f"{cls.__name__}.{METHOD_NAME} is already patched by vllm-mamba-fix"
    if not inspect.isfunction(method):
        return f"{cls.__name__}.{METHOD_NAME} is a {type(method).__name__}, not a plain method"
    if hasattr(method, "__wrapped__"):
        return f"{cls.__name__}.{METHOD_NAME} is already wrapped by another library"
    try:
        parameters = tuple(inspect.signature(method).parameters)
    except (TypeError, ValueError) as exc:
        return f"the signature of {cls.__name__}.{METHOD_NAME} cannot be read ({exc})"
    leading = parameters[: len(EXPECTED_LEADING_PARAMETERS)]
    if leading != EXPECTED_LEADING_PARAMETERS:
        return (
            f"{cls.__name__}.{METHOD_NAME} has an unexpected signature "
            f"({', '.join(parameters)}); expected it to start with "
            f"({', '.join(EXPECTED_LEADING_PARAMETERS)})"
        )
    return None


def wrap(cls: type, options: WrapOptions) -> None:
    """Replace the method on ``cls``; callers run :func:`check_target` first."""
    setattr(cls, METHOD_NAME, make_wrapper(cls.__dict__[METHOD_NAME], options))


def unwrap(cls: type) -> bool:
    """Restore the original method. Returns whether anything was undone."""
    method = cls.__dict__.get(METHOD_NAME)
    if not hasattr(method, MARKER):
        return False
    setattr(cls, METHOD_NAME, method.__wrapped__)
    unwatch_subclasses(cls)
    return True


def overriding_subclasses(cls: type) -> list[type]:
    """Loaded subclasses with their own method, which a base-class patch misses."""
    found: list[type] = []
    pending = list(cls.__subclasses__())
    while pending:
        subclass = pending.pop()
        if METHOD_NAME in subclass.__dict__:
            found.append(subclass)
        pending.extend(subclass.__subclasses__())
    return found


def watch_subclasses(cls: type, on_override: Callable[[type], None]) -> None:
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
        if METHOD_NAME in subclass.__dict__:
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
