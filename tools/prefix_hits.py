"""Prefix-hit tokens per family: stock, the plugin, and the sizes agreeing (issue 36 item 4).

Multi-turn workloads on the real `Scheduler` of each release (its overlay first on PYTHONPATH,
tools/releases.py): each turn is the previous turn's prompt plus new text and an image, sent
once the previous turn finished, so every turn can hit the prefix cache up to the last state
the previous turn cached. Each workload runs three ways, and the hit tokens (the start of each
request's first chunk: what the prefix cache gave it) are summed over every turn:

- stock: vLLM's own scheduler, with `cache_config.block_size` as the workload sets it;
- plugin: the plugin loaded the engine's way with its defaults, the same configuration;
- agreeing: stock with `cache_config.block_size` equal to the cache's block.

Two configurations per release: the sizes agreeing (cache block 256), and a block mismatch
(`cache_config.block_size` 128 below the cache's 256, vLLM #54076). In sync and sync+mtp2.
The encoder cache holds every image: stock completes every turn, so the three are comparable
(the plugin's corrections of deadlocks are the differential suite's, `tests/properties`).

    python -m tools.prefix_hits                      # CI's release of every family
    python -m tools.prefix_hits 0.27.1 0.28.0        # some releases; prints the table
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CI_RELEASES = ("0.15.1", "0.19.1", "0.25.1", "0.26.0", "0.27.1", "0.28.0", "0.34.0")
MODES = ("sync", "sync+mtp2")
MARKER = "@@prefix-hits@@ "
CACHE_BLOCK, CONFIGURED = 256, 128


def turns(name: str, n: int, with_images: bool) -> list[Any]:
    """n turns of one conversation: turn k is turn k-1 plus 150-400 tokens (and an image)."""
    from tools.prop_adapters import PropRequest

    out, length, images = [], 300, []
    for k in range(n):
        if with_images:
            images.append((length - 40, 100 + 30 * (k % 3)))
            length = images[-1][0] + images[-1][1]
        length += 150 + 83 * (k % 4)
        after = out[-1].request_id if out else None
        out.append(PropRequest(f"{name}-t{k}", length, tuple(images), content=name, after=after,
                               max_tokens=2))  # fmt: skip
    return out


def workloads(configured: int | None) -> list[tuple[str, Any]]:
    from tools.prop_adapters import PropScenario

    def scenario(requests: list[Any], budget: int, cache: int) -> Any:
        return PropScenario(CACHE_BLOCK, budget, cache, 0, tuple(requests), configured)

    return [
        ("text, budget 512", scenario(turns("text", 6, False), 512, 4096)),
        ("images, budget 512", scenario(turns("img", 6, True), 512, 4096)),
        ("images, budget 300", scenario(turns("img", 6, True), 300, 4096)),
        ("two conversations", scenario(
            [r for pair in zip(turns("a", 4, True), turns("b", 4, False), strict=True)
             for r in pair], 384, 4096)),
    ]  # fmt: skip


def _hits(trace: Any) -> tuple[int, int]:
    """(hit tokens over every request, requests left unfinished)."""
    hits = sum(c[0][1] for c in trace.result.chunks.values() if c)
    return hits, len(trace.result.stall_at)


def _later_prompts(scenario: Any) -> int:
    """Prompt tokens of every turn after a conversation's first: what could hit."""
    return sum(r.prompt_len for r in scenario.requests if r.after)


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """The plugin as vLLM loads it, with its defaults (nothing forced)."""
    from tools import prop_adapters as pa
    from tools import sched_harness as harness

    with pa.clean_env():
        harness.unload_plugin()
        harness.load_plugins()
        try:
            yield
        finally:
            harness.unload_plugin()


def measure() -> dict[str, Any]:
    """Inside the release's process: every workload, configuration and mode, three ways."""
    from tools import prop_adapters as pa
    from tools import sched_harness as harness

    rows = []
    for mode_name in MODES:
        mode = harness.MODES_BY_NAME[mode_name]
        if harness.mode_unsupported_reason(mode):
            continue
        for configured in (None, CONFIGURED):
            for name, scenario in workloads(configured):
                runs = {}
                with pa.stock():
                    runs["stock"] = pa.drive(scenario, max_steps=400, mode=mode)
                    runs["agreeing"] = pa.drive(scenario.pinned, max_steps=400, mode=mode)
                with registered():
                    runs["plugin"] = pa.drive(scenario, max_steps=400, mode=mode)
                rows.append({
                    "mode": mode_name, "workload": name, "configured": configured,
                    "later_prompt_tokens": _later_prompts(scenario),
                    **{k: _hits(t) for k, t in runs.items()},
                })  # fmt: skip
    return {"version": harness.vllm_version(), "rows": rows}


def run_release(release: str) -> dict[str, Any]:
    from tools import releases

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MAMBA_FIX")}
    env.pop("VLLM_PLUGINS", None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(releases.ensure_overlay(release)),
                    str(releases.ensure_extra_packages(releases.quirks_for(release).extra_packages)
                        or ""), str(REPO)) if p
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "tools.prefix_hits", "--inside"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            data: dict[str, Any] = json.loads(line[len(MARKER) :])
            return data
    raise RuntimeError(f"{release}: no result (exit {proc.returncode}): {proc.stderr[-2000:]}")


def markdown(results: list[dict[str, Any]]) -> str:
    """One row per release, mode and configuration: hit tokens summed over the workloads."""
    from vllm_mamba_fix.facts.versions import family_for

    lines = [
        "| vLLM (family) | mode | `cache_config.block_size` | stock | plugin | sizes agreeing "
        "| prompt tokens of later turns | unfinished (stock / plugin / agreeing) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for data in results:
        version = data["version"]
        groups: dict[tuple[str, Any], list[dict[str, Any]]] = {}
        for row in data["rows"]:
            groups.setdefault((row["mode"], row["configured"]), []).append(row)
        for (mode, configured), rows in groups.items():
            total = {k: sum(r[k][0] for r in rows) for k in ("stock", "plugin", "agreeing")}
            left = {k: sum(r[k][1] for r in rows) for k in ("stock", "plugin", "agreeing")}
            size = f"{configured} (cache {CACHE_BLOCK})" if configured else f"{CACHE_BLOCK}"
            lines.append(
                f"| {version} ({family_for(version).name}) | {mode} | {size} | "
                f"{total['stock']:,} | {total['plugin']:,} | {total['agreeing']:,} | "
                f"{sum(r['later_prompt_tokens'] for r in rows):,} | "
                f"{left['stock']} / {left['plugin']} / {left['agreeing']} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("releases", nargs="*")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        data = measure()
        print(MARKER + json.dumps(data), flush=True)
        return 0
    results = []
    for release in args.releases or CI_RELEASES:
        data = run_release(release)
        results.append(data)
        print(json.dumps(data), file=sys.stderr, flush=True)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
