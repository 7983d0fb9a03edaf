# Rule:     stall-end (Rule.STALL_END in rules/table.py; VLLM_MAMBA_FIX_END_STALLS_AFTER, 60 s
#           by default, off with 0 or "off")
# Answers:  no vLLM issue of its own: a stall no rule can end (the request's own encoder inputs
#           can never be scheduled together, or stalled requests hold the encoder cache space
#           each other needs) holds its request, and the queue behind it, forever. It is
#           ended with vLLM's own scheduler-side finish, so the client reads why.
# Runs on:  where the watchdog runs and the class has update_from_output and finish_requests
#           (rules/end_order.py: support); every release 0.15.0-0.33.0 has that path. Its
#           wrapper also carries the watchdog's per-step look (rules/stall_look.py).
# Decided:  by its setting, and on only with the watchdog (decide/policy.py:
#           stall_end_verdict).
# Removed:  with the watchdog.
"""Ending a stall no rule can end: one request, with vLLM's own scheduler-side finish. Every release
0.15.1-0.33.0 ends a request that fails a KV load inside ``update_from_output`` with
``finish_requests(ids, FINISHED_ERROR)`` (freeing its blocks and encoder inputs) and one
``EngineCoreOutput`` in ``outputs[request.client_index]``; the request is read before, as the return
differs by release. ``FinishReason.ERROR`` reaches the client as HTTP 500 with the cause lost, so
0.15-0.32 end with ABORT and the message as ``stop_reason``; 0.33 carries it in
``EngineCoreOutput.error`` (``FINISHED_ERROR``). The safe point: ``EngineCore`` processes client
aborts right before ``update_from_output``; the wrapper ends the ordered requests there and appends
their outputs to vLLM's. The order comes from the watchdog's look at an earlier step
(docs/reliability.md, "Ending stalls")."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

from vllm_mamba_fix._log import failure_reporter, logger
from vllm_mamba_fix._log import fields as log_fields
from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.observe import counters
from vllm_mamba_fix.rules import end_order, stall_look, stall_watch
from vllm_mamba_fix.rules.end_order import EndOrder, take_orders
from vllm_mamba_fix.rules.marking import marked


class EndOptions(NamedTuple):
    """Options of the ``update_from_output`` wrapper (None: that part is off)."""

    stall_seconds: float | None  # of 0 tokens before the watchdog names a stall
    end_stalls_after: float | None = None  # after naming, before a proven stall is ended


def _request_error(message: str) -> Any:
    """0.33's RequestError with the message, where EngineCoreOutput carries one; else None."""
    from vllm.v1.engine import EngineCoreOutput

    if "error" not in getattr(EngineCoreOutput, "__struct_fields__", ()):
        return None
    try:
        from vllm.outputs import RequestError
    except ImportError:
        return None
    return RequestError(code="stalled_request", message=message, retryable=False)


def _end(scheduler: Any, order: EndOrder, scheduled: Any) -> tuple[int, Any] | None:
    """Finish one ordered request if it is still stalled there; its output for the client."""
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.request import RequestStatus

    rid = order.request_id
    request = scheduler.requests.get(rid)
    if (
        request is None
        or request.is_finished()
        or rid in scheduled
        or request.num_computed_tokens != order.computed
        or order.store.by_request.get(rid) is not order.streak
        or order.streak.position != order.position
    ):
        return None  # it moved, finished or was freed since (_end_orders: it may be ordered again)
    error = _request_error(order.message)
    status = RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_ABORTED
    scheduler.finish_requests(rid, status)
    if not request.is_finished():
        return None
    fields: dict[str, Any] = {
        "request_id": rid,
        "new_token_ids": [],
        "finish_reason": FinishReason.ERROR if error else FinishReason.ABORT,
        "stop_reason": order.message,
        "events": request.take_events() if hasattr(request, "take_events") else None,
        "trace_headers": getattr(request, "trace_headers", None),
    }
    if error is not None:
        fields["error"] = error
    order.store.clear(rid)
    counters.record_stall_ended(rid)
    cause = order.streak.cause.value if order.streak.cause else None
    extra = log_fields("stall-ended", request_id=rid, position=order.position, cause=cause)
    logger.warning("vllm-mamba-fix: %s", order.log_line, extra=extra)
    return request.client_index, EngineCoreOutput(**fields)


def _deliver(outputs: Any, ended: list[tuple[int, Any]]) -> None:
    from vllm.v1.engine import EngineCoreOutputs

    for client, output in ended:
        engine_outputs = outputs.get(client)
        if engine_outputs is None:
            outputs[client] = EngineCoreOutputs(outputs=[output])
        else:
            engine_outputs.outputs.append(output)


def make_update_from_output_wrapper(
    original: Callable[..., Any], options: Any
) -> Callable[..., Any]:
    """Wrap ``update_from_output``: end the ordered requests first, as vLLM ends aborts, then
    let the watchdog look at the step (one dict lookup and a clock read per step). A step
    without orders or counts reads two of the session's objects, held here: every call into
    the package's functions costs microseconds in a step that has evicted them from cache."""
    memory = installation.memory  # the session's, held (the session that made it removes it)
    orders, tally, getpid = memory[end_order.Orders], memory[counters.Tally], os.getpid
    fall_back = failure_reporter("ending a stalled request")
    watch_failed = failure_reporter("the stall watchdog")
    seconds = options.stall_seconds
    observe = None
    if seconds is not None:  # the watchdog's look, handed its rule (rules/stall_look.py)
        observe = stall_look.make_observer(
            stall_look.Watching(seconds, options.end_stalls_after, stall_watch)
        )

    def wrapper(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        # Any scheduler's (the weak dictionary's own dict: its truth is a C call, its len not)
        ended = _end_orders(self, scheduler_output, fall_back) if orders.data else None
        if observe is not None:
            try:
                observe(self, scheduler_output)
            except Exception as exc:
                watch_failed(exc, None)
        outputs = original(self, scheduler_output, *args, **kwargs)
        tally.step_sender_pid = getpid()  # counters.Tally.step_sender_pid says why
        # A logged correction reaches /metrics before its step's outputs, a quiet one within
        # a second or when no request runs (counters.Tally.send_after).
        if tally.unsent and (
            tally.send_after <= counters.clock() or not getattr(self, "running", True)
        ):
            counters.send_counts()
        if ended:
            try:
                _deliver(outputs, ended)
            except Exception as exc:
                fall_back(exc, None)
        return outputs

    return marked(wrapper, original, options)


def _end_orders(
    scheduler: Any, scheduler_output: Any, fall_back: Callable[[Exception, Any], Any]
) -> list[tuple[int, Any]]:
    """Carry out the orders left for ``scheduler``; the outputs of those it ended."""
    pending = take_orders(scheduler)
    ended: list[tuple[int, Any]] = []
    if not pending:
        return ended
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", {})
    for order in pending:
        try:
            done = _end(scheduler, order, scheduled)
        except Exception as exc:
            done = None
            fall_back(exc, None)
        if done is not None:
            ended.append(done)
        else:
            # Not ended (it moved, or the end failed): a later 0 may order it again.
            order.streak.ordered = False
    return ended
