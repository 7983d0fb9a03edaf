"""The issue's layout, spelled out (tools.scenarios.TWO_IMAGES) so that runs on another
release import only the harness: two 11,844-token images, budget 8192, encoder cache 16,384."""

from __future__ import annotations

from tools.sched_harness import HarnessConfig, RequestSpec, RunResult, run_requests

IMAGE = 11_844
REQUEST = RequestSpec(
    "two-images", 100 + IMAGE + 50 + IMAGE + 200, ((100, IMAGE), (100 + IMAGE + 50, IMAGE))
)
CONFIG = HarnessConfig(max_num_batched_tokens=8192, encoder_cache_tokens=16_384)


def run(cfg: HarnessConfig = CONFIG) -> RunResult:
    return run_requests([REQUEST], cfg, max_steps=300, stall_steps=25)
