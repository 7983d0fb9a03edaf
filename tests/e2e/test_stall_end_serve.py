"""Issue 21 item 1 under ``vllm serve`` on the CPU: a client stuck in a stall the plugin cannot
end has its request finished within the bound; ``/health`` stays 200; the requests queued behind
it complete; the server serves the same images afterwards; a client that does not stream reads
the abort with the cause and the remedy. Issue 27 item 3: a streaming client reads vLLM's error
event with the same message before ``[DONE]`` (vllm_mamba_fix/install/stream_end.py), and
examples/openai_two_images_stream.py reports it; every other stream's bytes are the same as
with the stream report off (``VLLM_MAMBA_FIX_END_STALLS_AFTER=off``).

The stall is vLLM 0.27.1's own two-image hang (``VLLM_MAMBA_FIX_SPLIT_RULE=0`` leaves the split
stock while the block-unit rule, the watchdog and the stall end run): image 1 [1, 257) held in
the 384-token encoder cache, image 2 [259, 515) does not fit beside it, the encoder cut leaves 3
tokens before it and stock's split floors them to 0 at token 256, every step. That is the real
path an un-endable stall takes: the watchdog's look in the ``update_from_output`` wrapper
(stall_look.py) finds it stopped in steps that left token budget unused, the watchdog names it,
the end is ordered at one step and carried out by the same wrapper at the next in the engine
core, and the finish travels vLLM's own output path to the API server and the client.

Behind it: a one-image request (its image fits the cache alone, not beside the held one: it
waits, is named, and must never be ended) and two text requests.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.serve_helpers import image_data_url, run_server
from tools.engine_demo import REPO
from vllm_mamba_fix.rules.end_order import CLIENT_MESSAGE_PREFIX

pytestmark = pytest.mark.e2e

STALL_SECONDS = 5.0
END_AFTER = 5.0
# The watchdog needs STALL_SECONDS of 0s, the end END_AFTER more; slack for a loaded machine.
END_WITHIN_S = STALL_SECONDS + END_AFTER + 20.0
ENV = {
    "VLLM_MAMBA_FIX_SPLIT_RULE": "0",
    "VLLM_MAMBA_FIX_STALL_SECONDS": f"{STALL_SECONDS:g}",
    "VLLM_MAMBA_FIX_END_STALLS_AFTER": f"{END_AFTER:g}",
}
ENDED_LINE = re.compile(
    r"\(EngineCore pid=\d+\).*vllm-mamba-fix: ended request (\S+): 0 tokens at token (\d+)"
)
# The API server's line where the stream report is installed (vllm_mamba_fix/install/stream_end.py).
REPORT_LINE = re.compile(
    r"^(?!.*EngineCore).*vllm-mamba-fix: OpenAIServingChat\.chat_completion_stream_generator: "
    r"a request the plugin ends is streamed as an error",
    re.MULTILINE,
)
CREATED = re.compile(rb'"created":\d+')


def _messages(images: tuple[int, ...], text: str) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": image_data_url(i)}} for i in images
    ]
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


def _post(base_url: str, images: tuple[int, ...], text: str) -> tuple[int, dict[str, Any]]:
    """One chat completion that does not stream: (HTTP status, JSON body)."""
    body = {
        "model": "tiny", "messages": _messages(images, text), "max_tokens": 8,
        "temperature": 0.0, "ignore_eos": True,
    }  # fmt: skip
    request = urllib.request.Request(
        base_url + "/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=240) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")}


def stream_bytes(base_url: str, path: str, body: dict[str, Any], request_id: str) -> bytes:
    """The raw body of one streamed request (``stream`` set), read to its end."""
    request = urllib.request.Request(
        base_url + path, json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json", "X-Request-Id": request_id},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=240) as response:
        assert response.status == 200
        return response.read()


def sse_data(raw: bytes) -> list[Any]:
    """The ``data:`` payloads of a stream, decoded (``[DONE]`` kept as the string)."""
    events: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            payload = block[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


# Healthy streams, sent first to each server (cold caches), compared byte for byte; the ids
# are fixed by X-Request-Id, so only `created` (a clock reading) is made constant.
HEALTHY = {
    "chat": ("/v1/chat/completions", {
        "model": "tiny", "messages": _messages((), "Name three colours."), "max_tokens": 8,
        "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True},
    }),
    "completion": ("/v1/completions", {
        "model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True,
    }),
}  # fmt: skip


# One chunk per token, as vLLM streams when its consumer keeps up: chat adds the role and usage
# chunks, and both end with [DONE]. Under load the front end may merge two tokens' outputs into
# one chunk (a timing artefact, with or without the plugin): such a stream is sent again.
ONE_TOKEN_PER_CHUNK = {"chat": 8 + 3, "completion": 8 + 1}


def healthy_streams(base_url: str, attempts: int = 6) -> dict[str, bytes]:
    streams = {}
    for name, (path, body) in HEALTHY.items():
        for _ in range(attempts):
            raw = stream_bytes(base_url, path, body, f"healthy-{name}")
            events = sse_data(raw)
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), raw
            if len(events) == ONE_TOKEN_PER_CHUNK[name]:
                break
        assert len(events) == ONE_TOKEN_PER_CHUNK[name], (name, attempts, raw)
        streams[name] = CREATED.sub(b'"created":0', raw)
    return streams


def wait_for_position(server: Any, prefix: str, position: int, timeout_s: float = 120) -> None:
    """Until the progress probe shows a request whose id starts with ``prefix`` at ``position``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.watcher.path.exists():
            for line in server.watcher.path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    reqs = json.loads(line)["reqs"]
                    if any(r.startswith(prefix) and v[0] == position for r, v in reqs.items()):
                        return
        time.sleep(0.2)
    raise AssertionError(f"no request {prefix}* reached token {position} in {timeout_s:.0f} s")


