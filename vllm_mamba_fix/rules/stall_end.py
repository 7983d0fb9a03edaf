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
"""Ending a stall no rule can end: one request, with vLLM's own scheduler-side finish.

How a finish the scheduler decides reaches the client (read in every release's
``v1/core/sched/scheduler.py``, ``v1/engine/core.py``, ``v1/engine/output_processor.py``
and the OpenAI serving code, 0.15.1 to 0.33.0):

- Every family, 0.15-0.16, 0.17-0.23, 0.24-0.25, 0.26, 0.27, 0.28-0.32 and 0.33, ends
  requests it fails on a KV-load failure (0.26+ also on a grammar error) the same way,
  inside ``update_from_output``: ``self.finish_requests(ids, RequestStatus.FINISHED_ERROR)``,
  then one ``EngineCoreOutput(request_id, new_token_ids=[], finish_reason=..., events=...,
  trace_headers=...)`` per request appended to ``outputs[request.client_index]``. The
  returned ``dict[int, EngineCoreOutputs]`` is what ``EngineCore.step`` (and
  ``step_with_batch_queue``) puts on the output queue; ``finish_requests`` frees the KV
  blocks and the encoder cache entries (``_free_request``), removes the request from
  ``running``/``waiting`` (0.27+: also ``skipped_waiting``) and records it in
  ``finished_req_ids`` (the workers drop it) and ``finished_req_ids_dict`` (DP's
  ``EngineCoreOutputs.finished_requests``).
- ``finish_requests`` returns None (0.15-0.16), ``[(id, client_index)]`` (0.17-0.25) or
  the requests (0.26+); this module reads the request before and ignores the return.
- ``FinishReason.ERROR`` reaches the OpenAI server as ``finish_reason == "error"``, which
  ``_raise_if_error`` turns into HTTP 500 "Internal server error" on every release: the
  cause would be lost. ``FinishReason.ABORT`` reaches the client as a finished choice
  with ``finish_reason: "abort"`` and the output's string ``stop_reason`` (chat and
  completions, streamed or not): so 0.15-0.32 end with ABORT and the message as
  ``stop_reason``. 0.33 adds ``EngineCoreOutput.error`` (a ``RequestError``), which the
  front end raises as ``GenerationError(message)``: there the end is
  ``FINISHED_ERROR`` with the message as that error (HTTP 500 with the message).
- The safe point: ``EngineCore`` calls ``_process_aborts_queue()`` (client aborts,
  through ``finish_requests``) right before ``update_from_output`` in every release.
  The wrapper of ``update_from_output`` ends the ordered requests at that same point,
  before vLLM's own update, then appends their outputs to vLLM's. ``schedule()`` never
  runs then, so no queue is mutated while it iterates; the decision itself is taken by
  the watchdog's look at the previous step (in this same wrapper, after the ends) and only
  recorded.
- No release lacks the path. A scheduler class it cannot reach (the wrapper not
  installed, an ``update_from_output`` of another shape) is named by
  :func:`vllm_mamba_fix.rules.end_order.support`, and its stalls stay named, not ended.

When (see docs/reliability.md, "Ending stalls"): a stall the watchdog named, still
at the same position ``end_stalls_after`` seconds later and after two more 0s, and
only if the request's own encoder inputs cannot be scheduled whatever other requests
do (:func:`vllm_mamba_fix.decide.stalls.own_inputs_block`), or it is the one victim of
named stalls that hold the encoder cache space each other needs
(:func:`vllm_mamba_fix.decide.stalls.cross_hold_block`). A request kept by budget,
preemption, churn or cache entries of a request that can still move is never ended.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_mamba_fix._log import failure_reporter, logger
from vllm_mamba_fix._log import fields as log_fields
from vllm_mamba_fix.observe import counters
from vllm_mamba_fix.rules import stall_look, stall_watch
from vllm_mamba_fix.rules.end_order import EndOrder, take_orders
from vllm_mamba_fix.rules.marking import marked


@dataclass(frozen=True)
class EndOptions:
    """Options of the ``update_from_output`` wrapper, the carrier of the watchdog's look and
    of the stall end."""

    # Seconds of 0 tokens before the watchdog names a stall; None: the watchdog is off.
    stall_seconds: float | None
    # Seconds after a named stall no rule can end before its request is ended; None: off.
    end_stalls_after: float | None = None


# -- the safe point: update_from_output ------------------------------------------------------


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
        order.streak.ordered = False  # a later 0 there may order it again
        return None  # it moved, finished or was freed since: never end a moving request
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
    record_ended = getattr(counters, "record_stall_ended", None)
    if record_ended is not None:
        record_ended(rid)
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
    let the watchdog look at the step (:func:`vllm_mamba_fix.rules.stall_look.make_observer`).

    The hot path is one dict lookup and the watchdog's clock read; vLLM's own exceptions
    propagate, the plugin's never do.
    """
    fall_back = failure_reporter("ending a stalled request")
    watch_failed = failure_reporter("the stall watchdog")
    seconds = options.stall_seconds
    observe = None
    if seconds is not None:  # the watchdog's look, handed its rule (rules/stall_look.py)
        observe = stall_look.make_observer(
            stall_look.Watching(seconds, options.end_stalls_after, stall_watch)
        )

    def wrapper(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        ended = _end_orders(self, scheduler_output, fall_back)
        if observe is not None:
            try:
                observe(self, scheduler_output)
            except Exception as exc:
                watch_failed(exc, None)
        outputs = original(self, scheduler_output, *args, **kwargs)
        counters.step_ends()  # the step's corrections reach /metrics before its outputs
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
