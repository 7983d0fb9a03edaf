"""The names and expected shapes of the vLLM module, class and methods the plugin touches: the
one home the wrappers, the installer, the code evidence and doctor import. No vLLM import."""

from __future__ import annotations

import inspect
from typing import Any

# The split's trailing arguments and keywords, as its caller gave them (forwarded untouched).
Args = tuple[Any, ...]
Kwargs = dict[str, Any]

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
SCHEDULER_CLASS = "Scheduler"
SPLIT_METHOD = "_mamba_block_aligned_split"
ENCODER_METHOD = "_try_schedule_encoder_inputs"
FREE_METHOD = "_free_encoder_inputs"
INIT_METHOD = "__init__"  # wrapped: each built scheduler is checked once (class, block size)
FREE_REQUEST_METHOD = "_free_request"  # wrapped: per-request state ends with the request
UPDATE_METHOD = "update_from_output"  # wrapped: an ordered stall end runs where aborts do

SPLIT_LEADING_PARAMETERS = ("self", "request", "num_new_tokens")
EXTRA_COMPUTED_PARAMETERS = ("num_new_local_computed_tokens", "num_external_computed_tokens")
# Every release from 0.15 to 0.33 has exactly these.
ENCODER_PARAMETERS = (
    "self", "request", "num_computed_tokens", "num_new_tokens", "encoder_compute_budget",
    "shift_computed_tokens",
)  # fmt: skip
LEADING_PARAMETERS = {
    SPLIT_METHOD: SPLIT_LEADING_PARAMETERS,
    FREE_REQUEST_METHOD: ("self", "request"),
    UPDATE_METHOD: ("self", "scheduler_output", "model_runner_output"),
    INIT_METHOD: ("self",),
}

# Set on the plugin's wrappers (its value: their options), so a second patch recognises them.
MARKER = "__vllm_mamba_fix__"


def defined_scheduler(module: Any) -> Any:
    """The ``Scheduler`` class the module defines, even if a platform rebound the name
    (vllm-ascend's patch_balance_schedule.py binds its subclass)."""
    bound = getattr(module, SCHEDULER_CLASS, None)
    if not isinstance(bound, type):
        return bound
    name = (module.__name__, SCHEDULER_CLASS)
    return next((c for c in bound.__mro__ if (c.__module__, c.__qualname__) == name), bound)


def describe_function(function: Any) -> str:
    module = getattr(function, "__module__", None) or "?"
    name = getattr(function, "__qualname__", None) or getattr(function, "__name__", repr(function))
    return f"{module}.{name}"


def shape_problem(method: Any, qualified: str, name: str) -> str | None:
    """Why ``method`` (found as ``qualified``) cannot carry the wrapper of ``name``, or None."""
    if hasattr(method, MARKER):
        return f"{qualified} is already patched by vllm-mamba-fix"
    if not inspect.isfunction(method):
        return f"{qualified} is a {type(method).__name__}, not a plain method"
    if hasattr(method, "__wrapped__"):
        return f"{qualified} is already wrapped by another library"
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError) as exc:
        return f"the signature of {qualified} cannot be read ({exc})"
    parameters = tuple(signature.parameters)
    if name == ENCODER_METHOD:
        shift = signature.parameters.get("shift_computed_tokens")
        if parameters == ENCODER_PARAMETERS and shift is not None and shift.default == 0:
            return None
        expected = f"({', '.join(ENCODER_PARAMETERS)}=0)"
    else:
        leading = LEADING_PARAMETERS[name]
        if parameters[: len(leading)] == leading:
            return None
        expected = f"it to start with ({', '.join(leading)})"
    return f"{qualified} has an unexpected signature ({', '.join(parameters)}); expected {expected}"


def check_target(cls: type, name: str = SPLIT_METHOD) -> str | None:
    """Why ``cls.<name>`` (in the class's own namespace) cannot be patched, or None."""
    method = cls.__dict__.get(name)
    qualified = f"{cls.__name__}.{name}"
    if method is None:
        return f"{qualified} does not exist"
    return shape_problem(method, qualified, name)
