"""A platform scheduler with its own pre-0.28 ``schedule()`` on vLLM 0.28.0 and 0.32.0 (issue 16).

Mirrors vllm-ascend's schedulers that carry their own ``schedule()``, encoder budgeting
before the split (tests/platforms/old_order.py names the files). On a release whose base
``Scheduler`` is fixed, the plugin must install the split rule on that subclass only:
the subclass completes the issue layout with the plugin and stalls without it, and the base
``Scheduler`` keeps vLLM's own split.

Each release runs in a subprocess with its pure-Python ``vllm`` overlaid on PYTHONPATH
(tools/releases.py; the wheel is downloaded once into the tools' cache, as the matrix does).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.platforms._release_env import release_env

REPO = Path(__file__).resolve().parents[2]
RESULT_PREFIX = "OLD_ORDER_RESULT "
SPLIT = "_mamba_block_aligned_split"


def _run_on(release: str, work_dir: Path) -> dict[str, Any]:
    env = release_env(release)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.platforms._old_order_run", str(work_dir)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


@pytest.mark.parametrize("release", ["0.28.0", "0.32.0"])
def test_old_order_subclass_gets_the_split_rule_and_the_base_stays_stock(
    release: str, tmp_path: Path
) -> None:
    out = _run_on(release, tmp_path)
    assert out["version"] == release
    subclass = out["subclass"]
    # The transform reproduced the pattern, and this release's base is fixed.
    assert out["subclass_split_after_encoder"] is True
    assert out["base_split_after_encoder"] is False

    stock = out["stock_subclass"]
    assert stock["stalled"] and not stock["completed"], stock
    assert all(at % 1056 == 0 for at in stock["stall_at"].values()), stock["stall_at"]
    assert out["stock_base"]["completed"], out["stock_base"]

    assert out["plugin_subclass"]["completed"], out["plugin_subclass"]
    # The base carries only the block-unit rule (idle where the block sizes agree): the
    # same chunks as stock, and no split rule.
    assert not out["base_split_is_vllms_own"]
    assert out["base_after"]["split_is_wrapper"]
    assert out["plugin_base"]["chunks"] == out["stock_base"]["chunks"]
    # The wrapper sits on the subclass, over vLLM's own split.
    assert out["subclass_after"]["split_is_wrapper"]

    records = out["records"]
    sub_split = next(m for m in records[subclass]["methods"] if m["name"] == SPLIT)
    assert sub_split["state"] == "wrapped"
    assert sub_split["owner"] == subclass
    assert sub_split["wraps"] == f"vllm.v1.core.sched.scheduler.Scheduler.{SPLIT}"
    assert "split" in records[subclass]["rules"]
    base = "vllm.v1.core.sched.scheduler.Scheduler"
    base_split = next(m for m in records[base]["methods"] if m["name"] == SPLIT)
    assert base_split["state"] == "wrapped" and base_split["rules"] == ["block-unit"]
    assert "split" not in records[base]["rules"]
    assert sub_split["rules"] == ["block-unit", "split"]

    active = [msg for level, msg in out["log"] if " active: " in msg]
    assert any(f"active: {subclass} carries split" in msg for msg in active), active
    assert not any(f"active: {base} carries split" in msg for msg in active), active
