"""Scheduler-level reproduction: the real vLLM Scheduler, stock against patched.

    python -m tools.sched_demo

Runs the two-image scenario of vLLM issue #40707 and the queue scenario on the installed
vLLM, first stock, then with the plugin loaded the engine's way (entry points through
``vllm.plugins.load_general_plugins()``), and prints each request's chunks and verdict.

stdout carries only the reproduction: vLLM's own log (which vLLM writes to stdout) is sent
to stderr, where ``tools/demo.sh`` collects it in a log file. The plugin's own lines about
each scenario are repeated under it. Exit code 0 when the patched scheduler completes.
"""

from __future__ import annotations

import logging
import os
import sys

# Before vLLM configures its logging (also in its model-inspection subprocesses).
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

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


class _PluginLines(logging.Handler):
    """Collects the plugin's own log lines (logger ``vllm.mamba_fix``) to show them in place."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage().removeprefix("vllm-mamba-fix: "))

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


PLUGIN_LINES = _PluginLines()


def _run(label: str) -> bool:
    all_completed = True
    for scenario in SHOWN:
        PLUGIN_LINES.take()
        result = scenario.run()
        verdict = "completed" if result.completed else f"HUNG ({result.steps} steps)"
        print(f"  {label} / {scenario.name}: {verdict}; block size {result.block_size}")
        print("\n".join(_describe(result)))
        for line in PLUGIN_LINES.take():
            print(f"      plugin: {line}")
        all_completed &= result.completed
    return all_completed


def _plugin_origin() -> str:
    module = sys.modules.get("vllm_mamba_fix")
    if module is None:
        return "plugin: not loaded"
    path = os.path.dirname(getattr(module, "__file__", None) or "?")
    return f"plugin: vllm-mamba-fix {getattr(module, '__version__', '?')} from {path}"


def main() -> int:
    import vllm

    logging.getLogger("vllm.mamba_fix").addHandler(PLUGIN_LINES)
    print(f"vLLM {vllm.__version__}, scheduler-level reproduction ({len(SHOWN)} scenarios)")
    stock_completed = _run("stock")
    harness.load_plugins()  # vLLM's load_general_plugins(), as the engine core calls it
    print(_plugin_origin())
    if not harness.split_rule_installed():
        print("the plugin did not patch the scheduler (see `vllm-mamba-fix doctor`)")
        for line in PLUGIN_LINES.take():
            print(f"      plugin: {line}")
        return 1
    for line in PLUGIN_LINES.take():
        print(f"      plugin: {line}")
    patched_completed = _run("patched")
    harness.unload_plugin()
    print(
        f"verdict: stock {'completes' if stock_completed else 'hangs'}, "
        f"patched {'completes' if patched_completed else 'STILL HANGS'}"
    )
    return 0 if patched_completed else 1


if __name__ == "__main__":
    sys.exit(main())
