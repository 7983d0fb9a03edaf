"""What the installed scheduler's code shows, read once when it is patched: a version number
can mislead (a 0.28 dev build before #51603 still hangs; a vendor 0.27.x with it backported
does not), so the code decides. :func:`read_evidence` alone touches a class, and never raises."""

from __future__ import annotations

import ast
import inspect
import io
import linecache
import textwrap
import tokenize
from types import CodeType
from typing import NamedTuple

from vllm_mamba_fix.facts.targets import ENCODER_METHOD, FREE_METHOD, SPLIT_METHOD


class Evidence(NamedTuple):  # None: the code could not tell (unreadable source, or a new shape)
    split_after_encoder: bool | None = None
    deferred_encoder_free: bool | None = None
    problem: str | None = None  # why something could not be read
    schedule_owner: str = "Scheduler"  # the class whose own schedule() was read


UNREADABLE = Evidence(problem="no scheduler code was read")

_Function = ast.FunctionDef | ast.AsyncFunctionDef


def _function(source: str | _Function) -> _Function | None:
    if isinstance(source, _Function):
        return source  # parsed already (read_evidence parses each method once)
    try:
        tree = ast.parse(textwrap.dedent(source))
    except (SyntaxError, ValueError):
        return None
    return next((node for node in tree.body if isinstance(node, _Function)), None)


def split_after_encoder(schedule: str | CodeType) -> bool | None:
    """Whether ``schedule()`` (source or code object) budgets encoder inputs before its first
    split call: the lines its code runs are tokenized, never parsed (parsing vLLM's 800-line
    ``schedule()`` was most of the patch's time)."""
    if isinstance(schedule, str):
        source = textwrap.dedent(schedule)
        try:
            module = compile(source, "<schedule>", "exec")
        except (SyntaxError, ValueError):
            return None
        code = next((c for c in module.co_consts if isinstance(c, CodeType)), None)
        lines = source.splitlines(keepends=True)
    else:
        code, lines = schedule, linecache.getlines(schedule.co_filename)
    running, codes = set(), [code] if code is not None else []
    while codes:  # nested functions' code too
        inner = codes.pop()
        running |= {line for _, _, line in inner.co_lines() if line is not None}
        codes += [c for c in inner.co_consts if isinstance(c, CodeType)]
    first: dict[str, int] = {}
    for number in sorted(n for n in running if 0 < n <= len(lines)):
        for name in (SPLIT_METHOD, ENCODER_METHOD):
            text = lines[number - 1]
            if name not in first and name in text and _calls_self(text, name):
                first[name] = number
    return first[ENCODER_METHOD] < first[SPLIT_METHOD] if len(first) == 2 else None


def _calls_self(line: str, name: str) -> bool:
    """Whether ``line`` holds ``self.<name>(`` as code, not in a comment or a string."""
    seen: list[str] = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline):
            seen = [*seen[-3:], token.string]
            if seen == ["self", ".", name, "("]:
                return True
    except (tokenize.TokenError, SyntaxError):  # a bracket the next line closes
        pass
    return False


def deferred_encoder_free(free_source: str | _Function) -> bool | None:
    """Whether ``_free_encoder_inputs`` delays a free by a look-ahead: every release that
    defers names one (``spec_lookahead``, ``num_prefill_lookahead``) in code."""
    function = _function(free_source)
    if function is None:
        return None
    names = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(function) if isinstance(n, ast.Attribute)}
    return any("lookahead" in name for name in names)


def _last_line(code: CodeType) -> int:
    ends = [end for _, end, _, _ in code.co_positions() if end is not None]
    ends += [_last_line(c) for c in code.co_consts if isinstance(c, CodeType)]
    return max(ends, default=code.co_firstlineno)


def _source(cls: type, name: str) -> str | _Function | None:
    """The method parsed from its code object's line span, without tokenizing the file as
    ``inspect.getsource`` does (most of start-up's cost); inspect where that cannot tell."""
    method = getattr(cls, name, None)
    if method is None:
        return None
    try:
        function = inspect.unwrap(method)
        code = getattr(function, "__code__", None)
        if isinstance(code, CodeType) and hasattr(code, "co_positions"):
            lines = linecache.getlines(code.co_filename)
            parsed = _function("".join(lines[code.co_firstlineno - 1 : _last_line(code)]))
            if parsed is not None:
                return parsed
        return inspect.getsource(function)
    except (OSError, TypeError):
        return None


def defining_class(cls: type, name: str) -> type | None:
    return next((klass for klass in cls.__mro__ if name in vars(klass)), None)


def read_evidence(scheduler_cls: type) -> Evidence:
    """Evidence from the `schedule()` `scheduler_cls` runs (its own or inherited); never raises."""
    owner_name = "Scheduler"
    try:
        owner_name = scheduler_cls.__name__
        owner = defining_class(scheduler_cls, "schedule")
        owner_name = owner.__name__ if owner is not None else owner_name
        method = getattr(scheduler_cls, "schedule", None)
        code = getattr(inspect.unwrap(method), "__code__", None) if method else None
        free = _source(scheduler_cls, FREE_METHOD)
        order = split_after_encoder(code) if isinstance(code, CodeType) else None
        deferred = deferred_encoder_free(free) if free else None
    except Exception as exc:  # a host quirk must never break vLLM
        return Evidence(problem=f"{type(exc).__name__}: {exc}", schedule_owner=owner_name)
    what = f"the order of the split and encoder budgeting in {owner_name}.schedule"
    problem = None if order is not None else f"could not read {what}"
    return Evidence(order, deferred, problem, owner_name)
