"""The pluggy hook that decides whether a request is in scope for correction.

A deployment adds its own rule without forking: implement
``mamba_fix_in_scope`` with :data:`hookimpl` and expose the object under the
entry-point group :data:`ENTRY_POINT_GROUP`. The hook is asked on the rare paths
only: when the split wrapper is about to change a chunk, and on every 0 tokens a
request gets (each 0 of the encoder-input check, before the speculative-stall rule
and the watchdog look at it; with the watchdog on, each final 0 of the split too).
Other calls never ask it.
"""

from __future__ import annotations

from typing import Any

import pluggy

from vllm_mamba_fix.config import Scope, builtin_in_scope

PROJECT_NAME = "vllm_mamba_fix"
ENTRY_POINT_GROUP = "vllm_mamba_fix.scope"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class ScopeSpec:
    @hookspec(firstresult=True)
    def mamba_fix_in_scope(self, request: Any, scope: str) -> bool | None:  # type: ignore[empty-body]
        """Return True to correct this request's chunk, False to leave it, None to defer.

        ``scope`` is the configured ``VLLM_MAMBA_FIX_SCOPE``. Implementations
        registered later run first; the built-in one (:class:`BuiltinScope`) runs last.
        """


class BuiltinScope:
    """The built-in ``VLLM_MAMBA_FIX_SCOPE`` rule, registered once and asked last."""

    @hookimpl(trylast=True)
    def mamba_fix_in_scope(self, request: Any, scope: str) -> bool | None:
        try:
            configured = Scope(scope)
        except ValueError:
            return None  # not a scope the built-in rule knows: defer
        return builtin_in_scope(request, configured)
