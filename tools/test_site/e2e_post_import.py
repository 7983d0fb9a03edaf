"""Run a callback right after a named module is first imported (test-only helper)."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType

Callback = Callable[[ModuleType], None]


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str, callback: Callback) -> None:
        self._inner, self._name, self._callback = inner, name, callback

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        # Lazy packages (transformers' _LazyModule) replace themselves in sys.modules.
        self._callback(sys.modules.get(self._name, module))


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callback) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, name, self.callback)
                sys.meta_path.remove(self)  # one-shot
                return spec
        return None


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    if name in sys.modules:
        callback(sys.modules[name])
    else:
        sys.meta_path.insert(0, _Finder(name, callback))
