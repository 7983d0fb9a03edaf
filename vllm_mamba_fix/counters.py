"""Per-process counters of corrections, and their log lines.

Log lines carry request ids and token counts only, never prompt content.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from vllm_mamba_fix._log import logger
from vllm_mamba_fix.decision import Action

# Requests whose first correction was logged at info; bounded so a long-running
# engine does not grow it forever (an evicted id only logs at info again).
_MAX_REMEMBERED_REQUESTS = 4096

_lock = threading.Lock()
_counts: dict[Action, int] = {action: 0 for action in Action if action is not Action.UNCHANGED}
# Stalls the watchdog named, and those that moved again afterwards.
_stalls = {"detected": 0, "resolved": 0}
_logged_requests: OrderedDict[str, None] = OrderedDict()
# The process that registered the summary; a forked child registers its own.
_summary_pid: int | None = None
# The alignment unit of the scheduler built last (0: none built, or unreadable).
_block_size = 0


def note_block_size(block_size: int) -> None:
    global _block_size
    with _lock:
        _block_size = block_size


def stats() -> dict[str, int]:
    """This process's correction counters, and the block size corrections align to."""
    with _lock:
        return {
            "block_size": _block_size,
            "collapses_prevented": _counts[Action.COLLAPSE_PREVENTED],
            "chunks_realigned": _counts[Action.REALIGNED],
            "chunks_stopped_at_encoder_input": _counts[Action.STOPPED_AT_ENCODER_INPUT],
            "speculative_stalls_released": _counts[Action.SPECULATIVE_STALL_RELEASED],
            "stalls_detected": _stalls["detected"],
            "stalls_resolved": _stalls["resolved"],
        }


def reset() -> None:
    global _block_size
    with _lock:
        _block_size = 0
        for action in _counts:
            _counts[action] = 0
        for kind in _stalls:
            _stalls[kind] = 0
        _logged_requests.clear()


def record(action: Action, request_id: str, start: int, num_tokens: int, block_size: int) -> None:
    with _lock:
        _counts[action] += 1
        first = request_id not in _logged_requests
        if first:
            _logged_requests[request_id] = None
            if len(_logged_requests) > _MAX_REMEMBERED_REQUESTS:
                _logged_requests.popitem(last=False)
        totals = _totals_text()
    line = "vllm-mamba-fix: %s for request %s at token %d: scheduling %d tokens (block size %d)"
    if first:
        # The running totals ride on the line logged once per request: the shutdown summary
        # is lost where the engine core is killed (vllm serve's default --shutdown-timeout 0).
        logger.info(line + "; %s", action.value, request_id, start, num_tokens, block_size, totals)
    else:
        logger.debug(line, action.value, request_id, start, num_tokens, block_size)


def _totals_text() -> str:
    return (
        f"this process so far: {_counts[Action.COLLAPSE_PREVENTED]} collapses prevented, "
        f"{_counts[Action.REALIGNED]} re-aligned, "
        f"{_counts[Action.STOPPED_AT_ENCODER_INPUT]} stopped at an encoder input, "
        f"{_counts[Action.SPECULATIVE_STALL_RELEASED]} speculative stalls released, "
        f"{_stalls['detected']} stalls named"
    )


def record_stall(resolved: bool = False) -> None:
    with _lock:
        _stalls["resolved" if resolved else "detected"] += 1


def log_summary() -> None:
    """Logged at process shutdown when anything was corrected."""
    counts = stats()
    counts.pop("block_size")
    if any(counts.values()):
        logger.info(
            "vllm-mamba-fix: this process prevented %d collapses, re-aligned %d chunks, "
            "stopped %d chunks at an encoder input, released %d speculative stalls, and "
            "named %d stalls (%d moved again)",
            counts["collapses_prevented"],
            counts["chunks_realigned"],
            counts["chunks_stopped_at_encoder_input"],
            counts["speculative_stalls_released"],
            counts["stalls_detected"],
            counts["stalls_resolved"],
        )


def register_shutdown_summary() -> None:
    """Log the summary at exit, in engine-core subprocesses too.

    multiprocessing's finalizers run both at interpreter exit and when a
    multiprocessing child ends (where ``atexit`` does not run after a fork).
    """
    global _summary_pid
    with _lock:
        if _summary_pid == os.getpid():
            return
        _summary_pid = os.getpid()
    from multiprocessing import util

    util.Finalize(None, log_summary, exitpriority=10)