def _diff(on: bytes, off: bytes) -> str:
    import difflib

    lines = [[json.dumps(e) for e in sse_data(raw)] for raw in (on, off)]
    return "\n".join(difflib.unified_diff(*lines, "report on", "report off", lineterm=""))


# Filled by the stall test (the stream report on), compared by the report-off test.
RECORDED: dict[str, bytes] = {}


class RawStream(threading.Thread):
    """One streamed chat completion in the background, kept as the raw bytes the client read."""

    def __init__(self, base_url: str, images: tuple[int, ...], text: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.images, self.text = base_url, images, text
        self.started = self.finished_at = 0.0
        self.raw = b""
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": "tiny", "messages": _messages(self.images, self.text), "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True,
        }  # fmt: skip
        self.started = time.monotonic()
        try:
            self.raw = stream_bytes(self.base_url, "/v1/chat/completions", body, "stuck")
        except BaseException as exc:
            self.error = exc
        self.finished_at = time.monotonic()


class Call(threading.Thread):
    """One streaming chat completion in the background; keeps the last choice's fields."""

    def __init__(self, base_url: str, images: tuple[int, ...], text: str) -> None:
        super().__init__(daemon=True)
        self.base_url, self.images, self.text = base_url, images, text
        self.started = self.finished_at = 0.0
        self.content: list[str] = []
        self.finish: dict[str, Any] = {}
        self.error: BaseException | None = None

    def run(self) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=self.base_url + "/v1", api_key="EMPTY", timeout=300)
        self.started = time.monotonic()
        try:
            stream = client.chat.completions.create(
                model="tiny", messages=_messages(self.images, self.text), stream=True,
                max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True},
            )  # fmt: skip
            for event in stream:
                for choice in event.choices:
                    if choice.delta and choice.delta.content:
                        self.content.append(choice.delta.content)
                    if choice.finish_reason:
                        self.finish = choice.model_dump()
        except BaseException as exc:
            self.error = exc
        self.finished_at = time.monotonic()


