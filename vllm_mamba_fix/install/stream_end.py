# Rule:     stall-end, its client side in the API server (attached by register() where the
#           stall end is on)
# Answers:  on 0.15-0.32 vLLM's chat and completions stream generators skip an output with no
#           tokens before they read its finish, so a streaming client of an ended request
#           reads an empty success.
# Runs on:  0.15.0-0.32.x, on a generator whose source shows that skip (read_shape).
# Decided:  by vLLM's code, never by the version.
# Removed:  0.33 sends a RequestError that vLLM streams itself (EngineCoreOutput.error).
"""No engine-side output gets past that skip, so each generator's ``result_generator`` is
watched: a choice the plugin ended (``abort``, its cause as ``stop_reason``) with no token
streamed raises the release's ``GenerationError`` at the end, which the generator's own
``except`` turns into vLLM's error event before ``[DONE]``."""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import logging
import os
import sys
import textwrap
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

from vllm_mamba_fix.changes import installation, say_once
from vllm_mamba_fix.facts.targets import MARKER
from vllm_mamba_fix.install.import_hook import PostImportHook, initialising

# The rules' end_order and marking are imported when a generator is wrapped (_wrap), not with
# register(): most processes never import vLLM's serving modules.
RESULTS_PARAMETER = "result_generator"
ERROR_CLASS = "GenerationError"


class Target(NamedTuple):
    module: str
    cls: str
    method: str


TARGETS = (
    Target("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat",
           "chat_completion_stream_generator"),
    Target("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion",
           "completion_stream_generator"),
)  # fmt: skip


class Shape(NamedTuple):
    """What a stream generator's source shows. ``applies``: the skip drops the finish."""

    applies: bool
    reason: str  # why not, or what was found
    pairs: bool = False  # the results are (prompt index, RequestOutput) pairs


def _name(node: ast.AST) -> str:  # delta_text of delta_text or of output.delta_text
    return getattr(node, "id", None) or getattr(node, "attr", "")


def _is_empty_skip(node: ast.If) -> bool:
    """``if not <text> and not <token ids> and ...: continue``."""
    test, body = node.test, node.body
    if not (len(body) == 1 and isinstance(body[0], ast.Continue)):
        return False
    if not (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And)):
        return False
    negated = [_name(v.operand) for v in test.values
               if isinstance(v, ast.UnaryOp) and isinstance(v.op, ast.Not)]  # fmt: skip
    return any(n.endswith("text") for n in negated) and any(
        n.endswith("token_ids") for n in negated
    )


def _yields_on_error(node: ast.AST) -> bool:  # except GenerationError: ... yield ...
    if not (isinstance(node, ast.ExceptHandler) and isinstance(node.type, ast.Name)):
        return False
    return node.type.id == ERROR_CLASS and any(isinstance(n, ast.Yield) for n in ast.walk(node))


def read_shape(source: str) -> Shape:
    """The shape of one stream generator's source. A pure function; never raises."""
    try:
        tree = ast.parse(textwrap.dedent(source))
    except (SyntaxError, ValueError):
        return Shape(False, "its source does not parse")
    function = next((n for n in tree.body if isinstance(n, ast.AsyncFunctionDef)), None)
    if function is None:
        return Shape(False, "it is not an async function")
    loops = [
        n for n in ast.walk(function)
        if isinstance(n, ast.AsyncFor) and isinstance(n.iter, ast.Name)
        and n.iter.id == RESULTS_PARAMETER
    ]  # fmt: skip
    if len(loops) != 1:
        return Shape(False, f"it has no single `async for` over {RESULTS_PARAMETER}")
    pairs = isinstance(loops[0].target, ast.Tuple) and len(loops[0].target.elts) == 2
    skips = [n for n in ast.walk(loops[0]) if isinstance(n, ast.If) and _is_empty_skip(n)]
    if not skips:
        return Shape(False, "no skip of empty outputs was found")
    if any("finish_reason" in map(_name, ast.walk(skip.test)) for skip in skips):
        return Shape(False, "its skip keeps a finishing output (vLLM sends the finish)")
    if not any(_yields_on_error(n) for n in ast.walk(function)):
        return Shape(False, f"it has no `except {ERROR_CLASS}` that yields an error event")
    return Shape(True, "its skip drops a finish with no tokens", pairs)


def _engine_sends_errors() -> bool:
    """0.33+: the stall end sends a RequestError, which vLLM's stream reports itself."""
    from vllm.v1.engine import EngineCoreOutput

    return "error" in getattr(EngineCoreOutput, "__struct_fields__", ())


class Watch:
    """``result_generator``, item for item; at its end, the error for a choice the plugin ended
    that never streamed a token (vLLM sends the others' finish itself)."""

    def __init__(self, source: Any, pairs: bool, error_cls: type[Exception]) -> None:
        from vllm_mamba_fix.rules.end_order import CLIENT_MESSAGE_PREFIX

        self._source, self._pairs, self._error_cls = source, pairs, error_cls
        self._prefix = CLIENT_MESSAGE_PREFIX
        self._streamed: set[tuple[Any, Any]] = set()
        self._ended: str | None = None

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> Any:
        try:
            item = await self._source.__anext__()
        except StopAsyncIteration:
            message, self._ended = self._ended, None
            if message is None:
                raise
            raise self._error_cls(message) from None
        try:  # not contextlib.suppress: this runs once per streamed output
            self._look(item)
        except Exception:  # an item of a shape not seen: passed on unread
            return item
        return item

    def _look(self, item: Any) -> None:
        prompt, result = item if self._pairs else (None, item)
        for output in result.outputs:
            key = (prompt, output.index)
            if output.token_ids or output.text:
                self._streamed.add(key)
            elif self._ended is None and key not in self._streamed:  # the plugin's end, no token
                reason = getattr(output, "stop_reason", None)
                ours = isinstance(reason, str) and reason.startswith(self._prefix)
                if ours and getattr(output, "finish_reason", None) == "abort":
                    self._ended = reason

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # never the source's private state (nor a loop before init)
            raise AttributeError(name)
        return getattr(self._source, name)


