"""Which requests the wrapper may correct, asked through the pluggy hook.

pluggy and third-party entry points are loaded on the first correction, not at
start-up, and any failure there falls back to the built-in rule.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from vllm_mamba_fix._log import logger
from vllm_mamba_fix.config import Scope

if TYPE_CHECKING:
    import pluggy


def builtin_in_scope(request: Any, scope: Scope) -> bool:
    return scope is Scope.ALL or bool(request.has_encoder_inputs)


class ScopePolicy:
    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self._manager: pluggy.PluginManager | None = None
        self._lock = threading.Lock()
        self._hook_failed = False

    def in_scope(self, request: Any) -> bool:
        try:
            answer = self._plugin_manager().hook.mamba_fix_in_scope(
                request=request, scope=self.scope.value
            )
        except Exception as exc:
            # Built-in rule first: if it fails too, the request itself is unusable and
            # the caller reports that once, instead of blaming a scope hook as well.
            fallback = builtin_in_scope(request, self.scope)
            self._report_hook_failure(exc)
            return fallback
        return builtin_in_scope(request, self.scope) if answer is None else bool(answer)

    def _plugin_manager(self) -> pluggy.PluginManager:
        with self._lock:
            if self._manager is None:
                self._manager = self._build_manager()
            return self._manager

    @staticmethod
    def _build_manager() -> pluggy.PluginManager:
        import pluggy

        from vllm_mamba_fix import hookspecs

        manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        manager.add_hookspecs(hookspecs.ScopeSpec)
        manager.register(hookspecs.MultimodalScope(), name="builtin-multimodal")
        manager.register(hookspecs.AllScope(), name="builtin-all")
        try:
            manager.load_setuptools_entrypoints(hookspecs.ENTRY_POINT_GROUP)
        except Exception as exc:
            logger.warning(
                "vllm-mamba-fix: could not load scope hooks from entry points %r (%s: %s); "
                "using the built-in scope only",
                hookspecs.ENTRY_POINT_GROUP,
                type(exc).__name__,
                exc,
            )
        return manager

    def _report_hook_failure(self, exc: Exception) -> None:
        log = logger.debug if self._hook_failed else logger.warning
        self._hook_failed = True
        log(
            "vllm-mamba-fix: a scope hook raised %s: %s; using the built-in %r scope",
            type(exc).__name__,
            exc,
            self.scope.value,
        )
