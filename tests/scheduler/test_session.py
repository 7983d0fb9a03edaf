"""Issue 45 item 1 on the real scheduler: ``unregister()`` leaves no memory behind.

Everything the plugin remembers is its session's (``vllm_mamba_fix.changes.installation``).
The test registers through vLLM's own loader, drives a real scheduler through a correction
(the split rule's) and a named stall (the mutual hold with the split's decision made stock's,
tests/scheduler/test_stall_hearing.py), unregisters, and finds every module-level value of
every ``vllm_mamba_fix`` module as it was before ``register()``: the same object, and the
same contents for containers and the package's own objects.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import threading
import types
import weakref
from collections.abc import Mapping
from typing import Any

import pytest

import vllm_mamba_fix
from tests.scheduler.test_stall_hearing import (
    ENV,
    HOLD_CONFIG,
    _drive,
    _harness,
    _holders,
    _named,
    _needs_the_hold,
    _stock_split_decision,
)
from tests.stall_end_helpers import install_clock
from tools.scenarios import ISSUE_CONFIG, image_request
from vllm_mamba_fix.facts.versions import Family
from vllm_mamba_fix.observe import counters

_PLAIN = (str, bytes, int, float, bool, type(None))
_KEPT = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType, types.MethodType)
_LOCKS = (type(threading.Lock()), type(threading.RLock()))


def _shape(value: Any, depth: int = 0) -> Any:
    """What ``value`` holds, comparable across time: plain values as they are, containers
    and the package's own objects by their contents, anything else by identity."""
    if isinstance(value, _PLAIN):
        return value
    if depth > 6 or isinstance(value, (*_KEPT, *_LOCKS)):
        return ("id", id(value))
    if isinstance(value, (weakref.WeakKeyDictionary, weakref.WeakValueDictionary)):
        value = dict(value.items())
    elif isinstance(value, weakref.WeakSet):
        value = list(value)
    if isinstance(value, Mapping):
        items = [(repr(k), _shape(v, depth + 1)) for k, v in value.items()]
        return (type(value).__name__, sorted(items, key=repr))
    if isinstance(value, (list, tuple, set, frozenset)):
        shapes = [_shape(v, depth + 1) for v in value]
        return (
            type(value).__name__,
            shapes if isinstance(value, (list, tuple)) else sorted(shapes, key=repr),
        )
    if type(value).__module__.startswith("vllm_mamba_fix") and hasattr(value, "__dict__"):
        return (type(value).__name__, _shape(vars(value), depth + 1))
    return ("id", id(value))


def _every_module() -> list[types.ModuleType]:
    for info in pkgutil.walk_packages(vllm_mamba_fix.__path__, "vllm_mamba_fix."):
        if not info.name.endswith("__main__"):  # it runs doctor
            importlib.import_module(info.name)  # every module, so none appears during the test
    return [m for name, m in sorted(sys.modules.items()) if name.split(".")[0] == "vllm_mamba_fix"]


def _snapshot() -> dict[str, tuple[Any, Any]]:
    """Per ``module.name``: the value itself (identity) and its shape."""
    return {
        f"{module.__name__}.{name}": (value, _shape(value))
        for module in _every_module()
        for name, value in vars(module).items()
        if not (name.startswith("__") and name.endswith("__"))
    }


def _differences(
    before: dict[str, tuple[Any, Any]], after: dict[str, tuple[Any, Any]]
) -> list[str]:
    found = sorted(set(before) ^ set(after))
    for key in sorted(set(before) & set(after)):
        (was, was_shape), (now, now_shape) = before[key], after[key]
        if was is not now and not (isinstance(was, _PLAIN) and was == now):
            found.append(f"{key}: another object")
        elif was_shape != now_shape:
            found.append(f"{key}: {was_shape!r:.200} -> {now_shape!r:.200}")
    return found


def test_unregister_leaves_every_module_value_as_before_register(
    family: Family, load_plugin: Any, vllm_log: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _needs_the_hold(family)
    clock = install_clock(monkeypatch)
    before = _snapshot()
    assert load_plugin(**ENV), "the split rule is not installed"
    # A correction: the image request stock's split floors to 0.
    h = _harness(family, ISSUE_CONFIG)
    h.add(image_request("running-image", (100, 50, 200)))
    _drive(h, clock)
    assert len(h.finished) == len(h.requests)
    assert sum(counters.stats()[key] for key in counters.ACTION_KEYS.values()) > 0
    # A named stall: the mutual hold, the split's decision stock's.
    with monkeypatch.context() as patched:
        _stock_split_decision(patched)
        h = _harness(family, HOLD_CONFIG)
        h.add(*_holders(2))
        _drive(h, clock, max_steps=60)
    assert all(_named(vllm_log, rid) for rid in h.requests), vllm_log
    assert counters.stats()["stalls_detected"] >= 2
    del h
    assert vllm_mamba_fix.unregister()
    assert _differences(before, _snapshot()) == []
