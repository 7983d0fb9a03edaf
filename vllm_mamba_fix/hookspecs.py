"""The pluggy hook that decides whether a request is in scope for correction.

A deployment adds its own rule without forking: implement
``mamba_fix_in_scope`` with :data:`hookimpl` and expose the object under the
entry-point group :data:`ENTRY_POINT_GROUP`. The hook runs only when the
wrapper is about to change a chunk, never on the hot path.
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
        registered later run first; the built-in ones run last.
        """


class MultimodalScope:
    """``multimodal``: requests with encoder inputs (images, video, audio)."""

    @hookimpl(trylast=True)
    def mamba_fix_in_scope(self, request: Any, scope: str) -> bool | None:
        return bool(request.has_encoder_inputs) if scope == "multimodal" else None


class AllScope:
    """``all``: every request, for text-only hybrids in align mode too."""

    @hookimpl(trylast=True)
    def mamba_fix_in_scope(self, request: Any, scope: str) -> bool | None:
        return True if scope == "all" else None
