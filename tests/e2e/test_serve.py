"""``vllm serve`` on 127.0.0.1 with a streaming two-image chat completion (openai client)."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.serve_helpers import image_data_url, run_server

pytestmark = pytest.mark.e2e


def _messages(images: tuple[int, int]) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": image_data_url(i)}} for i in images
    ]
    content.append({"type": "text", "text": "Describe both images."})
    return [{"role": "user", "content": content}]


class StreamingRequest(threading.Thread):
    """A streaming /v1/chat/completions call running in the background."""

    def __init__(self, base_url: str, images: tuple[int, int] = (0, 1)) -> None:
        super().__init__(daemon=True)
        self.base_url, self.images = base_url, images
        self.chunks: list[str] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=self.base_url + "/v1", api_key="EMPTY", timeout=300)
        try:
            stream = client.chat.completions.create(
                model="tiny",
                messages=_messages(self.images),
                stream=True,
                max_tokens=16,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            for event in stream:
                for choice in event.choices:
                    if choice.delta and choice.delta.content:
                        self.chunks.append(choice.delta.content)
                    if choice.finish_reason:
                        self.finish_reason = choice.finish_reason
        except BaseException as exc:  # the server is killed under a hung stream
            self.error = exc


def test_serve_stock_hangs_while_healthy(
    tiny_model_dir: Path, tmp_path: Path, stock_hangs: None
) -> None:
    with run_server(tiny_model_dir, tmp_path, {"VLLM_MAMBA_FIX": "0"}) as server:
        request = StreamingRequest(server.base_url)
        request.start()
        deadline = time.monotonic() + 180
        health_during_stall: list[int] = []
        stall = None
        while stall is None and time.monotonic() < deadline and request.is_alive():
            time.sleep(1)
            stall = server.watcher.poll()
            if server.watcher.latest is not None and server.watcher.latest.steps > 0:
                health_during_stall.append(server.health())
        assert stall is not None, f"no stall proven\n{server.log_text()[-4000:]}"
        assert request.is_alive() and request.finish_reason is None
        assert "stuck" in stall.describe() and stall.computed < stall.prompt
        assert server.health() == 200  # the server looks healthy while the request is stuck
        assert health_during_stall and all(code == 200 for code in health_during_stall)
        assert "disabled by VLLM_MAMBA_FIX" in server.log_text()


def test_serve_plugin_completes(tiny_model_dir: Path, tmp_path: Path) -> None:
    with run_server(tiny_model_dir, tmp_path, {"VLLM_MAMBA_FIX": "auto"}) as server:
        request = StreamingRequest(server.base_url)
        request.start()
        deadline = time.monotonic() + 180
        while request.is_alive() and time.monotonic() < deadline:
            request.join(timeout=1)
            stall = server.watcher.poll()
            assert stall is None, f"hung with the plugin: {stall.describe()}"
        assert not request.is_alive(), "request did not finish in 180 s"
        assert request.error is None, repr(request.error)
        assert request.finish_reason == "length"
        assert request.chunks
        log = server.log_text()
        # The patch is active in the engine core (vLLM prefixes its lines with the pid).
        assert re.search(r"\(EngineCore pid=\d+\).*vllm-mamba-fix \S+ active", log), log[-4000:]
