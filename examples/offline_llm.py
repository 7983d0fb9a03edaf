"""Offline ``vllm.LLM``: one two-image request on the tiny hybrid model (CPU) or a real one.

    python examples/offline_llm.py                       # tiny model, built locally
    VLLM_MAMBA_FIX=0 python examples/offline_llm.py      # stock: never returns (Ctrl-C);
                                                         # tools/engine_demo.py names the hang
    python examples/offline_llm.py --model Qwen/Qwen3.5-35B-A3B --tp 2 --image-size 1536
    python examples/offline_llm.py --videos              # two videos instead of two images

``--videos`` sends two videos as frame arrays with their metadata, ``(frames, metadata)``, as
vLLM's Qwen3-VL path wants them (no decoder involved): on the tiny model 8 frames of 256 x 256
each (tools/tiny_videos.py, 256 encoder tokens, one per encoder cache); on a real model
random-noise frames of ``--image-size`` pixels.

The engine core runs in its own process (vLLM's default); the plugin, installed with pip, is
loaded there by vLLM itself, which logs ``vllm-mamba-fix ... active`` from ``(EngineCore pid=...)``.
For the tiny model this script re-executes itself with ``PYTHONPATH=tools/test_site`` (the
test-only torchvision shim, see tools/tiny_model.py) so vLLM's subprocesses inherit it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the tiny model (built locally)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--videos", action="store_true", help="two videos, not two images")
    args = parser.parse_args()

    from tools.tiny_model import SHIM_DIR, build, demo_images, shim_env, two_image_prompt

    engine: dict = {
        "enable_prefix_caching": True,
        "mamba_cache_mode": "align",
        "limit_mm_per_prompt": {"image": 2, "video": 2 if args.videos else 0},
        "tensor_parallel_size": args.tp,
    }
    mm_data: dict = {}
    if args.model is None:
        if str(SHIM_DIR) not in os.environ.get("PYTHONPATH", ""):
            env = shim_env(dict(os.environ))
            os.execve(sys.executable, [sys.executable, *sys.argv], env)
        from tools.engine_demo import DEFAULT_MODEL_DIR, ENGINE_DEFAULTS

        model = str(build(DEFAULT_MODEL_DIR))
        engine = dict(ENGINE_DEFAULTS)  # block 256 pinned, budget 384: one image fits the encoder
        prompt = two_image_prompt()  # images at [1,257) and [259,515)
        images = demo_images(n=2)
        if args.videos:
            from tools.tiny_videos import demo_videos, video_prompt

            engine["limit_mm_per_prompt"] = {"image": 0, "video": 2}
            prompt = video_prompt(2)  # videos at [1,317) and [319,635) (timestamps, 64-pad patches)
            mm_data = {"video": demo_videos(n=2)}
    else:
        import numpy as np
        from PIL import Image

        model = args.model
        rng = np.random.default_rng(0)
        size = (args.image_size, args.image_size, 3)
        images = [Image.fromarray(rng.integers(0, 256, size, dtype=np.uint8)) for _ in range(2)]
        prompt = None  # use the model's chat template below
        if args.videos:
            from tools.tiny_videos import video_metadata, video_prompt

            frames = (8, args.image_size, args.image_size, 3)
            meta = {**video_metadata(), "width": args.image_size, "height": args.image_size}
            clips = [(rng.integers(0, 256, frames, dtype=np.uint8), meta) for _ in range(2)]
            prompt, mm_data = video_prompt(2), {"video": clips}  # Qwen3-VL's placeholders

    from vllm import LLM, SamplingParams

    llm = LLM(model=model, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    start = time.monotonic()
    if prompt is not None:
        mm_data = mm_data or {"image": images}
        outputs = llm.generate({"prompt": prompt, "multi_modal_data": mm_data}, params)
    else:
        import base64
        import io

        def data_url(image: Image.Image) -> str:
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

        content = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
        content.append({"type": "text", "text": "Describe both images."})
        outputs = llm.chat([{"role": "user", "content": content}], params)
    out = outputs[0]
    print(f"prompt tokens: {len(out.prompt_token_ids or [])}")
    print(f"output tokens: {list(out.outputs[0].token_ids)}")
    print(f"text: {out.outputs[0].text!r}")
    print(f"completed in {time.monotonic() - start:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
