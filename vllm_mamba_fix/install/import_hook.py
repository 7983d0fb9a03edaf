"""Run a callback on the scheduler module once it is imported, without importing it early.

Processes that never import the scheduler (the front end, the workers) must not pay for it.
wrapt's post-import hooks cannot be removed, which ``unregister()`` and doctor's dry run need;
the semantics follow wrapt's: the callback runs once, on the import that succeeds; a module
another thread is importing is waited for; a probing ``find_spec`` does not use the hook up.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.facts.targets import SCHEDULER_MODULE

TAG = __name__  # the scheduler module's hook in the record of changes
# The installation's one lock: register(), the deferred patch, each built scheduler's check and
# unregister() (re-entrant: the patch settles the base under it).
lock = threading.RLock()


class _NotifyingLoader(importlib.abc.Loader):
    """Runs the real loader, then the hook's callback on the fresh module."""

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
        self._loader.exec_module(module)  # raises: the hook stays for the next import
        self._on_loaded(module)


class PostImportHook(importlib.abc.MetaPathFinder):
    """Calls ``on_loaded(module)`` right after ``module_name`` is imported successfully."""

    def __init__(
        self, module_name: str, on_loaded: Callable[[ModuleType], None], tag: str = TAG
    ) -> None:
        self.module_name = module_name
        self._on_loaded = on_loaded
        self._tag = tag  # who armed it, in the record of changes
        self._searching = threading.local()  # keeps our own search below from finding us

    def install(self) -> None:
        """First on ``sys.meta_path``, recorded: ``unregister()`` takes it off again."""
        if self not in sys.meta_path:
            what = f"the import hook of {self.module_name}"
            installation.insert_first(sys.meta_path, self, self._tag, what, self.module_name)

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.module_name or getattr(self._searching, "active", False):
            return None
        self._searching.active = True
        try:
            finders = [f for f in sys.meta_path if f is not self]
            found = (getattr(f, "find_spec", None) for f in finders)
            specs = (find(fullname, path, target) for find in found if find is not None)
            spec = next((s for s in specs if s is not None), None)
        finally:
            self._searching.active = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _NotifyingLoader(spec.loader, self._on_loaded)
        return spec


_hook_lock = threading.Lock()


def pending_hook() -> PostImportHook | None:
    """The scheduler module's armed hook, if one waits for its import."""
    armed = installation.changes(TAG)
    return armed[-1].value if armed else None


def initialising(module: ModuleType) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _wait_for_import_in_progress(name: str) -> None:
    """Block while another thread holds ``name``'s import lock: only CPython's private
    ``_ModuleLockManager`` waits on it without starting an import; where it is missing, or
    waiting would deadlock, this does not wait."""
    try:
        from importlib._bootstrap import _ModuleLockManager  # type: ignore[attr-defined]

        with _ModuleLockManager(name):
            pass
    except Exception:  # ImportError, or CPython's _DeadlockError
        return


def when_scheduler_imported(callback: Callable[[ModuleType], None]) -> bool:
    """Run ``callback`` on the scheduler module now if it is imported (True), else on its
    import. Call it with no lock held that the callback takes: it may wait for another
    thread's import, whose callback takes that lock."""
    done = threading.Event()

    def run_once(module: ModuleType) -> None:
        with _hook_lock:
            if done.is_set():
                return
            done.set()
            installation.undo(lambda c: c.tag == TAG)  # the hook, used up
        callback(module)

    with _hook_lock:
        module = sys.modules.get(SCHEDULER_MODULE)
        if module is None and pending_hook() is None:
            PostImportHook(SCHEDULER_MODULE, run_once).install()
        elif module is None:
            return False  # a hook is armed already
    # Another thread may be importing the module: past our hook's place in the scan, or
    # executing it. Wait for it, then look again.
    _wait_for_import_in_progress(SCHEDULER_MODULE)
    module = sys.modules.get(SCHEDULER_MODULE)
    if module is None or initialising(module):
        return False  # the hook runs the callback (a same-thread import in progress, too)
    run_once(module)
    return True
