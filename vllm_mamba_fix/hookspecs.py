"""The pluggy hook that decides whether a request is in scope for correction.

A deployment adds its own rule without forking: implement ``mamba_fix_in_scope`` with
:data:`hookimpl` and expose the object under the entry-point group :data:`ENTRY_POINT_GROUP`.
It is asked on the rare paths only: where the split wrapper may change a chunk, and on a 0 of
the split or the encoder-input check that a rule looks at.

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
        ``scope`` is ``VLLM_MAMBA_FIX_SCOPE``; later registrations run first, the built-in last."""
