"""Issue 27 item 3: a streaming client of a request the plugin ended is told, and no other
stream changes by one byte.

vLLM 0.27.1's own ``chat_completion_stream_generator`` and ``completion_stream_generator`` run
here on scripted ``RequestOutput`` sequences (the engine's side of the stream), once stock and
once with :func:`stream_end.attach`. The serving objects are built without an engine: the two
generators read only the flags set below. The e2e proof under ``vllm serve``:
tests/e2e/test_stall_end_serve.py.
"""

from __future__ import annotations

import ast
import asyncio
import json
import logging
import re
import subprocess
import sys
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_mamba_fix.facts.targets import MARKER
from vllm_mamba_fix.install import stream_end
from vllm_mamba_fix.install.stream_end import TARGETS, Shape, Target, Watch, read_shape
from vllm_mamba_fix.rules.end_order import CLIENT_MESSAGE_PREFIX

REPO = Path(__file__).resolve().parents[2]
MESSAGE = f"{CLIENT_MESSAGE_PREFIX}: it could not get past prompt token 256 of 600 (...)"
CREATED = re.compile(r'"created":\d+')

serving_chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.serving")
serving_completion = pytest.importorskip("vllm.entrypoints.openai.completion.serving")


# 0.33+: the stall end sends a RequestError, which vLLM streams itself; nothing is wrapped.
reported_here = pytest.mark.skipif(
    stream_end._engine_sends_errors(), reason="vLLM 0.33+ streams the end's RequestError itself"
)


@pytest.fixture(autouse=True)
def stock_streams() -> Iterator[None]:
    stream_end.detach()
    yield
    stream_end.detach()


# -- vLLM's generators on scripted results ----------------------------------------------------

_FLAGS = dict(
    parser_cls=None, response_role="assistant", enable_force_include_usage=False,
    enable_log_outputs=False, enable_log_deltas=True, request_logger=None,
    enable_prompt_tokens_details=False, enable_per_request_metrics=False,
    return_tokens_as_token_ids=False, system_fingerprint=None,
    # Older releases' flags (0.15-0.23: harmony, tool and reasoning parsers).
    use_harmony=False, tool_parser=None, reasoning_parser=None, reasoning_parser_cls=None,
    tool_parser_cls=None, enable_auto_tools=False, tool_call_parser=None,
    tool_call_id_type="random", _include_reasoning_tokens_details=False, log_error_stack=False,
)  # fmt: skip


def _serving(cls: type) -> Any:
    serving = cls.__new__(cls)
    for name, value in _FLAGS.items():
        setattr(serving, name, value)
    serving.model_config = types.SimpleNamespace(is_encoder_decoder=False)  # the prompt's text
    return serving


def out(text: str, tokens: list[int], finish: str | None = None, stop: Any = None,
        index: int = 0) -> Any:  # fmt: skip
    from vllm.outputs import CompletionOutput

    return CompletionOutput(index=index, text=text, token_ids=tokens, cumulative_logprob=None,
                            logprobs=None, finish_reason=finish, stop_reason=stop)  # fmt: skip


def res(*outputs: Any) -> Any:
    from vllm.outputs import RequestOutput

    finished = all(o.finish_reason is not None for o in outputs)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2, 3],
                         prompt_logprobs=None, outputs=list(outputs),
                         finished=finished)  # fmt: skip


