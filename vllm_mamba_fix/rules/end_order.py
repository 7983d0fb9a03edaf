"""The order the watchdog (``stall_watch``) leaves for the stall end (``stall_end``, at the
safe point), so neither imports the other, and whether a scheduler can carry one out. vLLM's
types are read only inside :func:`support`."""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.decide.stalls import Streak
from vllm_mamba_fix.facts.targets import MARKER, UPDATE_METHOD

_OUTPUT_FIELDS = ("request_id", "new_token_ids", "finish_reason", "stop_reason")
# How the message a client reads begins (stall_watch writes it; stream_end recognises it).
CLIENT_MESSAGE_PREFIX = "vllm-mamba-fix ended this request"


class EndOrder(NamedTuple):
    request_id: str
    position: int
    computed: int  # request.num_computed_tokens when ordered: unchanged, or no end
    store: Any  # the ZeroStreaks holding ``streak`` (not imported: the import chain's limit)
    streak: Streak
    log_line: str
    message: str  # what the client reads


def support(scheduler_cls: type) -> str | None:
    """Why stalls of ``scheduler_cls`` cannot be ended on this vLLM, or None (doctor)."""
    name = f"{scheduler_cls.__module__}.{scheduler_cls.__qualname__}"
    for method in (UPDATE_METHOD, "finish_requests"):
        if not callable(getattr(scheduler_cls, method, None)):
            return f"{name} has no {method}"
    try:
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
        from vllm.v1.request import RequestStatus
    except Exception as exc:
        return f"vLLM's engine-core output types cannot be imported ({type(exc).__name__})"
    fields = getattr(EngineCoreOutput, "__struct_fields__", ())
    missing = [f for f in _OUTPUT_FIELDS if f not in fields]
    if missing or "outputs" not in getattr(EngineCoreOutputs, "__struct_fields__", ()):
        return f"vLLM's EngineCoreOutput(s) lack {', '.join(missing) or 'outputs'}"
    if not hasattr(FinishReason, "ABORT") or not hasattr(RequestStatus, "FINISHED_ABORTED"):
        return "vLLM has no abort finish for the scheduler to use"
    return None


def support_of(scheduler: Any) -> str | None:
    """:func:`support`, and whether this scheduler's class runs the plugin's update wrapper."""
    cls = type(scheduler)
    if getattr(getattr(cls, UPDATE_METHOD, None), MARKER, None) is None:
        return f"the plugin's {UPDATE_METHOD} wrapper is not installed on {cls.__qualname__}"
    return support(cls)


class Orders(weakref.WeakKeyDictionary[Any, dict[str, EndOrder]]):
    """The session's memory: per scheduler, request id -> its end order."""


def order_end(scheduler: Any, order: EndOrder) -> None:
    installation.memory[Orders].setdefault(scheduler, {})[order.request_id] = order


def take_orders(scheduler: Any) -> list[EndOrder]:
    """The orders left for ``scheduler``, taken: each is carried out once or dropped."""
    pending = installation.memory[Orders]
    orders = pending.pop(scheduler, None) if pending else None
    return list(orders.values()) if orders else []


def ordered(scheduler: Any) -> frozenset[str]:
    return frozenset(installation.memory[Orders].get(scheduler) or ())
