"""The plugin's logger (a child of ``vllm``: lines share vLLM's handler and format), the fields
its records carry for JSON logging, and the once-only report of a wrapper that fell back."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllm.mamba_fix")

# A record's facts ride on it as prefixed attributes (``extra=``) a JSON formatter shows as
# keys. Stable names: docs/deployment.md ("Log fields"), which a test holds to this table.
FIELD_PREFIX = "vllm_mamba_fix_"
FIELDS: dict[str, str] = {
    "event": "what the record says (one of EVENTS)",
    "request_id": "vLLM's request id",
    "rule": "the rule that acted: split, block-unit or speculative-stall",
    "action": "what a correction did (collapse-prevented, realigned, ...)",
    "position": "the prompt token the request is at (a chunk's start)",
    "tokens": "tokens scheduled by the correction",
    "prompt_tokens": "the request's prompt length",
    "block": "the Mamba KV cache's block: the unit corrections align to",
    "configured_block": "cache_config.block_size, which vLLM's own split uses",
    "scheduler_class": "the scheduler class, module.Class",
    "rules": "the rules that run on the scheduler class (a list)",
    "wraps": "the methods the plugin wraps for the class (a list)",
    "cause": "a stall's likely cause",
    "seconds": "how long the stall has lasted, in seconds",
    "steps": "scheduler steps the stall has lasted",
    "method": "a scheduler method the record is about",
    "problem": "why something stands down or is left stock",
    "counts": "this process's counters (the stats() keys)",
    "version": "the plugin's version",
    "vllm_version": "vLLM's version",
    "family": "the vLLM family the release belongs to",
    "scope": "VLLM_MAMBA_FIX_SCOPE in effect",
    "reasons": "why each rule runs or is left out, by rule (basis: reason)",
    "settings": "the settings away from their defaults, by short name (scope, stall_seconds...)",
    "vllm_issue": "the upstream vLLM issue a known-issue record names",
}
EVENTS: dict[str, str] = {
    "correction": "a chunk changed: info for a request's first, debug after",
    "active": "the rules that run on a scheduler class (once per class built)",
    "not-needed": "no rule runs on a scheduler class",
    "block-engaged": "the block-unit rule engaged: the two block sizes differ",
    "block-mismatch": "the two block sizes differ and the block-unit rule does not run",
    "stands-down": "a rule stands down for a scheduler (the problem says why)",
    "not-reached": "a scheduler class overrides or replaces a method the fix wraps",
    "stall-named": "the watchdog named a stall",
    "stall-moved": "a named stall's request moved again",
    "stall-ended": "the plugin ended a named stall's request",
    "summary": "the process's counters at shutdown",
    "fallback": "a wrapper failed and vLLM's own result stood",
    "known-issue": "a known vLLM problem of the built set-up, which the plugin cannot fix",
    "setup": "install-time news: the policy, a problem, a setting, a stream, a scope rule",
}


def fields(event: str, **facts: Any) -> dict[str, Any]:
    """The ``extra=`` of a record; on hot paths, build it only for a record that is emitted."""
    return {FIELD_PREFIX + name: value for name, value in {"event": event, **facts}.items()}


def failure_reporter(what: str) -> Callable[[Exception, Any], Any]:
    """A wrapper's fallback: vLLM's own answer stands (never break the host), said once."""
    reported = False

    def fall_back(exc: Exception, stock: Any) -> Any:
        nonlocal reported
        if not reported:
            reported = True
            why = f"{what} failed ({type(exc).__name__}: {exc})"
            extra = fields("fallback", problem=why)
            logger.warning("vllm-mamba-fix: %s; using vLLM's result", why, extra=extra)
        return stock

    return fall_back