async def _results(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def _metadata() -> Any:
    # Each release imports it into the serving module, from where it lives there.
    return serving_chat.RequestResponseMetadata(request_id="r")


def chat_stream(items: list[Any], **request: Any) -> list[str]:
    """What vLLM's chat stream generator sends for ``items`` (``created`` made constant)."""
    body = serving_chat.ChatCompletionRequest(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True, **request
    )
    serving = _serving(serving_chat.OpenAIServingChat)

    async def collect() -> list[str]:
        gen = serving.chat_completion_stream_generator(
            body, _results(items), "r", "tiny", [], None, _metadata()
        )
        return [CREATED.sub('"created":0', chunk) async for chunk in gen]

    return asyncio.run(collect())


def completion_stream(items: list[Any], prompts: int = 1, **request: Any) -> list[str]:
    body = serving_completion.CompletionRequest(model="tiny", prompt="hi", stream=True, **request)
    serving = _serving(serving_completion.OpenAIServingCompletion)
    inputs = [{"prompt_token_ids": [1, 2, 3], "prompt": "hi"}] * prompts

    async def collect() -> list[str]:
        gen = serving.completion_stream_generator(
            body, inputs, _results(items), "r", 0, "tiny", prompts, None, _metadata()
        )
        return [chunk async for chunk in gen]

    return asyncio.run(collect())


def events(chunks: list[str]) -> list[Any]:
    return [json.loads(c[len("data: ") :]) if "[DONE]" not in c else "[DONE]" for c in chunks]


ENDED = [res(out("", [], "abort", MESSAGE))]
HEALTHY = {
    "tokens": [res(out("a", [5])), res(out("b", [6], "length"))],
    "a prefill output first": [res(out("", [])), res(out("a", [5], "stop"))],
    # A client's abort (stock's own finish, no plugin message) at 0 tokens.
    "a client abort": [res(out("", [], "abort"))],
    "an abort by another plugin": [res(out("", [], "abort", "someone else ended this"))],
    # The plugin's message after streamed tokens: vLLM sends that finish itself.
    "ended after tokens": [res(out("a", [5])), res(out("", [], "abort", MESSAGE))],
    "two choices": [res(out("a", [5], index=0), out("b", [6], index=1)),
                    res(out("c", [7], "length", index=0), out("d", [8], "stop", index=1))],
}  # fmt: skip


@reported_here
def test_stock_sends_an_empty_success_for_an_ended_request() -> None:
    # The harm: the role chunk, then [DONE]; no finish_reason, no cause.
    sent = events(chat_stream(ENDED))
    assert len(sent) == 2 and sent[-1] == "[DONE]"
    assert sent[0]["choices"][0]["finish_reason"] is None
    assert MESSAGE not in json.dumps(sent)
    assert events(completion_stream([(0, r) for r in ENDED])) == ["[DONE]"]


@reported_here
def test_an_ended_request_is_streamed_as_vllms_error_event() -> None:
    stream_end.attach()
    assert stream_end.installed() == [
        "OpenAIServingChat.chat_completion_stream_generator",
        "OpenAIServingCompletion.completion_stream_generator",
    ]
    for sent in (events(chat_stream(ENDED)), events(completion_stream([(0, r) for r in ENDED]))):
        assert sent[-1] == "[DONE]"
        error = sent[-2]["error"]
        assert error["message"] == MESSAGE, sent
        assert error["code"] == 500 and error["type"] == "InternalServerError"
    # With usage asked for: the error still comes before [DONE].
    sent = events(chat_stream(ENDED, stream_options={"include_usage": True}))
    assert sent[-2]["error"]["message"] == MESSAGE and sent[-1] == "[DONE]"


@reported_here
def test_one_ended_choice_of_two_is_reported_after_the_other_finishes() -> None:
    stream_end.attach()
    items = [res(out("a", [5], index=0), out("", [], "abort", MESSAGE, index=1)),
             res(out("b", [6], "length", index=0))]  # fmt: skip
    sent = events(chat_stream(items, n=2))
    chunks = [e["choices"][0] for e in sent[:-2]]
    assert [c["index"] for c in chunks] == [0, 1, 0, 0]  # two role chunks, then choice 0's
    assert [c["delta"].get("content") for c in chunks[2:]] == ["a", "b"]
    assert chunks[-1]["finish_reason"] == "length"
    assert sent[-2]["error"]["message"] == MESSAGE and sent[-1] == "[DONE]"


@pytest.mark.parametrize("case", sorted(HEALTHY))
@pytest.mark.parametrize("usage", [False, True])
def test_every_other_stream_is_byte_identical(case: str, usage: bool) -> None:
    items = HEALTHY[case]
    extra: dict[str, Any] = {"n": 2} if case == "two choices" else {}
    if usage:
        extra["stream_options"] = {"include_usage": True}
    stock_chat = chat_stream(items, **extra)
    stock_completion = completion_stream([(0, r) for r in items], **extra)
    stream_end.attach()
    assert chat_stream(items, **extra) == stock_chat
    assert completion_stream([(0, r) for r in items], **extra) == stock_completion


def test_the_watch_passes_the_same_items_and_the_sources_attributes() -> None:
    items = HEALTHY["tokens"]
    source = _results(items)
    watch = Watch(source, False, RuntimeError)

    async def drain() -> list[Any]:
        return [item async for item in watch]

    assert all(a is b for a, b in zip(asyncio.run(drain()), items, strict=True))
    assert watch.aclose == source.aclose  # closing the stream closes vLLM's generator
    # An item of another shape is passed on, unread.
    odd = Watch(_results([object()]), True, RuntimeError)
    assert len(asyncio.run(_drain(odd))) == 1


async def _drain(iterator: Any) -> list[Any]:
    return [item async for item in iterator]


# -- deciding by the code's shape -------------------------------------------------------------

_RELEASES = ("0.15.1", "0.19.1", "0.25.1", "0.27.1", "0.28.0", "0.32.0", "0.33.0", "0.34.0")


def _source_of(release: str, target: Target) -> str:
    from tools.releases import cache_dir, installed_release

    if release == installed_release():
        root = Path(serving_chat.__file__).parents[3]
    else:
        root = cache_dir() / "overlays" / release / "vllm"
        if not root.is_dir():
            pytest.skip(f"vLLM {release}'s tree is not extracted (python -m tools.releases)")
    path = root / (target.module.split(".", 1)[1].replace(".", "/") + ".py")
    text = path.read_text()
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef)
               and n.name == target.cls)  # fmt: skip
    method = next(n for n in cls.body if getattr(n, "name", None) == target.method)
    return ast.get_source_segment(text, method, padded=True) or ""


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.method)
@pytest.mark.parametrize("release", _RELEASES)
def test_the_shape_of_every_family(release: str, target: Target) -> None:
    shape = read_shape(_source_of(release, target))
    if release in ("0.33.0", "0.34.0"):
        # 0.33 streams the finish (and a RequestError) itself; the stall end sends a
        # RequestError there, so the patch is never needed.
        assert not shape.applies, shape
    else:
        assert shape.applies, shape
        assert shape.pairs == (target.method == "completion_stream_generator")


