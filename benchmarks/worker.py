"""One benchmark process: runs named tasks in order, prints one JSON result line.

    python -m benchmarks.worker --tasks startup_hook,steps:stock,hotpath --profile smoke

A failing task records its error and the next one still runs.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from typing import Any

from benchmarks.common import emit


def run_task(task: str, profile: str) -> Any:
    if task in ("startup_hook", "startup_imported"):
        from benchmarks import startup

        return startup.cold_register(task.removeprefix("startup_"))
    if task == "startup_warm":
        from benchmarks import startup

        return startup.warm_register(20 if profile == "smoke" else 200)
    if task.startswith("steps:"):
        from benchmarks import sched_steps

        return sched_steps.run_arm_here(task.removeprefix("steps:"), profile)
    # Issue 29 item 5: ``engaged`` is per split call and per step, the block-unit rule idle and
    # engaged. run.py gives it a process of its own on every release: run after the hot path's
    # other stages in one process, the plugin's engaged steps read 1.4-3.2 points above the bare
    # wrappers' (docs/benchmarks.md).
    if task in ("hotpath", "engaged"):
        from benchmarks import engaged, hotpath
        from tools import sched_harness

        sched_harness.unload_plugin()
        sched_harness.load_plugins()
        try:
            return hotpath.run(profile) if task == "hotpath" else engaged.run(profile)
        finally:
            sched_harness.unload_plugin()
    raise ValueError(f"unknown task {task!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", required=True, help="comma-separated task names")
    parser.add_argument("--profile", choices=("smoke", "full"), default="smoke")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for task in args.tasks.split(","):
        start = time.monotonic()
        try:
            results[task] = run_task(task, args.profile)
        except BaseException as exc:  # report, keep going
            results[task] = {"error": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()[-2000:]}  # fmt: skip
        print(f"task {task}: {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    emit(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
