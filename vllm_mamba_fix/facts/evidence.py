"""What the installed scheduler's code shows, read once when it is patched.

A version number can mislead: a dev build of 0.28.0 made before upstream's
fix (#51603) still hangs, and a vendor 0.27.x with the fix backported does
not. The code tells them apart:

- the split deadlocks when ``Scheduler.schedule`` budgets encoder inputs
  (``_try_schedule_encoder_inputs``) before it calls
  ``_mamba_block_aligned_split``;
- the speculative encoder stall needs ``_free_encoder_inputs`` to defer a free
  by a look-ahead.

The parsers are pure functions of source text; :func:`read_evidence` is the
only part that touches a class, and it never raises.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import textwrap
from dataclasses import dataclass
from types import CodeType

from vllm_mamba_fix.facts.targets import ENCODER_METHOD, FREE_METHOD, SPLIT_METHOD


@dataclass(frozen=True)
class Evidence:
    """None: the code could not tell (unreadable source, or a shape not seen before)."""

    split_after_encoder: bool | None = None
    deferred_encoder_free: bool | None = None
    problem: str | None = None  # why something could not be read
    # The class whose own ``schedule()`` was read (the first in the MRO that defines one).
    schedule_owner: str = "Scheduler"


UNREADABLE = Evidence(problem="no scheduler code was read")


_Function = ast.FunctionDef | ast.AsyncFunctionDef


def _function(source: str | _Function) -> _Function | None:
    if isinstance(source, _Function):
        return source  # parsed already (read_evidence parses each method once)
    try:
        tree = ast.parse(textwrap.dedent(source))
    except (SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return node
    return None


def _first_self_call_lines(function: ast.AST, names: tuple[str, ...]) -> dict[str, int]:
    """Line of the first ``self.<name>(...)`` call of each name, in source order."""
    first: dict[str, int] = {}
    for node in ast.walk(function):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
            and node.func.attr in names
        ):
            line = node.lineno
            first[node.func.attr] = min(line, first.get(node.func.attr, line))
    return first


def split_after_encoder(schedule_source: str | _Function) -> bool | None:
    """Whether ``schedule()`` budgets encoder inputs before its first split call."""
    function = _function(schedule_source)
    if function is None:
        return None
    lines = _first_self_call_lines(function, (SPLIT_METHOD, ENCODER_METHOD))
    if len(lines) != 2:
        return None
    return lines[ENCODER_METHOD] < lines[SPLIT_METHOD]


def deferred_encoder_free(free_source: str | _Function) -> bool | None:
    """Whether ``_free_encoder_inputs`` delays a free by a look-ahead.

    Every release that defers names the delay (``spec_lookahead``, or
    ``num_prefill_lookahead``) in code, not only in comments.
    """
    function = _function(free_source)
    if function is None:
        return None
    names = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(function) if isinstance(n, ast.Attribute)}
    return any("lookahead" in name for name in names)


def _last_line(code: CodeType) -> int:
    """The last source line ``code`` spans, nested functions' bodies included."""
    ends = [end for _, end, _, _ in code.co_positions() if end is not None]
    ends += [_last_line(c) for c in code.co_consts if isinstance(c, CodeType)]
    return max(ends, default=code.co_firstlineno)


def _lines_of(function: object) -> _Function | None:
    """The function parsed from its code object's line span: what ``inspect.getsource``
    finds, without tokenizing the file (most of start-up's cost on vLLM's long
    ``schedule()``). None where that cannot tell (Python 3.10, no file): ask inspect."""
    code = getattr(function, "__code__", None)
    if not isinstance(code, CodeType) or not hasattr(code, "co_positions"):
        return None
    lines = linecache.getlines(code.co_filename)
    return _function("".join(lines[code.co_firstlineno - 1 : _last_line(code)]))


def _source(cls: type, name: str) -> str | _Function | None:
    method = getattr(cls, name, None)
    if method is None:
        return None
    try:
        function = inspect.unwrap(method)
        return _lines_of(function) or inspect.getsource(function)
    except (OSError, TypeError):
        return None


def defining_class(cls: type, name: str) -> type | None:
    """The class in ``cls``'s MRO whose own namespace holds ``name``."""
    return next((klass for klass in cls.__mro__ if name in vars(klass)), None)


def read_evidence(scheduler_cls: type) -> Evidence:
    """Evidence from the `schedule()` `scheduler_cls` runs (its own or inherited); never raises."""
    owner_name = "Scheduler"
    try:
        owner_name = scheduler_cls.__name__
        owner = defining_class(scheduler_cls, "schedule")
        owner_name = owner.__name__ if owner is not None else owner_name
        schedule = _source(scheduler_cls, "schedule")
        free = _source(scheduler_cls, FREE_METHOD)
        order = split_after_encoder(schedule) if schedule else None
        deferred = deferred_encoder_free(free) if free else None
    except Exception as exc:  # a host quirk must never break vLLM
        return Evidence(problem=f"{type(exc).__name__}: {exc}", schedule_owner=owner_name)
    problem = None
    if order is None:
        problem = f"the order of the split and encoder budgeting in {owner_name}.schedule"
        problem = f"could not read {problem}"
    return Evidence(order, deferred, problem, owner_name)
