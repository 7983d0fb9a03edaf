"""The plugin's session, as pytest's ``MonkeyPatch``: every change the plugin makes to vLLM and
the process is made through :data:`installation`, which keeps what reverts it, and all the
plugin remembers is in its :class:`Memory`. ``unregister()`` closes it (changes undone newest
first, once; memory forgotten), so a new ``register()`` starts as in a fresh process. A change
someone else overwrote since is left as they left it; instances are held weakly; an attribute
the plugin did not set is never overwritten; undoing never raises. Imports nothing of ours."""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

# As _log.py names them (a test holds them equal): the session lengthens no chain of imports.
_logger = logging.getLogger("vllm.mamba_fix")
_FIELD_PREFIX = "vllm_mamba_fix_"
_MISSING: Any = object()
INSTANCE_TAG = "instance attributes"


class Change(NamedTuple):  # the session finds and removes a change by identity (``is``)
    tag: str  # who made it: the module's name (its kind, after a colon, where it has two)
    what: str  # for a reader: what was changed
    revert: Callable[[], None]
    target: Any = None  # the class, list or registry changed (None: an instance, held weakly)
    name: str | None = None  # the attribute, variable or module name, where there is one
    value: Any = None  # what the plugin put there


class _Owned:
    change: Change | None = None

    def __init__(self, ref: weakref.ref[Any]) -> None:
        self.ref = ref
        self.names: set[str] = set()


def _namespace(instance: Any) -> dict[str, Any] | None:
    space = getattr(instance, "__dict__", None)
    return space if isinstance(space, dict) else None


def _weak(instance: Any) -> weakref.ref[Any] | None:
    try:
        return weakref.ref(instance)
    except TypeError:
        return None


def _type_name(instance: Any) -> str:
    return f"{type(instance).__module__}.{type(instance).__qualname__}"


class Memory(dict[type, Any]):
    """``memory[Kind]`` is ``Kind()``, made on first use; a hit runs no Python code (hot paths)."""

    def __missing__(self, kind: type) -> Any:
        return self.setdefault(kind, kind())  # one instance, whichever thread makes it


