"""The shutdown summary, in a real process that ran the real scheduler and exited."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import logging, sys
    from tools import scenarios as sc
    from tools import sched_harness as harness
    import vllm_mamba_fix

    harness.load_plugins()
    assert sc.TWO_IMAGES.run().completed
    counts = vllm_mamba_fix.stats()
    print("COUNTS", counts["collapses_prevented"], counts["chunks_realigned"],
          counts["chunks_stopped_at_encoder_input"], flush=True)
    """
)


def test_summary_line_when_the_process_exits() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    for name in ("VLLM_MAMBA_FIX", "VLLM_MAMBA_FIX_SCOPE", "VLLM_PLUGINS"):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, cwd=REPO, capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    collapses, realigned, stopped = next(
        line.split()[1:] for line in done.stdout.splitlines() if line.startswith("COUNTS")
    )
    summary = [line for line in output.splitlines() if "this process prevented" in line]
    assert len(summary) == 1, output[-3000:]
    assert (
        f"prevented {collapses} collapses, re-aligned {realigned} chunks, stopped "
        f"{stopped} chunks at an encoder input" in summary[0]
    )
    assert int(collapses) + int(realigned) + int(stopped) > 0
