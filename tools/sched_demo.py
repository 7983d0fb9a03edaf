"""Scheduler-level reproduction: the real vLLM Scheduler, stock against patched.

    python -m tools.sched_demo

Runs the two-image scenario of vLLM issue #40707 and the queue scenario on the installed
vLLM, first stock, then with the plugin loaded the engine's way (entry points through
``vllm.plugins.load_general_plugins()``), and prints each request's chunks and verdict.
"""

from __future__ import annotations

import logging
import sys

from tools import scenarios as sc
from tools import sched_harness as harness
from tools.sched_harness import RunResult

SHOWN = (sc.TWO_IMAGES, sc.QUEUE)


def _describe(result: RunResult) -> list[str]:
    lines = []
    for request_id, spans in result.chunks.items():
        prefill = [s for s in spans if s[1] < result.prompt_len[request_id]]
        chunks = " ".join(f"[{start},{end})" for _, start, end in prefill) or "(never scheduled)"
        if request_id in result.finished:
            state = "finished"
        else:
            state = f"STUCK at token {result.stall_at[request_id]}"
        lines.append(f"    {request_id:<14} {state:<22} {chunks}")
    return lines


def _run(label: str) -> bool:
    all_completed = True
    for scenario in SHOWN:
        result = scenario.run()
        verdict = "completed" if result.completed else f"hung ({result.steps} steps)"
        print(f"  {label} / {scenario.name}: {verdict}; block size {result.block_size}")
        print("\n".join(_describe(result)))
        all_completed &= result.completed
    return all_completed


def main() -> int:
    # Keep vLLM's and the harness's chatter out of the comparison.
    logging.getLogger("vllm").setLevel(logging.WARNING)
    import vllm

    print(f"vLLM {vllm.__version__}, scheduler-level reproduction ({len(SHOWN)} scenarios)")
    stock_completed = _run("stock")
    harness.load_plugins()
    if not harness.split_is_wrapped():
        print("the plugin did not patch the scheduler (see `vllm-mamba-fix doctor`)")
        return 1
    patched_completed = _run("patched")
    harness.unload_plugin()
    print(
        f"verdict: stock {'completed' if stock_completed else 'hangs'}, "
        f"patched {'completes' if patched_completed else 'STILL HANGS'}"
    )
    return 0 if patched_completed else 1


if __name__ == "__main__":
    sys.exit(main())
