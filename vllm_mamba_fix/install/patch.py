"""Installing and undoing the wrappers; the one place that changes vLLM's classes.

Two moments:

- :func:`install_on_base` when the scheduler module is imported: the rules the
  base ``Scheduler`` needs, plus ``__init__`` (so every built scheduler is
  checked) and ``_free_request`` (so per-request state ends with the request);
- :func:`settle_method` when a scheduler is built: the per-construction check
  (``vllm_mamba_fix.install.plugin``) settles the class the engine really built one
  rule-carrying method at a time, so that what the class resolves carries the
  rules its own code needs; :func:`describe_method` says what it resolves to
  (a :class:`~vllm_mamba_fix.observe.record.MethodRecord`), and plugin records it.

Every change is made through the process's record of changes
(:data:`vllm_mamba_fix.changes.installation`, tagged :data:`TAG`), so ``unregister()`` and
:func:`undo` restore exactly what was there (a method the class did not define is deleted
again). Nothing is ever set on a scheduler instance's namespace in vLLM's place. Idempotent:
a method that already resolves to a wrapper is not wrapped twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.facts.evidence import defining_class
from vllm_mamba_fix.facts.targets import (
    ENCODER_METHOD,
    FREE_REQUEST_METHOD,
    INIT_METHOD,
    MARKER,
    SPLIT_METHOD,
    UPDATE_METHOD,
    check_target,
    describe_function,
    shape_problem,
)
from vllm_mamba_fix.observe.record import MethodRecord, MethodState, class_name
from vllm_mamba_fix.rules import table as rules
from vllm_mamba_fix.rules.encoder_wrapper import EncoderOptions, make_encoder_wrapper
from vllm_mamba_fix.rules.split_rule import WrapOptions, make_wrapper
from vllm_mamba_fix.rules.stall_end import EndOptions, make_update_from_output_wrapper
from vllm_mamba_fix.rules.wrappers import make_free_request_wrapper, make_init_wrapper

# Per rule-carrying method, its wrapper's options (None: that method carries no rule).
MethodOptions = Mapping[str, Any]
TAG = __name__  # this module's changes in the record


def is_wrapped(cls: type, name: str = SPLIT_METHOD) -> bool:
    """Whether ``cls``'s own namespace holds the plugin's wrapper for ``name``."""
    return hasattr(cls.__dict__.get(name), MARKER)


def resolves_to_wrapper(cls: type, name: str) -> bool:
    return hasattr(getattr(cls, name, None), MARKER)


def _set(cls: type, name: str, value: Any) -> None:
    installation.set_attr(cls, name, value, TAG)


def _wrap(name: str, original: Callable[..., Any], options: Any) -> Any:
    return rules.method_spec(name).wrap(original, options)


def _we_changed(cls: type, name: str) -> bool:
    return installation.changed(cls, name)


def install_on_base(
    base: type, options: MethodOptions, on_built: Callable[[Any], None]
) -> tuple[tuple[str, ...], dict[str, str]]:
    """Wrap the base class's methods. Returns those wrapped, and why others were not."""
    wrapped: list[str] = []
    problems: dict[str, str] = {}
    for name in rules.RULE_METHODS:
        rule_options = options.get(name)
        if rule_options is None:
            continue
        needs = rules.NEEDS.get(name)
        problem = check_target(base, name)
        if needs is not None and needs not in wrapped:
            problem = f"it acts through {needs}, which is not wrapped"
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


def _carried(options: Any, name: str) -> frozenset[rules.Rule]:
    return frozenset() if options is None else rules.method_spec(name).carried(options)


