"""The pluggy hook that decides whether a request is in scope for correction.

A deployment adds its own rule without forking: implement
``mamba_fix_in_scope`` with :data:`hookimpl` and expose the object under the
entry-point group :data:`ENTRY_POINT_GROUP`. The hook is asked on the rare paths
only: when the split wrapper is about to change a chunk, and on every 0 tokens a
request gets (each 0 of the encoder-input check, before the speculative-stall rule
and the watchdog look at it; with the watchdog on, each final 0 of the split too).
Other calls never ask it.

This module imports nothing of the plugin's (as pytest's ``hookspec.py``): a third party's
rule depends on it alone. The built-in rule is :class:`vllm_mamba_fix.decide.scope.BuiltinScope`.
"""

from __future__ import annotations

from typing import Any

import pluggy

PROJECT_NAME = "vllm_mamba_fix"
ENTRY_POINT_GROUP = "vllm_mamba_fix.scope"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class ScopeSpec:
    @hookspec(firstresult=True)
    def mamba_fix_in_scope(self, request: Any, scope: str) -> bool | None:  # type: ignore[empty-body]
        """Return True to correct this request's chunk, False to leave it, None to defer.

        ``scope`` is the configured ``VLLM_MAMBA_FIX_SCOPE``. Implementations
        registered later run first; the built-in one (``scope.BuiltinScope``) runs last.
        """
