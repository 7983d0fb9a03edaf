"""Which requests the wrapper may correct: the built-in rule, or third parties' pluggy hook.

Third-party rules are loaded once, when the scheduler is patched; with none installed
pluggy is not even imported (a plain read of the entry points finds none).
"""

from __future__ import annotations

import importlib.metadata
import threading
from collections.abc import Callable
from typing import Any

from vllm_mamba_fix._log import fields, logger
from vllm_mamba_fix.facts.config import Scope, builtin_in_scope

# hookspecs.ENTRY_POINT_GROUP; not imported from there, which imports pluggy.
ENTRY_POINT_GROUP = "vllm_mamba_fix.scope"

ScopeHook = Callable[..., "bool | None"]


class BuiltinScope:
    """The built-in ``VLLM_MAMBA_FIX_SCOPE`` rule, registered once and asked last (marked
    ``trylast`` by :func:`load_third_party_hook`, the one place that imports pluggy)."""

    def mamba_fix_in_scope(self, request: Any, scope: str) -> bool | None:
        try:
            configured = Scope(scope)
        except ValueError:
            return None  # not a scope the built-in rule knows: defer
        return builtin_in_scope(request, configured)


def _scope_group_installed(group: str) -> bool:
    """Whether an installed distribution may name ``group`` in its entry points: a substring
    of the raw text, read without parsing (a false yes only costs building pluggy's manager,
    which then finds the truth). Any error says yes, to let pluggy look."""
    try:
        for dist in importlib.metadata.distributions():
            text = dist.read_text("entry_points.txt")
            if text and group in text:
                return True
    except Exception:
        return True
    return False


def load_third_party_hook() -> ScopeHook | None:
    """The pluggy hook when third-party rules are installed, else None."""
    if not _scope_group_installed(ENTRY_POINT_GROUP):
        return None  # register() pays for neither pluggy nor its entry-point scan
    try:
        import pluggy

        from vllm_mamba_fix import hookspecs

        manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        manager.add_hookspecs(hookspecs.ScopeSpec)
        hookspecs.hookimpl(trylast=True)(BuiltinScope.mamba_fix_in_scope)
        manager.register(BuiltinScope(), name="builtin")
        loaded = manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    except Exception as exc:
        logger.warning(
            "vllm-mamba-fix: could not load scope rules from entry points 'vllm_mamba_fix.scope' "
            "(%s: %s); using the built-in scope only",
            type(exc).__name__,
            exc,
            extra=fields("setup", problem=f"{type(exc).__name__}: {exc}"),
        )
        return None
    return manager.hook.mamba_fix_in_scope if loaded else None


class ScopePolicy:
    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self._hook: ScopeHook | None = None
        self._loaded = False
        self._lock = threading.Lock()
        self._hook_failed = False

    def load(self) -> None:
        """Load third-party rules now rather than on the first correction."""
        with self._lock:
            if not self._loaded:
                self._hook = load_third_party_hook()
                self._loaded = True

    def rules_out(self, request: Any) -> bool:
        """Out of scope for certain, with no hook to ask: lets the wrapper skip the rules."""
        if not self._loaded:
            self.load()
        return self._hook is None and not builtin_in_scope(request, self.scope)

    def in_scope(self, request: Any) -> bool:
        if not self._loaded:
            self.load()
        if self._hook is None:
            return builtin_in_scope(request, self.scope)
        try:
            answer = self._hook(request=request, scope=self.scope.value)
        except Exception as exc:
            # Built-in rule first: if it fails too, the request itself is unusable and
            # the caller reports that once, instead of blaming a scope hook as well.
            fallback = builtin_in_scope(request, self.scope)
            self._report_hook_failure(exc)
            return fallback
        return builtin_in_scope(request, self.scope) if answer is None else bool(answer)

    def _report_hook_failure(self, exc: Exception) -> None:
        log = logger.debug if self._hook_failed else logger.warning
        self._hook_failed = True
        problem = f"{type(exc).__name__}: {exc}"
        log(
            "vllm-mamba-fix: a scope hook raised %s: %s; using the built-in %r scope",
            type(exc).__name__, exc, self.scope.value,
            extra=fields("fallback", problem=problem, scope=self.scope.value),
        )  # fmt: skip


def builtin_scope(scope: Any) -> Scope | None:
    """The scope ``scope.rules_out()`` answers by the built-in rule alone (no third-party
    hook loaded), or None where it must be asked. Loads the hook first, as rules_out() does."""
    if not isinstance(scope, ScopePolicy) or type(scope).rules_out is not ScopePolicy.rules_out:
        return None  # another rules_out(): ask it
    scope.load()
    scoped = getattr(scope, "scope", None)
    alone = getattr(scope, "_loaded", False) is True and getattr(scope, "_hook", 0) is None
    return scoped if alone and isinstance(scoped, Scope) else None