class Changes:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._changes: list[Change] = []
        self._instances: dict[int, _Owned] = {}  # id(instance) -> what the plugin set there
        self.memory = Memory()  # until close()
        self._said: set[str] = set()  # the lines say_once said

    def say_once(
        self, level: int, message: str, *args: Any, event: str | None = "setup", **facts: Any
    ) -> bool:
        """Log ``vllm-mamba-fix: <message>`` (a ``%`` template) once per session; whether it was."""
        with self._lock:
            if message in self._said:
                return False
            self._said.add(message)
        facts = {"event": event, **facts} if event is not None else {}
        extra = {_FIELD_PREFIX + k: v for k, v in facts.items()} or None
        if not args:  # a line without args is never %-formatted
            message, args = "%s", (message,)
        _logger.log(level, "vllm-mamba-fix: " + message, *args, extra=extra)
        return True

    def close(self) -> bool:
        undone = self.undo()
        with self._lock:
            self.memory, self._said = Memory(), set()
        return undone

    def record(self, tag: str, what: str, revert: Callable[[], None], target: Any = None,
               name: str | None = None, value: Any = None) -> Change:  # fmt: skip
        change = Change(tag, what, revert, target, name, value)
        with self._lock:
            self._changes.append(change)
        return change

    def set_attr(self, target: Any, name: str, value: Any, tag: str) -> Change:
        """``setattr`` on a class or module; undone while its own namespace holds ``value``."""
        previous = vars(target).get(name, _MISSING)

        def revert() -> None:
            if vars(target).get(name, _MISSING) is not value:
                return  # someone else's since: left as they left it
            if previous is _MISSING:
                delattr(target, name)
            else:
                setattr(target, name, previous)

        with self._lock:
            setattr(target, name, value)
            what = f"{getattr(target, '__qualname__', target)!s}.{name}"
            return self.record(tag, what, revert, target, name, value)

    def set_env(self, name: str, value: str, tag: str) -> Change | None:
        """``os.environ[name] = value``, undone while it holds ``value``; set again: no record."""
        with self._lock:
            current = os.environ.get(name)
            if current == value and self.changed(os.environ, name):
                return None

            def revert() -> None:
                if os.environ.get(name) != value:
                    return
                if current is None:
                    del os.environ[name]
                else:
                    os.environ[name] = current

            os.environ[name] = value
            return self.record(tag, f"${name}", revert, os.environ, name, value)

    def insert_first(self, items: list[Any], item: Any, tag: str, what: str, name: str) -> Change:
        def revert() -> None:
            if item in items:
                items.remove(item)

        with self._lock:
            items.insert(0, item)
            return self.record(tag, what, revert, items, name, item)

    def set_on(self, instance: Any, name: str, value: Any) -> bool:
        """Set ``instance.<name>`` (a scheduler's), undone by deleting it; refused (False, said
        once) where the plugin did not set what is there or cannot hold it weakly."""
        with self._lock:
            owned = self._own(instance, name)
            if owned is None:
                return False
            owned.names.add(name)
            try:
                setattr(instance, name, value)
            except Exception as exc:  # a class of its own __setattr__
                self.say_once(logging.WARNING, f"cannot set {name} ({type(exc).__name__}: {exc})")
                return False
        return True

    def replace_on(self, instance: Any, name: str, value: Any) -> bool:
        """Replace ``instance``'s own attribute (vLLM's), undone while it holds ``value``;
        refused (False, said once) where it is not its own or cannot be held weakly."""
        space, ref = _namespace(instance), _weak(instance)
        if ref is None or space is None or name not in space:
            why = f"cannot replace {name} of a {_type_name(instance)}: not its own attribute"
            self.say_once(logging.WARNING, why)
            return False
        previous = space[name]

        def revert() -> None:
            alive = ref()
            if alive is not None and vars(alive).get(name) is value:
                setattr(alive, name, previous)

        with self._lock:
            setattr(instance, name, value)
            self.record(INSTANCE_TAG, f"{name} of a {_type_name(instance)}", revert, None, name)
        return True

    def owns(self, instance: Any, name: str) -> bool:
        with self._lock:
            owned = self._instances.get(id(instance))
            return owned is not None and owned.ref() is instance and name in owned.names

    def _own(self, instance: Any, name: str) -> _Owned | None:
        """The record of ``instance`` if the plugin may set ``name`` there (lock held)."""
        owned = self._instances.get(id(instance))
        if owned is not None and owned.ref() is not instance:
            owned = None  # a dead instance's id, reused
        space = _namespace(instance)
        if space is not None and name in space and (owned is None or name not in owned.names):
            cls, problem = _type_name(instance), f"{name} is not the plugin's"
            why = f"left {name} of a {cls} as it is: the plugin did not set it"
            self.say_once(logging.WARNING, why, scheduler_class=cls, problem=problem)
            return None
        return owned or self._track(instance, space)

    def _track(self, instance: Any, space: dict[str, Any] | None) -> _Owned | None:
        ref = _weak(instance)
        if ref is None or space is None:
            cls = _type_name(instance)
            self.say_once(logging.WARNING, f"keeps no state on a {cls} (no weakref or namespace)")
            return None
        self._prune()  # a dead instance of the same id goes here
        owned, key = _Owned(ref), id(instance)

        def revert() -> None:
            with self._lock:
                if self._instances.get(key) is owned:
                    del self._instances[key]
            alive = ref()
            for name in sorted(owned.names & set(_namespace(alive) or ())):
                delattr(alive, name)

        owned.change = self.record(INSTANCE_TAG, f"attributes of a {_type_name(instance)}", revert)
        self._instances[key] = owned
        return owned

    def _prune(self) -> None:
        for key in [key for key, owned in self._instances.items() if owned.ref() is None]:
            change = self._instances.pop(key).change
            self._changes = [c for c in self._changes if c is not change]

    def changes(self, tag: str | None = None) -> list[Change]:
        with self._lock:
            return [c for c in self._changes if tag is None or c.tag == tag]

    def changed(self, target: Any, name: str) -> bool:
        with self._lock:
            return any(c.target is target and c.name == name for c in self._changes)

    def revert(self, change: Change | None) -> bool:
        """Undo one change now (an import hook used up); False: it was undone already."""
        return change is not None and self.undo(lambda c: c is change)

    def undo(self, where: Callable[[Change], bool] | None = None) -> bool:
        """Revert the changes ``where`` accepts, newest first, each once; whether any was."""
        with self._lock:
            chosen = [c for c in self._changes if where is None or where(c)]
            gone = {id(c) for c in chosen}
            self._changes = [c for c in self._changes if id(c) not in gone]
        for change in reversed(chosen):
            _run(change)
        return bool(chosen)


def _run(change: Change) -> None:
    try:
        change.revert()
    except Exception as exc:  # the others are still undone
        say_once(logging.WARNING, f"could not undo {change.what} ({type(exc).__name__}: {exc})")


# The process's one session: install/ drives it (register() adds, unregister() closes it).
installation = Changes()
say_once = installation.say_once