def _wrap(original: Callable[..., Any], shape: Shape, error_cls: type[Exception]) -> Any:
    from vllm_mamba_fix.rules.marking import marked

    # Counts self, which args here exclude.
    position = list(inspect.signature(original).parameters).index(RESULTS_PARAMETER)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            if RESULTS_PARAMETER in kwargs:
                kwargs[RESULTS_PARAMETER] = _watched(kwargs[RESULTS_PARAMETER])
            elif len(args) >= position:
                i = position - 1
                args = (*args[:i], _watched(args[i]), *args[i + 1 :])
        except Exception:  # the plugin never breaks a stream: vLLM's own arguments stand
            pass
        return original(self, *args, **kwargs)

    def _watched(source: Any) -> Any:
        iterates = callable(getattr(source, "__anext__", None))
        return Watch(source, shape.pairs, error_cls) if iterates else source

    return marked(wrapper, original, shape)


_lock = threading.Lock()
TAG = __name__  # the wrapped generators, in the record of changes
HOOK_TAG = f"{__name__}:hooks"  # the hooks waiting for a serving module's import


def _decide(module: ModuleType, target: Target) -> tuple[type, Any, Shape, Any] | str | None:
    """(class, method, shape, error class) to wrap; a problem line; or None (not needed)."""
    cls = getattr(module, target.cls, None)
    method = getattr(cls, target.method, None) if isinstance(cls, type) else None
    name = f"{target.cls}.{target.method}"
    if method is None or not inspect.isasyncgenfunction(method):
        return f"{name} is missing or not an async generator"
    if hasattr(method, MARKER):
        return None  # already wrapped
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):
        return f"{name}'s source cannot be read"
    shape = read_shape(source)
    if not shape.applies:
        # 0.33's shape needs nothing; anything else unseen is said.
        return None if "keeps a finishing output" in shape.reason else f"{name}: {shape.reason}"
    error_cls = getattr(module, ERROR_CLASS, None)
    if not (isinstance(error_cls, type) and issubclass(error_cls, Exception)):
        return f"{target.module} has no {ERROR_CLASS} class"
    if RESULTS_PARAMETER not in inspect.signature(method).parameters:
        return f"{name} has no {RESULTS_PARAMETER} parameter"
    return cls, method, shape, error_cls


def _install(module: ModuleType, target: Target) -> None:
    """Wrap one generator of a freshly imported module. Never raises."""
    name = f"{target.cls}.{target.method}"
    try:
        with _lock:
            decided = None if _engine_sends_errors() else _decide(module, target)
            if decided is None:
                return
            if isinstance(decided, str):
                say_once(
                    logging.WARNING,
                    f"a streaming client of a request the plugin ends sees its stream close "
                    f"with no finish_reason ({decided}); non-streaming clients read the cause",
                )
                return
            cls, method, shape, error_cls = decided
            installation.set_attr(cls, target.method, _wrap(method, shape, error_cls), TAG)
        say_once(logging.INFO, f"{name}: a request the plugin ends is streamed as an error")
    except Exception as exc:
        say_once(logging.WARNING, f"{name} left stock ({type(exc).__name__}: {exc})")


def attach() -> None:
    """Wrap the stream generators now, or when their modules are imported. Never raises."""
    try:
        for target in TARGETS:
            module = sys.modules.get(target.module)
            if module is not None and not initialising(module):
                _install(module, target)
                continue
            if not _has_source(target.module):
                continue  # this vLLM has no such server module: nothing to wait for
            with _lock:
                if any(c.name == target.module for c in installation.changes(HOOK_TAG)):
                    continue
                on_import = functools.partial(_on_import, target)
                PostImportHook(target.module, on_import, HOOK_TAG).install()
    except Exception as exc:
        say_once(logging.WARNING, f"streams left stock ({type(exc).__name__}: {exc})")


def _has_source(name: str) -> bool:
    """Whether the installed vLLM has module ``name``, read from its files (imports nothing)."""
    vllm = sys.modules.get("vllm")
    spec = None if vllm is not None else importlib.util.find_spec("vllm")  # a top-level find
    roots = getattr(vllm, "__path__", None) or getattr(spec, "submodule_search_locations", None)
    relative = name.split(".")[1:]
    return any(os.path.isfile(os.path.join(root, *relative) + ".py") for root in roots or ())


def _on_import(target: Target, module: ModuleType) -> None:
    with _lock:
        installation.undo(lambda c: c.tag == HOOK_TAG and c.name == target.module)
    _install(module, target)


def detach() -> bool:
    """Restore vLLM's generators and drop the pending hooks. Returns whether anything was undone."""
    with _lock:
        return installation.undo(lambda c: c.tag in (TAG, HOOK_TAG))


def installed() -> list[str]:
    """``Class.method`` of each generator wrapped in this process (doctor, tests)."""
    return sorted(f"{c.target.__qualname__}.{c.name}" for c in installation.changes(TAG))
