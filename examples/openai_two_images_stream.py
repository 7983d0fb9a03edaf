"""Stream one /v1/chat/completions request carrying two images, with the ``openai`` client.

    python examples/openai_two_images_stream.py --model tiny                 # CPU tiny model
    python examples/openai_two_images_stream.py --model Qwen/Qwen3.5-35B-A3B \\
        --image-size 1536 a.png b.png                                       # real model
    python examples/openai_two_images_stream.py --model tiny --videos        # two videos
    python examples/openai_two_images_stream.py --model tiny --videos a.mp4 b.mp4

``--videos`` sends two ``video_url`` parts instead: the given files, or two random-noise mp4s of
``--video-frames`` frames of ``--video-size`` pixels at 2 fps, encoded with OpenCV (the server
decodes them with OpenCV too; ``pip install opencv-python-headless``). The server must allow
them (``--limit-mm-per-prompt '{"video": 2}'``, as examples/serve_tiny_cpu.sh does).

Without image paths, two different random-noise images of ``--image-size`` pixels are sent as
PNG data URLs. Prints the streamed text, time to first token and total time. On stock vLLM
0.15-0.27.1 the request may never produce a token while ``/health`` answers 200; the client
then gives up after ``--timeout`` seconds and says so (the server-side proof is the e2e tests'
progress probe; see tools/engine_demo.py).

It reports what the stream ended with (exit status 1 unless it finished normally):

- ``[finish_reason=...]``: the choice's finish (and ``stop_reason`` when there is one);
- ``[error] ...``: an error event (``data: {"error": ...}``) before ``[DONE]``, which the
  ``openai`` client raises as ``APIError``. This is how a request vllm-mamba-fix ended reaches
  a streaming client (vLLM 0.15-0.32 through the plugin's stream report, 0.33+ from vLLM);
- ``[empty stream]``: ``[DONE]`` with no text and no finish_reason. That is not a success: on
  vLLM 0.15-0.32 it is what a streaming client of a request ended at 0 tokens sees when
  nothing reports the end (the plugin's stream report off, ``VLLM_MAMBA_FIX_END_STALLS_AFTER=off``
  in the API server, or not applicable: its warning line in the server log says so). Ask again
  without streaming to read the cause as ``stop_reason`` (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import time
import urllib.request
from pathlib import Path


def data_url(image) -> str:  # image: PIL.Image.Image
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def load_images(paths: list[str], size: int) -> list[str]:
    import numpy as np
    from PIL import Image

    if paths:
        return [data_url(Image.open(Path(p)).convert("RGB")) for p in paths]
    rng = np.random.default_rng(0)
    return [
        data_url(Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)))
        for _ in range(2)
    ]


def video_data_url(path: Path) -> str:
    return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()


def load_videos(paths: list[str], size: int, frames: int) -> list[str]:
    """Data URLs of the given videos, or of two random-noise mp4s written with OpenCV."""
    if paths:
        return [video_data_url(Path(p)) for p in paths]
    import tempfile

    import cv2
    import numpy as np

    rng = np.random.default_rng(0)
    urls = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(2):
            path = Path(tmp) / f"noise{i}.mp4"
            writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 2.0, (size, size))
            if not writer.isOpened():
                raise SystemExit("OpenCV cannot write mp4 here; pass two video files instead")
            for _ in range(frames):
                writer.write(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
            writer.release()
            urls.append(video_data_url(path))
    return urls


def health(base_url: str) -> int:
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=5) as resp:
            return resp.status
    except Exception:
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "images", nargs="*", help="two image (or, with --videos, video) files (default: noise)"
    )
    parser.add_argument("--videos", action="store_true", help="send two videos, not images")
    # 8 frames of 256 x 256: 256 encoder tokens per video on the tiny model, one per cache.
    parser.add_argument("--video-frames", type=int, default=8)
    parser.add_argument("--video-size", type=int, default=256)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()

    from openai import APIError, APITimeoutError, OpenAI

    if args.videos:
        urls = load_videos(args.images, args.video_size, args.video_frames)
        content = [{"type": "video_url", "video_url": {"url": u}} for u in urls]
        content.append({"type": "text", "text": "Describe both videos."})
    else:
        urls = load_images(args.images, args.image_size)
        content = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        content.append({"type": "text", "text": "Describe both images."})
    # No retries: a stalled request would otherwise be sent again and waited for again.
    client = OpenAI(
        base_url=args.base_url.rstrip("/") + "/v1",
        api_key="EMPTY",
        timeout=args.timeout,
        max_retries=0,
    )
    start = time.monotonic()
    first: float | None = None
    finish: str | None = None
    try:
        stream = client.chat.completions.create(
            model=args.model,
            messages=[{"role": "user", "content": content}],
            stream=True,
            max_tokens=args.max_tokens,
            temperature=0.0,
        )
        for event in stream:
            for choice in event.choices:
                if choice.delta and choice.delta.content:
                    first = first or time.monotonic()
                    print(choice.delta.content, end="", flush=True)
                if choice.finish_reason:
                    finish = choice.finish_reason
                    stop = getattr(choice, "stop_reason", None) or (choice.model_extra or {}).get(
                        "stop_reason"
                    )
                    print(f"\n[finish_reason={finish}]" + (f" stop_reason: {stop}" if stop else ""))
    except APIError as exc:  # an error event in the stream (before [DONE])
        print(f"\n[error] the server ended the stream with an error: {exc.message}")
        return 1
    except APITimeoutError:
        print(
            f"\nNo completion after {args.timeout:.0f} s; /health = {health(args.base_url)}. "
            "On vLLM 0.15-0.27.1 without vllm-mamba-fix this is the multimodal prefill deadlock."
        )
        return 1
    total = time.monotonic() - start
    ttft = f"{first - start:.2f} s" if first else "n/a"
    print(f"time to first token {ttft}, total {total:.2f} s")
    if finish is None and first is None:
        print(
            "[empty stream] [DONE] with no text and no finish_reason: not a success. The server "
            "ended the request without telling this stream (vLLM 0.15-0.32 when vllm-mamba-fix's "
            "stream report is not on); send it without streaming to read the cause."
        )
        return 1
    return 0 if finish in ("stop", "length") else 1


if __name__ == "__main__":
    sys.exit(main())
