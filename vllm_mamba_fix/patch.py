"""Installing and undoing the wrappers; the one place that changes vLLM's classes.

Two moments:

- :func:`install_on_base` when the scheduler module is imported: the rules the
  base ``Scheduler`` needs, plus ``__init__`` (so every built scheduler is
  checked) and ``_free_request`` (so per-request state ends with the request);
- :func:`settle_class` when a scheduler is built: for the class the engine really
  built, make what it resolves carry the rules its own code needs, and record it.

Every change is logged in one list, so :func:`undo` restores exactly what was
there (a method the class did not define is deleted again). Idempotent: a
method that already resolves to a wrapper is not wrapped twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_mamba_fix.encoder_wrapper import EncoderOptions, make_encoder_wrapper
from vllm_mamba_fix.evidence import defining_class
from vllm_mamba_fix.record import MethodRecord, MethodState
from vllm_mamba_fix.targets import (
    ENCODER_METHOD,
    FREE_REQUEST_METHOD,
    INIT_METHOD,
    MARKER,
    SPLIT_METHOD,
    check_target,
    describe_function,
    shape_problem,
)
from vllm_mamba_fix.wrappers import (
    WrapOptions,
    make_free_request_wrapper,
    make_init_wrapper,
    make_wrapper,
)

_MISSING: Any = object()


@dataclass(frozen=True)
class RuleOptions:
    """What the rule-carrying wrappers need; None: that method carries no rule."""

    split: WrapOptions | None
    encoder: EncoderOptions | None

    def for_method(self, name: str) -> WrapOptions | EncoderOptions | None:
        return self.split if name == SPLIT_METHOD else self.encoder


@dataclass
class _Change:
    cls: type
    name: str
    previous: Any  # what cls.__dict__ held, or _MISSING
    installed: Any


_lock = threading.RLock()
_changes: list[_Change] = []


def is_wrapped(cls: type, name: str = SPLIT_METHOD) -> bool:
    """Whether ``cls``'s own namespace holds the plugin's wrapper for ``name``."""
    return hasattr(cls.__dict__.get(name), MARKER)


def resolves_to_wrapper(cls: type, name: str) -> bool:
    return hasattr(getattr(cls, name, None), MARKER)


def _set(cls: type, name: str, value: Any) -> None:
    with _lock:
        _changes.append(_Change(cls, name, cls.__dict__.get(name, _MISSING), value))
        setattr(cls, name, value)


def _wrap(name: str, original: Callable[..., Any], options: WrapOptions | EncoderOptions) -> Any:
    if name == SPLIT_METHOD:
        assert isinstance(options, WrapOptions)
        return make_wrapper(original, options)
    assert isinstance(options, EncoderOptions)
    return make_encoder_wrapper(original, options)


def _we_changed(cls: type, name: str) -> bool:
    with _lock:
        return any(c.cls is cls and c.name == name for c in _changes)


def install_on_base(
    base: type, options: RuleOptions, on_built: Callable[[Any], None]
) -> tuple[tuple[str, ...], dict[str, str]]:
    """Wrap the base class's methods. Returns those wrapped, and why others were not."""
    wrapped: list[str] = []
    problems: dict[str, str] = {}
    for name in (SPLIT_METHOD, ENCODER_METHOD):
        rule_options = options.for_method(name)
        if rule_options is None:
            continue
        problem = check_target(base, name)
        if problem is not None:
            problems[name] = problem
            continue
        _set(base, name, _wrap(name, base.__dict__[name], rule_options))
        wrapped.append(name)
    if problems and not wrapped:
        return (), problems  # every rule the base needs is unpatchable: leave vLLM as it is
    for name, make in (
        (INIT_METHOD, lambda original: make_init_wrapper(original, on_built)),
        (FREE_REQUEST_METHOD, make_free_request_wrapper),
    ):
        problem = check_target(base, name)
        if problem is not None:
            problems[name] = problem
            continue
        _set(base, name, make(base.__dict__[name]))
        wrapped.append(name)
    return tuple(wrapped), problems


