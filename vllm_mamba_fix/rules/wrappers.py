# Carrier of: __init__ (the per-scheduler check) and _free_request (per-request state ends).
"""The wrappers around ``Scheduler.__init__`` (the per-scheduler check once it is built) and
``_free_request`` (per-request state ends with the request), installed by
:mod:`vllm_mamba_fix.install.patch`. A wrapper never raises anything of its own into vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_mamba_fix._log import failure_reporter
from vllm_mamba_fix.facts.targets import MARKER, SPLIT_METHOD
from vllm_mamba_fix.observe import counters, record
from vllm_mamba_fix.rules.marking import marked
from vllm_mamba_fix.rules.split_rule import WrapOptions
from vllm_mamba_fix.rules.split_settle import settle
from vllm_mamba_fix.rules.zero_streaks import forget_request


def settle_if_differs(scheduler: Any) -> None:
    """At construction, where the block sizes already differ: settle the split now."""
    wrapper = getattr(type(scheduler), SPLIT_METHOD, None)
    options = getattr(wrapper, MARKER, None)
    if isinstance(options, WrapOptions):
        _, unit = settle(scheduler, options)
        record.note_block_unit(type(scheduler), unit)


def make_init_wrapper(
    original: Callable[..., None], on_built: Callable[[Any], None]
) -> Callable[..., None]:
    """Wrap ``Scheduler.__init__``: ``on_built(scheduler)`` runs once the base has built it."""
    fall_back = failure_reporter("the check of a new scheduler")

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            on_built(self)
        except Exception as exc:
            fall_back(exc, None)

    return marked(__init__, original, on_built)


def make_free_request_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``Scheduler._free_request``: a finished or aborted request leaves no streak behind."""
    fall_back = failure_reporter("forgetting a finished request")

    def _free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, request, *args, **kwargs)
        try:
            forget_request(request.request_id)
            counters.stall_gone(request.request_id)  # the live stall gauge
        except Exception as exc:
            fall_back(exc, None)
        return result

    return marked(_free_request, original, True)
