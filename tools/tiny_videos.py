"""Videos for the tiny model (tools/tiny_model.py): frame arrays vLLM accepts without a decoder.

vLLM's Qwen3-VL parser wants each video with its metadata: ``(frames, metadata)``, frames a
``uint8`` array ``(T, H, W, 3)``. Frames of 256 x 256 are already on the video processor's
32-pixel grid, so it does not resample them; 8 frames are 4 temporal patches of 64 pads: 256
encoder tokens per video, which is also vLLM's largest video for this model, so the encoder
cache (budget 384) holds one video, never two.

A video placeholder in the prompt is ``<|vision_start|><|video_pad|><|vision_end|>``. vLLM
expands it, per temporal patch, into timestamp text (``<0.2 seconds>``, 13 byte tokens),
``<|vision_start|>``, 64 pads and ``<|vision_end|>``: 316 tokens. transformers >= 5.10 expands
only the ``<|video_pad|>``, so the outer markers stay around it and two videos sit 2 apart:
video 1 at ``[1, 317)``, video 2 at ``[319, 635)``.
"""

from __future__ import annotations

from typing import Any

VIDEO_FRAMES = 8
VIDEO_SIZE = 256
VIDEO_FPS = 2.0
TOKENS_PER_VIDEO = 256  # (256 / 16 / 2)^2 = 64 pads per temporal patch, 4 patches
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"


def video_metadata(frames: int = VIDEO_FRAMES, fps: float = VIDEO_FPS) -> dict[str, Any]:
    """What a decoder would report for ``frames`` frames at ``fps``, none sampled away."""
    return {
        "total_num_frames": frames,
        "fps": fps,
        "duration": frames / fps,
        "frames_indices": list(range(frames)),
        "width": VIDEO_SIZE,
        "height": VIDEO_SIZE,
        "video_backend": "opencv",
        "do_sample_frames": False,
    }


def demo_videos(seed: int = 0, n: int = 2) -> list[tuple[Any, dict[str, Any]]]:
    """``n`` different, deterministic videos as ``(frames, metadata)``.

    Each is a distinct moving pattern (noise, a sliding gradient, drifting stripes, a pulsing
    colour), for the reason demo_images gives: i.i.d. noise videos would barely differ to a
    random model.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    size = VIDEO_SIZE
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size

    def frame(kind: int, t: int) -> Any:
        phase = t / VIDEO_FRAMES
        if kind == 0:
            return rng.integers(0, 256, (size, size, 3))
        if kind == 1:
            xs = (x + phase) % 1.0
            return np.stack([xs, y, 1 - xs], -1) * 255
        if kind == 2:
            return np.stack([(np.sin(30 * (x + phase)) > 0) * 255.0, y * 90, 0 * x + 40], -1)
        return np.stack([0 * x + 250 * (1 - phase), 0 * x + 190, 0 * x + 30 + 200 * phase], -1)

    videos = []
    for i in range(n):
        frames = [frame(i % 4, t) for t in range(VIDEO_FRAMES)]
        array = np.clip(np.stack(frames), 0, 255).astype(np.uint8)
        videos.append((array, video_metadata()))
    return videos


def video_prompt(num_videos: int, text: str | None = None) -> str:
    """Raw prompt: ``num_videos`` video placeholders back to back, then ``text``."""
    if text is None:
        text = "Describe both videos." if num_videos == 2 else "Describe the video."
    return VIDEO_PLACEHOLDER * num_videos + text