def _is_class_body_definition(owner: type, function: Any, name: str) -> bool:
    """Defined in ``owner``'s class body, not assigned onto it from elsewhere."""
    return getattr(function, "__qualname__", None) == f"{owner.__qualname__}.{name}" and (
        getattr(function, "__module__", None) == owner.__module__
    )


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def settle_method(
    cls: type,
    base: type,
    name: str,
    options: WrapOptions | EncoderOptions | None,
    owner_needs: Callable[[type], bool],
) -> MethodRecord:
    """Make ``cls.<name>`` carry the rule when ``options`` is given; say what it resolves to.

    ``owner_needs(owner)`` tells whether the class holding the method needs the rule
    itself: then a wrapper goes there (every subclass inherits it); otherwise on
    ``cls`` only, so a base that is fixed upstream stays stock.
    """
    owner = defining_class(cls, name)
    function = getattr(cls, name, None)
    if owner is None or function is None:
        return MethodRecord(name, MethodState.UNPATCHABLE, _qualname(cls), note="does not exist")
    owner_name = _qualname(owner)
    if hasattr(function, MARKER):
        state = MethodState.WRAPPED if options is not None else MethodState.STOCK
        note = "" if options is not None else "inherited wrapper; this class needs no rule here"
        return MethodRecord(name, state, owner_name, describe_function(function.__wrapped__), note)
    if options is None:
        return MethodRecord(name, MethodState.STOCK, owner_name)
    if owner is not base and _is_class_body_definition(owner, function, name):
        return MethodRecord(
            name, MethodState.OVERRIDDEN, owner_name,
            note=f"{owner.__qualname__} defines its own {name}; not wrapped",
        )  # fmt: skip
    replaced = _we_changed(owner, name)
    qualified = f"{owner.__qualname__}.{name}"
    problem = shape_problem(function, qualified, name)
    if problem is not None:
        note = f"{problem}; it comes from {function.__module__}"
        return MethodRecord(name, MethodState.UNPATCHABLE, owner_name, note=note)
    target = owner if owner_needs(owner) else cls
    _set(target, name, _wrap(name, function, options))
    state, note = MethodState.WRAPPED, ""
    if replaced:
        state = MethodState.WRAPPED_REPLACEMENT
        note = f"{function.__module__} replaced the plugin's wrapper; wrapped the replacement"
    elif target is not owner:
        note = f"installed on {cls.__qualname__} only"
    return MethodRecord(name, state, _qualname(target), describe_function(function), note)


def wrap(cls: type, options: WrapOptions) -> None:
    """Wrap ``cls``'s own split (tests and benchmarks); callers run ``check_target`` first."""
    _set(cls, SPLIT_METHOD, make_wrapper(cls.__dict__[SPLIT_METHOD], options))


def wrap_encoder(cls: type, options: EncoderOptions) -> None:
    """Wrap ``cls``'s own encoder-input check, as :func:`wrap` does the split."""
    _set(cls, ENCODER_METHOD, make_encoder_wrapper(cls.__dict__[ENCODER_METHOD], options))


def undo(cls: type | None = None) -> bool:
    """Restore what the plugin changed (on ``cls`` only, if given), newest first.

    Returns whether anything was restored. A change that someone else has since
    overwritten is left as they left it.
    """
    with _lock:
        changes = [c for c in _changes[::-1] if cls is None or c.cls is cls]
        undone = {id(c) for c in changes}
        _changes[:] = [c for c in _changes if id(c) not in undone]
    for change in changes:
        if change.cls.__dict__.get(change.name, _MISSING) is not change.installed:
            continue
        if change.previous is _MISSING:
            if change.name in change.cls.__dict__:
                delattr(change.cls, change.name)
        else:
            setattr(change.cls, change.name, change.previous)
    return bool(changes)


def changed_classes() -> list[type]:
    with _lock:
        return list(dict.fromkeys(c.cls for c in _changes))