def settle_method(
    cls: type,
    base: type,
    name: str,
    options: Any,
    owner_needs: Callable[[type], bool],
) -> MethodRecord:
    """Make ``cls.<name>`` carry exactly the rules ``options`` gives (None: none); say so.

    ``owner_needs(owner)`` tells whether the class holding the method needs the rule
    itself: then a wrapper goes there (every subclass inherits it); otherwise on
    ``cls`` only, so a base that is fixed upstream stays stock. Where ``cls`` resolves
    to the plugin's wrapper with other rules (a base's), ``cls`` gets its own.
    """
    owner = defining_class(cls, name)
    function = getattr(cls, name, None)
    if owner is None or function is None:
        return MethodRecord(name, MethodState.UNPATCHABLE, class_name(cls), note="does not exist")
    wanted = _carried(options, name)
    if hasattr(function, MARKER):
        if rules.carried_by(function, name) != wanted:
            original = function.__wrapped__
            _set(cls, name, original if options is None else _wrap(name, original, options))
        return describe_method(cls, name, wanted)
    if options is None:
        return describe_method(cls, name, wanted)
    if owner is not base and _is_class_body_definition(owner, function, name):
        return MethodRecord(
            name, MethodState.OVERRIDDEN, class_name(owner),
            note=f"{owner.__qualname__} defines its own {name}; not wrapped",
        )  # fmt: skip
    replaced = _we_changed(owner, name)
    qualified = f"{owner.__qualname__}.{name}"
    problem = shape_problem(function, qualified, name)
    if problem is not None:
        note = f"{problem}; it comes from {getattr(function, '__module__', None) or '?'}"
        return MethodRecord(name, MethodState.UNPATCHABLE, class_name(owner), note=note)
    target = owner if owner_needs(owner) else cls
    _set(target, name, _wrap(name, function, options))
    found = describe_method(cls, name, wanted)
    if replaced:
        note = f"{function.__module__} replaced the plugin's wrapper; wrapped the replacement"
        return dataclasses.replace(found, state=MethodState.WRAPPED_REPLACEMENT, note=note)
    return found


def describe_method(cls: type, name: str, wanted: frozenset[rules.Rule]) -> MethodRecord:
    """What ``cls.<name>`` resolves to now, against the rules its own plan wants there."""
    owner = defining_class(cls, name)
    function = getattr(cls, name, None)
    if owner is None or function is None:
        return MethodRecord(name, MethodState.UNPATCHABLE, class_name(cls), note="does not exist")
    if not hasattr(function, MARKER):
        return MethodRecord(name, MethodState.STOCK, class_name(owner))
    carried = rules.carried_by(function, name)
    wraps = describe_function(function.__wrapped__)
    note = ""
    if owner is not cls:
        if carried == wanted:
            note = "inherited wrapper"
        else:
            extra = ", ".join(sorted(r.value for r in carried - wanted)) or "none"
            note = f"inherits the wrapper installed on {owner.__qualname__} (carries {extra} "
            note += "beyond what its own plan needs)"
    elif owner is not cls.__mro__[-1]:
        note = f"installed on {cls.__qualname__} only" if _has_wrapped_base(cls, name) else ""
    return MethodRecord(name, MethodState.WRAPPED, class_name(owner), wraps, note, carried)


def _has_wrapped_base(cls: type, name: str) -> bool:
    """Whether a base class of ``cls`` also holds a plugin wrapper or the stock method."""
    return any(name in vars(klass) for klass in cls.__mro__[1:])


def wrap(cls: type, options: WrapOptions) -> None:
    """Wrap ``cls``'s own split (tests and benchmarks); callers run ``check_target`` first.

    With the split rule, its own encoder check too, where not wrapped yet: the rule's ear."""
    _set(cls, SPLIT_METHOD, make_wrapper(cls.__dict__[SPLIT_METHOD], options))
    if (
        options.deadlock_rules
        and ENCODER_METHOD in cls.__dict__
        and not is_wrapped(cls, ENCODER_METHOD)
    ):
        wrap_encoder(cls, EncoderOptions(options.scope, False))


def wrap_encoder(cls: type, options: EncoderOptions) -> None:
    """Wrap ``cls``'s own encoder-input check, as :func:`wrap` does the split."""
    _set(cls, ENCODER_METHOD, make_encoder_wrapper(cls.__dict__[ENCODER_METHOD], options))


def wrap_update(cls: type, options: EndOptions) -> None:
    """Wrap ``cls``'s own ``update_from_output`` (the watchdog's look, the stall end)."""
    _set(cls, UPDATE_METHOD, make_update_from_output_wrapper(cls.__dict__[UPDATE_METHOD], options))


def undo(cls: type | None = None) -> bool:
    """Restore what this module changed (on ``cls`` only, if given), newest first.

    Returns whether anything was restored. A change that someone else has since
    overwritten is left as they left it. ``unregister()`` undoes every change at once.
    """
    return installation.undo(lambda c: c.tag == TAG and (cls is None or c.target is cls))


def changed_classes() -> list[type]:
    return list(dict.fromkeys(c.target for c in installation.changes(TAG)))