def test_shapes_that_do_not_apply() -> None:
    skip_with_finish = """
    async def g(self, result_generator):
        try:
            async for res in result_generator:
                if not delta_text and not output.token_ids and output.finish_reason is None:
                    continue
        except GenerationError as e:
            yield str(e)
    """
    assert "keeps a finishing output" in read_shape(skip_with_finish).reason
    no_handler = """
    async def g(self, result_generator):
        async for res in result_generator:
            if not delta_text and not output.token_ids:
                continue
        yield 1
    """
    assert "no `except GenerationError`" in read_shape(no_handler).reason
    assert read_shape("def (:").reason == "its source does not parse"
    assert "no single `async for`" in read_shape("async def g(self, x):\n    yield 1").reason


def _module_with(body: str) -> types.ModuleType:
    module = types.ModuleType("fake_serving")
    exec(compile(body, "<fake>", "exec"), module.__dict__)
    return module


def test_an_unknown_shape_is_left_stock_with_one_line(
    plugin_log: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # inspect.getsource needs a file: write the unseen shape to one.
    source = tmp_path / "fake_serving.py"
    source.write_text(
        "class Serving:\n"
        "    async def stream(self, request, result_generator):\n"
        "        async for res in result_generator:\n"
        "            yield res\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import fake_serving  # type: ignore[import-not-found]

    original = fake_serving.Serving.stream
    target = Target("fake_serving", "Serving", "stream")
    stream_end._install(fake_serving, target)
    stream_end._install(fake_serving, target)
    assert fake_serving.Serving.stream is original
    lines = [r.getMessage() for r in plugin_log.records if r.levelno == logging.WARNING]
    assert len(lines) == 1 and "no skip of empty outputs was found" in lines[0], lines
    assert "sees its stream close with no finish_reason" in lines[0]


def _generators() -> list[Any]:
    return [getattr(serving_chat.OpenAIServingChat, TARGETS[0].method),
            getattr(serving_completion.OpenAIServingCompletion, TARGETS[1].method)]  # fmt: skip


@reported_here
def test_attach_is_idempotent_and_detach_restores_vllm() -> None:
    originals = _generators()
    stream_end.attach()
    wrapped = getattr(serving_chat.OpenAIServingChat, TARGETS[0].method)
    stream_end.attach()
    assert getattr(serving_chat.OpenAIServingChat, TARGETS[0].method) is wrapped
    assert isinstance(getattr(wrapped, MARKER), Shape)
    assert stream_end.detach()
    assert _generators() == originals
    assert not stream_end.detach()


@reported_here
def test_the_wrapper_passes_odd_arguments_on() -> None:
    stream_end.attach()
    # Too few arguments: vLLM's own TypeError, exactly as stock raises it.
    serving = _serving(serving_chat.OpenAIServingChat)
    with pytest.raises(TypeError):
        serving.chat_completion_stream_generator()
    # A result_generator that is not async-iterable is handed to vLLM as it is.
    body = serving_chat.ChatCompletionRequest(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
    )

    async def run() -> list[str]:
        gen = serving.chat_completion_stream_generator(
            body, result_generator=[], request_id="r", model_name="tiny", conversation=[],
            tokenizer=None, request_metadata=_metadata(),
        )  # fmt: skip
        return [chunk async for chunk in gen]

    sent = asyncio.run(run())
    assert "error" in sent[0] and sent[-1] == "data: [DONE]\n\n"  # vLLM's own error for a list


@reported_here
def test_the_hook_wraps_a_module_imported_later() -> None:
    # A fresh interpreter: attach before vLLM's serving modules exist, as register() does.
    code = (
        "import sys; from vllm_mamba_fix.install import stream_end; stream_end.attach();"
        "assert 'vllm.entrypoints.openai.chat_completion.serving' not in sys.modules;"
        "import vllm.entrypoints.openai.chat_completion.serving;"
        "import vllm.entrypoints.openai.completion.serving;"
        "print(stream_end.installed())"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == (
        "['OpenAIServingChat.chat_completion_stream_generator', "
        "'OpenAIServingCompletion.completion_stream_generator']"
    )


# One release per family besides this venv's 0.27.1 (0.24-0.27), from CI's overlays.
OTHER_FAMILIES = ("0.15.1", "0.19.1", "0.28.0")


@reported_here
@pytest.mark.parametrize("release", OTHER_FAMILIES)
def test_every_family_on_its_own_generators(release: str) -> None:
    """This file's tests on another release's real stream generators (its overlay)."""
    from tests.platforms._release_env import release_env

    env = release_env(release)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", __file__,
         "-k", "not every_family and not hook_wraps and not the_shape_of"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, (release, done.stdout[-4000:], done.stderr[-2000:])
    assert " passed" in summary and "skipped" not in summary, summary


def test_the_watchdog_writes_the_prefix_the_report_reads() -> None:
    # The end's message (stall_watch) must begin with the prefix the stream report matches.
    from vllm_mamba_fix.rules import stall_watch

    source = Path(stall_watch.__file__).read_text()
    assert 'f"{CLIENT_MESSAGE_PREFIX}:' in source or f'f"{CLIENT_MESSAGE_PREFIX}:' in source
