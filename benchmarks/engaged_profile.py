"""Where the engaged split call's time goes (issue 29): prototypes between bare and the plugin.

    python -m benchmarks.engaged_profile            # text and mixed workloads, 0.27.1
    python -m benchmarks.engaged_profile --blocks 61

The same capture and replay as ``benchmarks/engaged.py`` (one real ``schedule()``'s split
calls, the block-unit rule engaged: ``cache_config.block_size`` half the cache's), with arms
that each add one piece of the plugin's engaged path to a bare wrapper, interleaved in blocks:

- ``stock``: vLLM's split; ``bare``: a wrapper that only calls it;
- ``gate``: bare plus the prefill test the wrapper makes first (a decode returns there);
- ``view``: gate plus, for a prefill, vLLM's split asked through the ``cache_config`` view
  (two attribute sets around the call): the least any wrapper that asks vLLM with the
  cache's block pays;
- ``plugin``: the installed wrapper (adds the per-scheduler state, the ``block_rule_chunks``
  count by arithmetic and the deadlock rules' look).

Prints per-call medians and the increments. Prototypes only: not the plugin's code.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable
from typing import Any

from benchmarks import engaged, hotpath
from benchmarks.engaged import METHOD

Arm = Callable[..., int]


def _arms(original: Arm, wrapper: Arm, view: Any) -> dict[str, Arm]:
    def bare(self: Any, request: Any, n: int, a: int = 0, b: int = 0) -> int:
        return original(self, request, n, a, b)

    def gate(self: Any, request: Any, n: int, a: int = 0, b: int = 0) -> int:
        start = request.num_computed_tokens + a + b
        if request.num_prompt_tokens <= start >= request.num_tokens - 1:
            return original(self, request, n, a, b)
        return original(self, request, n, a, b)

    def through_view(self: Any, request: Any, n: int, a: int = 0, b: int = 0) -> int:
        start = request.num_computed_tokens + a + b
        if request.num_prompt_tokens <= start >= request.num_tokens - 1:
            return original(self, request, n, a, b)
        real = self.__dict__["cache_config"]
        self.cache_config = view
        try:
            return original(self, request, n, a, b)
        finally:
            self.cache_config = real

    return {"stock": original, "bare": bare, "gate": gate, "view": through_view, "plugin": wrapper}


def profile(workload: str, blocks: int, target_ns: int) -> dict[str, Any]:
    from vllm_mamba_fix.facts.blocks import SPLIT_ATTR

    cls = hotpath._scheduler_class()
    wrapper, original = hotpath.methods(METHOD)
    try:
        setattr(cls, METHOD, wrapper)
        harness = engaged.plugin_harness(workload, "engaged")
        scheduler = harness.scheduler
        calls = engaged.capture_calls(harness, wrapper)
        arms = _arms(original, wrapper, getattr(scheduler, SPLIT_ATTR).view)
        # The prototypes ask as the plugin does: their answers must be the plugin's.
        answers = {
            a: [f(scheduler, r, n, *x, **k) for r, n, x, k in calls] for a, f in arms.items()
        }
        if answers["view"] != answers["plugin"]:
            raise RuntimeError("the view prototype answers otherwise than the plugin")
        prefills = sum(
            not (r.num_prompt_tokens <= r.num_computed_tokens >= r.num_tokens - 1)
            for r, _, _, _ in calls
        )
        per_call, loops = engaged.time_arms(scheduler, calls, arms, blocks, target_ns)
    finally:
        setattr(cls, METHOD, wrapper)
    median = {a: statistics.median(v) / 1e3 for a, v in per_call.items()}
    ratio = {
        a: statistics.median(x / y for x, y in zip(v, per_call["stock"], strict=True))
        for a, v in per_call.items()
    }
    steps = list(itertools.pairwise(arms))
    return {
        "workload": workload,
        "calls": len(calls),
        "prefill_calls": prefills,
        "us_per_call": {a: round(v, 4) for a, v in median.items()},
        "ratio_to_stock": {a: round(v, 3) for a, v in ratio.items()},
        "added_us": {f"{b} - {a}": round(median[b] - median[a], 4) for a, b in steps},
        "blocks": blocks,
        "loops": loops,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=41, help="interleaved blocks per arm")
    parser.add_argument("--block-ms", type=float, default=2.0, help="time per block")
    args = parser.parse_args(argv)
    import vllm_mamba_fix

    vllm_mamba_fix.register()
    for workload in ("text", "mixed"):
        result = profile(workload, args.blocks, int(args.block_ms * 1e6))
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
