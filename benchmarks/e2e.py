"""Section 5: end to end on CPU, the tiny Qwen3.5-style model through ``vllm.LLM``.

Two engines, each in its own worker process under ``tools.engine_demo``'s progress watchdog:
the plugin (prefix caching on, align mode) and the workaround (prefix caching off, plugin off).
Each sends: a warm-up request (image 2 twice, shares no prefix), then two-image requests, each
sent twice in a row so the repeat can hit the prefix cache.
"""

from __future__ import annotations

import tempfile
from typing import Any

from benchmarks.common import median

# image indices into tools.tiny_model.test_images(n=3)
WARMUP = [2, 2]
PAIRS = ([0, 1], [1, 0])
ARMS: dict[str, dict[str, Any]] = {
    "plugin": {"engine": {}, "env": {"VLLM_MAMBA_FIX": "auto"}},
    "workaround": {
        "engine": {"enable_prefix_caching": False, "mamba_cache_mode": "none"},
        "env": {"VLLM_MAMBA_FIX": "0"},
    },
}


def _requests() -> list[list[int]]:
    requests = [WARMUP]
    for pair in PAIRS:
        requests += [pair, pair]
    return requests


def _run_arm(
    engine_demo: Any, model_dir: Any, arm: str, spec: dict[str, Any], timeout: float, workdir: str
) -> Any:
    return engine_demo.run(
        model_dir,
        [engine_demo.Phase(arm, engine=spec["engine"], requests=_requests(), max_tokens=16)],
        env={**spec["env"], "VLLM_LOGGING_LEVEL": "WARNING"},
        timeout_s=timeout,
        workdir=workdir,
    )


def run(timeout: float) -> dict[str, Any]:
    from tools import engine_demo
    from tools.tiny_model import build

    model_dir = build(engine_demo.DEFAULT_MODEL_DIR)
    arms: dict[str, Any] = {}
    for arm, spec in ARMS.items():
        with tempfile.TemporaryDirectory(prefix=f"bench-e2e-{arm}-") as workdir:
            outcome = _run_arm(engine_demo, model_dir, arm, spec, timeout, workdir)
        results = sorted(outcome.results, key=lambda r: r["index"])
        first = [r for r in results if r["index"] in (1, 3)]
        repeat = [r for r in results if r["index"] in (2, 4)]
        arms[arm] = {
            "status": outcome.status,
            "evidence": outcome.evidence,
            "engine_wall_s": round(outcome.elapsed_s, 1),
            "first_s": median([r["elapsed_s"] for r in first]),
            "repeat_s": median([r["elapsed_s"] for r in repeat]),
            "repeat_cached_tokens": [r["num_cached_tokens"] for r in repeat],
            "prompt_tokens": results[1]["prompt_tokens"] if len(results) > 1 else None,
            "same_output": [r["token_ids"] for r in results],
        }
    plugin, workaround = arms["plugin"], arms["workaround"]
    out: dict[str, Any] = {"arms": arms}
    if plugin["status"] == workaround["status"] == "completed":
        out["ratio_first"] = plugin["first_s"] / workaround["first_s"]
        out["ratio_repeat"] = plugin["repeat_s"] / workaround["repeat_s"]
        # Greedy tokens per request, plugin vs workaround. Different chunkings round float32
        # differently, so a random-weight model may flip a late token; reported, not judged.
        out["same_output"] = [
            a == b for a, b in zip(plugin["same_output"], workaround["same_output"], strict=False)
        ]
    for arm in arms.values():
        arm.pop("same_output")
    return out