def test_a_stall_the_plugin_cannot_end_is_ended(tiny_model_dir: Path, tmp_path: Path) -> None:
    import openai  # noqa: F401  (imported now: the requests behind must arrive within seconds)

    with run_server(tiny_model_dir, tmp_path, ENV) as server:
        RECORDED.update(healthy_streams(server.base_url))
        stuck = RawStream(server.base_url, (0, 1), "Describe both images.")
        stuck.start()
        # It holds image 1 (and is at its stall) before the others arrive; they arrive at once,
        # so the one-image request waits long enough to be named before the end.
        wait_for_position(server, "chatcmpl-stuck", 256)
        behind = [
            Call(server.base_url, (2,), "Describe the image."),
            Call(server.base_url, (), "Say something about the weather."),
            Call(server.base_url, (), "Count to ten."),
        ]
        for call in behind:
            call.start()
        health: list[int] = []
        deadline = time.monotonic() + 240
        calls = [stuck, *behind]
        while any(c.is_alive() for c in calls) and time.monotonic() < deadline:
            health.append(server.health())
            time.sleep(0.5)
        log = server.log_text()
        assert not any(c.is_alive() for c in calls), f"requests left hanging\n{log[-4000:]}"
        for call in calls:
            assert call.error is None, (repr(call.error), log[-4000:])

        # The streaming client's view: no content, then vLLM's error event with the cause and
        # the remedy, then [DONE]. Stock vLLM 0.15-0.32 skips the finish of an output without
        # text or tokens ("Chunked prefill case, don't return empty chunks") and sent only the
        # role chunk and [DONE]; the plugin's stream report turns the end into the error event.
        assert REPORT_LINE.search(log), log[-4000:]
        events = sse_data(stuck.raw)
        assert events[-1] == "[DONE]", stuck.raw
        error = events[-2].get("error")
        assert error and error["code"] == 500, stuck.raw
        assert error["message"].startswith(CLIENT_MESSAGE_PREFIX), error
        assert "could not get past prompt token 256 of" in error["message"], error
        assert "remedy: turn the split rule on" in error["message"], error
        assert all(not c["delta"].get("content") and c["finish_reason"] is None
                   for e in events[:-2] for c in e["choices"]), stuck.raw  # fmt: skip
        # Within the bound of the stall's start (its first 0 comes with its second chunk,
        # within a few seconds of being sent).
        took = stuck.finished_at - stuck.started
        assert took <= END_WITHIN_S, took

        # Everything queued behind it completed; the server stayed healthy throughout.
        for call in behind:
            assert call.finish.get("finish_reason") == "length", (call.images, call.finish)
            assert call.content
        assert health and all(code == 200 for code in health), health

        # One request ended, at the split's stall; the one-image request was named, not ended.
        ended = ENDED_LINE.findall(log)
        assert len(ended) == 1 and ended[0][1] == "256", (ended, log[-4000:])
        assert "cause: split-floor" in log
        named = [line for line in log.splitlines() if "stalled at token 256 of" in line]
        assert named and "the plugin ends it 5 s from now" in named[0], named
        assert "not ended while its own encoder inputs fit" in log

        # Its KV blocks and encoder entries were freed: the same images are served again, and
        # a client that does not stream reads the abort, the cause and the remedy.
        again = Call(server.base_url, (0,), "Describe the image.")
        again.start()
        again.join(timeout=120)
        assert not again.is_alive() and again.error is None
        assert again.finish.get("finish_reason") == "length", again.finish
        status, body = _post(server.base_url, (0, 1), "Describe both images.")
        assert status == 200, body
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "abort" and choice["message"]["content"] == ""
        reason = choice["stop_reason"]
        assert reason.startswith("vllm-mamba-fix ended this request"), choice
        assert "could not get past prompt token 256 of" in reason
        assert "block-aligned split floors the chunk" in reason
        assert "remedy: turn the split rule on (unset VLLM_MAMBA_FIX_SPLIT_RULE)" in reason
        assert len(ENDED_LINE.findall(server.log_text())) == 2

        # The example client, with its own two images, reports the error event it read.
        example = subprocess.run(
            [sys.executable, str(REPO / "examples" / "openai_two_images_stream.py"),
             "--model", "tiny", "--base-url", server.base_url, "--max-tokens", "8"],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert example.returncode == 1, (example.stdout, example.stderr[-3000:])
        assert "[error] the server ended the stream with an error: " in example.stdout
        assert CLIENT_MESSAGE_PREFIX in example.stdout, example.stdout
        assert len(ENDED_LINE.findall(server.log_text())) == 3
        assert server.health() == 200


def test_the_stream_report_changes_no_other_stream(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The same healthy streams, byte for byte, with the stream report off.

    ``VLLM_MAMBA_FIX_END_STALLS_AFTER=off`` leaves vLLM's stream generators stock (no end, no
    report); everything else is the stall test's environment.
    """
    if not RECORDED:  # run alone: record with the report on first
        (tmp_path / "on").mkdir()
        with run_server(tiny_model_dir, tmp_path / "on", ENV) as server:
            assert REPORT_LINE.search(server.log_text())
            RECORDED.update(healthy_streams(server.base_url))
    off = {**ENV, "VLLM_MAMBA_FIX_END_STALLS_AFTER": "off"}
    (tmp_path / "off").mkdir()
    with run_server(tiny_model_dir, tmp_path / "off", off) as server:
        stock = healthy_streams(server.base_url)
        log = server.log_text()
    assert not REPORT_LINE.search(log) and "stream_generator" not in log
    assert stock.keys() == RECORDED.keys()
    for name in stock:
        assert RECORDED[name] == stock[name], (name, _diff(RECORDED[name], stock[name]))
