"""The benchmark command's smoke profile produces a well-formed table (no timing asserts)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SECTIONS = ("1 hot path", "2 steps", "3 prefix reuse", "4 start-up", "5 end to end")
MODES = {"sync", "async", "sync+mtp2", "async+mtp2"}
HOT_PATH_ARMS = {"stock", "split", "split+encoder"}
# Issue 29 item 5: per workload, the block-unit rule idle and engaged.
ENGAGED_KEYS = {f"{w}/{s}" for w in ("text", "mixed") for s in ("idle", "engaged")}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, str]:
    out = tmp_path_factory.mktemp("bench") / "smoke"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--profile", "smoke", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    return proc.stdout, data, out.with_suffix(".md").read_text()


def test_json_has_every_section(smoke: tuple[str, dict, str]) -> None:
    _, data, _ = smoke
    rows = data["analysis"]["rows"]
    assert {r["section"] for r in rows} == set(SECTIONS)
    for r in rows:
        assert set(r) == {"section", "measure", "result", "target", "met"}
        assert r["met"] in ("", "yes", "NO")
        assert r["result"]
    assert data["results"]["meta"]["profile"] == "smoke"


def test_sections_ran_without_errors(smoke: tuple[str, dict, str]) -> None:
    _, data, _ = smoke
    errors = [r for r in data["analysis"]["rows"] if r["result"].startswith("error")]
    assert not errors, errors
    # The step comparison covered every smoke layout in all four arms, in every mode.
    layouts = data["analysis"]["layouts"]
    assert layouts and all(set(x) >= {"plugin", "upstream", "nocache", "stock"} for x in layouts)
    assert {x["mode"] for x in layouts} == MODES
    assert {x["mode"] for x in data["analysis"]["prefix"]} == MODES
    # Images 0-1 tokens apart: measured under MTP only, outside the sweep.
    stalls = data["analysis"]["stall_layouts"]
    assert stalls and {x["mode"] for x in stalls} == {m for m in MODES if "mtp" in m}
    # The hot path ran its three arms side by side.
    hot = data["results"]["main"]["hotpath"]["schedule"]
    assert set(hot["us_per_step"]) == HOT_PATH_ARMS
    # Issue 22 item 6: the text-only step, the plugin as registered against stock, same work.
    text = data["results"]["main"]["hotpath"]["text_step"]
    assert set(text["us_per_step"]) == {"stock", "plugin"} and text["steps"] > 0
    assert text["diverged_steps"] == 0
    assert {"_mamba_block_aligned_split", "_try_schedule_encoder_inputs"} <= set(text["wrapped"])
    # The block-unit rule engaged next to idle, per split call and per step, with stock and a
    # bare wrapper side by side, in a process of their own; the step's chunks are stock's on
    # every step.
    engaged = data["results"]["engaged"]
    assert set(engaged["calls"]) == set(engaged["steps"]) == ENGAGED_KEYS
    for key, step in engaged["steps"].items():
        assert step["steps"] > 0 and step["diverged_steps"] == 0, (key, step)
        assert set(step["us_per_step"]) == {"stock", "bare", "plugin"}
        # The plugin settled the block-unit rule's view on the engaged scheduler only.
        assert step["engaged"] == key.endswith("/engaged"), (key, step)
    for key, calls in engaged["calls"].items():
        assert calls["calls"] > 0 and set(calls["ratio"]) == {"plugin/stock", "bare/stock"}
        assert calls["engaged"] == key.endswith("/engaged"), (key, calls)
    # The newest release's split per call: measured where its overlay is cached.
    newest = data["results"]["newest"]
    assert "error" not in newest, newest
    if "skipped" not in newest:
        assert set(newest["calls"]) == ENGAGED_KEYS and newest["vllm"] == "0.34.0"
    # The scope rules are timed as the plugin runs them: loaded when it patched.
    assert data["results"]["main"]["hotpath"]["scope_load"]["installed_loaded"] is True


def test_markdown_table_is_well_formed(smoke: tuple[str, dict, str]) -> None:
    stdout, data, md = smoke
    table = [ln for ln in md.splitlines() if ln.startswith("| ")]
    header = table[0]
    assert header == "| section | measure | result | target | met |"
    summary = [ln for ln in table if ln.split(" | ")[0].lstrip("| ") in SECTIONS]
    assert len(summary) == len(data["analysis"]["rows"])
    assert all(ln.count(" | ") == 4 and ln.endswith(" |") for ln in summary)
    for section in SECTIONS:
        assert section in stdout


@pytest.mark.parametrize("count", [2, 3, 4])
def test_arm_order_balances_places_and_precedence_over_a_cycle(count: int) -> None:
    """Each arm runs in each place, and before each other arm, equally often over a cycle: a
    rotation of three does not (the second always runs right after the first), which read
    identical arms as 0.98 and 1.02 of the first on this machine."""
    from benchmarks.common import arm_order

    arms = [f"arm{i}" for i in range(count)]
    cycle = [arm_order(arms, turn) for turn in range(math.factorial(count))]
    assert all(sorted(order) == arms for order in cycle)
    places = Counter((arm, order.index(arm)) for order in cycle for arm in arms)
    assert set(places.values()) == {math.factorial(count - 1)}
    follows = Counter(
        (order[i], order[i + 1]) for order in cycle for i in range(count - 1)
    )  # right after: what warms or cools the next arm
    assert len(set(follows.values())) == 1 and len(follows) == count * (count - 1)
    assert arm_order(arms, len(cycle)) == cycle[0]  # turns past a cycle go round again
