"""Run the scheduler-level suite (tests/scheduler) against a list of vLLM releases.

Each release runs in its own subprocess with that release's pure-Python
`vllm` package first on PYTHONPATH (tools/releases.py), so the tests import
its real `Scheduler`. The suites and the probe run every harness mode (sync,
async, sync+mtp2, async+mtp2; `--modes` or $VLLM_MAMBA_FIX_HARNESS_MODES
narrows them). Prints one row per release and writes the table as Markdown
(and JSON) so the table in docs/compatibility.md comes from a run:

    python -m tools.matrix --ci                    # one release per family (CI_MODES)
    python -m tools.matrix                          # latest patch of every minor
    python -m tools.matrix 0.19.1 0.25.1 -j 2
    python -m tools.matrix --readme                 # also refresh docs/compatibility.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tools import releases

REPO = Path(__file__).resolve().parent.parent
REPORT_ENV = "VLLM_MAMBA_FIX_MATRIX_REPORT"
MODES_ENV = "VLLM_MAMBA_FIX_HARNESS_MODES"  # tools.sched_harness.MODES_ENV (no vLLM import here)
README_START = "<!-- matrix:start -->"
README_END = "<!-- matrix:end -->"
COMPATIBILITY_DOC = REPO / "docs" / "compatibility.md"  # where --readme writes by default


# CI: one release per family (vllm_mamba_fix.versions.FAMILIES) and the modes it runs there.
# Every mode on 0.27.1, the last affected release. Elsewhere sync, plus sync+mtp2 on 0.28.0:
# on 0.28-0.32 the speculative-stall rule is all the plugin does, and it needs MTP to act.
# The exhaustive runs (every mode, 20 releases) stay `python -m tools.matrix` (--all: every one).
CI_MODES: dict[str, str] = {
    "0.15.1": "sync", "0.19.1": "sync", "0.25.1": "sync", "0.26.0": "sync",
    "0.27.1": "all", "0.28.0": "sync,sync+mtp2", "0.33.0": "sync",
}  # fmt: skip


def default_releases() -> list[str]:
    """The first affected release, then the latest patch of every minor 0.15 ... 0.33."""
    latest: dict[tuple[int, int], str] = {}
    for release in releases.ALL_RELEASES:
        major, minor, _ = (int(x) for x in release.split("."))
        latest[(major, minor)] = release  # ALL_RELEASES is sorted
    return ["0.15.0", *latest.values()]


# --------------------------------------------------------------------------
# Probe: runs inside the release's pytest process (see tests/scheduler/conftest.py)


def probe() -> dict[str, Any]:
    """Measure stock and patched behaviour of every scenario on the imported vLLM,
    in every selected harness mode.

    `stock`/`patched`/`block_size` are the sync mode's (the table before issue
    10); `modes` holds each mode's, or why the release cannot build it, and the
    scenarios left out of it with the reason.
    """
    import vllm_mamba_fix
    from tools import scenarios as sc
    from tools import sched_harness as harness
    from vllm_mamba_fix.counters import reset as reset_counters
    from vllm_mamba_fix.versions import family_for

    version = harness.vllm_version()
    family = family_for(version)
    modes = harness.selected_modes()
    runnable: dict[str, list[Any]] = {}
    per_mode: dict[str, dict[str, Any]] = {}
    for mode in modes:
        reason = harness.mode_unsupported_reason(mode)
        skipped = {s.name: s.mode_skip_reason(mode, with_plugin=True) for s in sc.ALL}
        per_mode[mode.name] = {
            "unsupported": reason,
            "skipped": {name: why for name, why in skipped.items() if why},
        }
        if not reason:
            runnable[mode.name] = [s for s in sc.ALL if not skipped[s.name]]
    by_name = {m.name: m for m in modes}
    saved = {k: os.environ.pop(k, None) for k in ("VLLM_MAMBA_FIX", "VLLM_PLUGINS")}
    try:
        harness.unload_plugin()
        stock = {
            m: {s.name: s.run(by_name[m]) for s in scenarios} for m, scenarios in runnable.items()
        }
        harness.load_plugins()
        default_active = harness.split_is_wrapped()
        default_methods = _wrapped_methods()
        speculative = _speculative_stall_probe(stock_only=False) if default_methods else None
        videos = _video_probe() if default_methods else None
        harness.unload_plugin()
        stock_speculative = _speculative_stall_probe(stock_only=True)
        stock_videos = _video_probe()
        harness.load_plugins()
        if not default_active:
            os.environ["VLLM_MAMBA_FIX"] = "force"
            harness.unload_plugin()
            harness.load_plugins()
        before = vllm_mamba_fix.stats()
        patched = {
            m: {s.name: s.run(by_name[m]) for s in scenarios} for m, scenarios in runnable.items()
        }
        after = vllm_mamba_fix.stats()
        for counts in (before, after):
            counts.pop("block_size")  # the unit, not a counter
        harness.unload_plugin()
        # pytest has closed its streams by the time the exit summary would be logged.
        reset_counters()
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
    for name in runnable:
        per_mode[name].update(
            block_size=next(iter(stock[name].values())).block_size,
            stock={n: _summary(r) for n, r in stock[name].items()},
            patched={n: _summary(r) for n, r in patched[name].items()},
        )
    first = harness.SYNC.name if harness.SYNC.name in runnable else next(iter(runnable), None)
    return {
        "version": version,
        "family": family.name,
        "architecture": harness.supported_architecture(),
        "block_size": per_mode[first]["block_size"] if first else None,
        "default_active": default_active,
        "default_methods": default_methods,
        "speculative_stall": {"stock": stock_speculative, "plugin": speculative},
        "videos": {"stock": stock_videos, "plugin": videos, "layout": _video_layout_source()},
        "stock": per_mode[first]["stock"] if first else {},
        "patched": per_mode[first]["patched"] if first else {},
        "modes": per_mode,
        "actions": {k: after.get(k, 0) - before.get(k, 0) for k in after},
    }


def _wrapped_methods() -> list[str]:
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_mamba_fix import patch, targets

    return [name for name in targets.RULE_METHODS if patch.is_wrapped(Scheduler, name)]


SPECULATIVE_GAPS = (0, 1)


def _speculative_stall_probe(stock_only: bool) -> dict[str, Any] | None:
    """Issue 11's layout (tests/scheduler/test_speculative_stall.py) under sync MTP K=2:
    two 11,844-token images 0 and 1 tokens apart, beside a text request, with
    whatever is loaded now. None where the release cannot build MTP."""
    from tools import sched_harness as harness
    from tools.scenarios import ISSUE_CONFIG, image_request, text_request

    if harness.mode_unsupported_reason(harness.SYNC_MTP2):
        return None
    import vllm_mamba_fix

    before = vllm_mamba_fix.stats()["stalls_detected"]
    results = {}
    for gap in SPECULATIVE_GAPS:
        h = harness.Harness(harness.SYNC_MTP2.apply(ISSUE_CONFIG))
        h.add(text_request("spec-text", 3000), image_request("spec-image", (5, gap, 200)))
        results[str(gap)] = _summary(h.run(max_steps=120, stall_steps=10))
    named = vllm_mamba_fix.stats()["stalls_detected"] - before
    return {"gaps": results, "stalls_named": 0 if stock_only else named}


def _speculative_cell(data: dict[str, Any]) -> str:
    probe = data.get("speculative_stall") or {}
    stock, plugin = probe.get("stock"), probe.get("plugin")
    if stock is None:
        return "n/a: no Qwen3.5 (MTP)"
    gaps = ", ".join(SPECULATIVE_GAPS.__str__().strip("()").split(", "))
    stalls = [g for g, r in stock["gaps"].items() if not r["completed"]]
    cell = f"gaps {gaps}: stock stalls {len(stalls)}/{len(stock['gaps'])}"
    if plugin is None:
        return cell + "; plugin inactive (not needed)"
    done = [g for g, r in plugin["gaps"].items() if r["completed"]]
    cell += f"; plugin completes {len(done)}/{len(plugin['gaps'])}"
    return cell + ", names the rest in the log" if len(done) < len(plugin["gaps"]) else cell


def _video_scenarios() -> list[Any]:
    from tools import scenarios as sc

    return [sc.TWO_VIDEOS_GAP_0, sc.TWO_VIDEOS_GAP_2]


def _video_layout_source() -> str:
    from tools import sched_harness as harness

    return harness.video_layout_source()


def _video_probe() -> dict[str, Any]:
    """Issue 15: two Qwen3-VL videos in one request (tools.scenarios, back to back and 2
    apart), sync mode, with whatever is loaded now."""
    return {s.name: _summary(s.run()) for s in _video_scenarios()}


def _video_cell(data: dict[str, Any]) -> str:
    probe = data.get("videos") or {}
    stock, plugin = probe.get("stock"), probe.get("plugin")
    if stock is None:
        return "?"
    stalls = sum(not r["completed"] for r in stock.values())
    cell = f"gaps 0, 2: stock stalls {stalls}/{len(stock)}"
    if plugin is None:
        return cell + "; plugin inactive (not needed)"
    done = sum(r["completed"] for r in plugin.values())
    bad = sum(r["violations"] for r in plugin.values())
    return (
        cell + f"; plugin completes {done}/{len(plugin)}" + (f", {bad} violations" if bad else "")
    )


def _summary(result: Any) -> dict[str, Any]:
    return {
        "completed": result.completed,
        "stall_at": result.stall_at,
        "violations": len(result.violations()),
        "steps": result.steps,
    }


# --------------------------------------------------------------------------
# Runner


@dataclass
class Row:
    release: str
    family: str = "?"
    stock: str = "?"
    plugin: str = "?"
    # Mode name -> "stock ... -> plugin ..." cell (or why the mode cannot run).
    modes: dict[str, str] = field(default_factory=dict)
    does: str = "?"
    result: str = "error"
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    detail: str = ""
    probe: dict[str, Any] = field(default_factory=dict)


def _counts(junit: Path) -> tuple[int, int, int]:
    if not junit.exists():
        return 0, 0, 0
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return total - failed - skipped, failed, skipped


def _stock_text(stock: dict[str, Any]) -> str:
    stalls = [n for n, r in stock.items() if not r["completed"]]
    if not stalls:
        return f"completes {len(stock)}/{len(stock)}"
    first = stock[stalls[0]]["stall_at"]
    where = ", ".join(f"{rid} @ {at}" for rid, at in first.items())
    return f"stalls in {len(stalls)}/{len(stock)} scenarios ({stalls[0]}: {where})"


def _plugin_text(patched: dict[str, Any], default_active: bool) -> str:
    done = sum(r["completed"] for r in patched.values())
    bad = sum(r["violations"] for r in patched.values())
    mode = "" if default_active else "force: "
    return f"{mode}completes {done}/{len(patched)}, {bad} boundary violations"


def _mode_cell(data: dict[str, Any], default_active: bool) -> str:
    """One table cell: stock -> plugin in one mode, compact."""
    if data.get("unsupported"):
        reason = data["unsupported"]
        if "does not register" in reason:
            return "n/a: no Qwen3.5 (MTP)"
        return f"n/a: {reason[:60]}"
    stock, patched = data["stock"], data["patched"]
    n = len(stock)
    stalls = sum(not r["completed"] for r in stock.values())
    done = sum(r["completed"] for r in patched.values())
    bad = sum(r["violations"] for r in patched.values())
    force = "" if default_active else "force "
    cell = f"B {data['block_size']}: stock stalls {stalls}/{n}; {force}plugin completes {done}/{n}"
    cell += f", {bad} violations" if bad else ""
    if data.get("skipped"):
        cell += f" ({len(data['skipped'])} gap<2 left out)"
    return cell


def _describe(row: Row, data: dict[str, Any]) -> None:
    row.family = data["family"]
    row.stock = _stock_text(data["stock"])
    row.plugin = _plugin_text(data["patched"], data["default_active"])
    row.modes = {
        name: _mode_cell(mode, data["default_active"])
        for name, mode in data.get("modes", {}).items()
    }
    row.modes["speculative stall (sync+mtp2, issue 11)"] = _speculative_cell(data)
    row.modes["two videos (sync, issue 15)"] = _video_cell(data)
    acts = data["actions"]
    summary = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in acts.items() if v) or "no change"
    if data["default_active"]:
        row.does = f"patches: {summary}"
    elif data.get("default_methods"):
        row.does = (
            f"by default: speculative-stall rule and watchdog only; force adds the split: {summary}"
        )
    else:
        row.does = f"inactive by default (not needed); force: {summary}"


def run_release(
    release: str, timeout: float, pytest_args: list[str], modes: str | None = None
) -> Row:
    """``modes``: the comma list of harness modes for this release (None: as inherited)."""
    row = Row(release)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"matrix-{release}-") as tmp:
        report, junit = Path(tmp) / "probe.json", Path(tmp) / "junit.xml"
        try:
            env = dict(os.environ)
            env["PYTHONPATH"] = releases.pythonpath_for(release, base=str(REPO))
            env[REPORT_ENV] = str(report)
            if modes:
                env[MODES_ENV] = modes
            env.setdefault("VLLM_MAMBA_FIX_PROPERTY_EXAMPLES", "8")
            for name in ("VLLM_MAMBA_FIX", "VLLM_MAMBA_FIX_SCOPE", "VLLM_PLUGINS"):
                env.pop(name, None)
            cmd = [
                sys.executable, "-m", "pytest", "tests/scheduler", "tests/properties",
                "-m", "matrix", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *pytest_args,
            ]  # fmt: skip
            proc = subprocess.run(
                cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
            )
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            summary = [ln for ln in lines if re.match(r"(FAILED|ERROR) |=+ .*(passed|failed)", ln)]
            row.detail = "\n".join([*summary, "...", *lines[-15:]])
            row.passed, row.failed, row.skipped = _counts(junit)
            row.result = "pass" if proc.returncode == 0 and row.passed else "FAIL"
            if report.exists():
                row.probe = json.loads(report.read_text())
                _describe(row, row.probe)
                if row.probe["version"] != release:
                    row.result = "FAIL"
                    row.detail += f"\nimported vLLM {row.probe['version']}, not {release}"
        except subprocess.TimeoutExpired:
            row.result, row.detail = "FAIL", f"timed out after {timeout:.0f}s"
        except Exception as exc:  # a broken release must not stop the matrix
            row.result, row.detail = "FAIL", f"{type(exc).__name__}: {exc}"
    row.seconds = time.monotonic() - start
    return row


def markdown(rows: list[Row]) -> str:
    """One row per release; one column per harness mode (stock -> plugin)."""
    modes: list[str] = []
    for r in rows:
        modes += [m for m in r.modes if m not in modes]
    header = ["release", "family", *modes, "what the plugin does (all modes)", "tests"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        tests = f"{r.result} ({r.passed} passed, {r.failed} failed, {r.skipped} skipped)"
        cells = [r.modes.get(m, "?") for m in modes]
        lines.append("| " + " | ".join([r.release, r.family, *cells, r.does, tests]) + " |")
    return "\n".join(lines) + "\n"


def update_readme(readme: Path, table: str, note: str) -> None:
    text = readme.read_text()
    block = f"{README_START}\n{note}\n\n{table}{README_END}"
    pattern = re.compile(re.escape(README_START) + ".*?" + re.escape(README_END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{readme} has no {README_START} ... {README_END} markers")
    readme.write_text(pattern.sub(lambda _: block, text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("releases", nargs="*", help="releases (default: every minor)")
    parser.add_argument(
        "--ci", action="store_true", help="one release per family, in the modes of CI_MODES"
    )
    parser.add_argument("--all", action="store_true", help="every published release")
    parser.add_argument("-j", "--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per release")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "matrix.md")
    parser.add_argument(
        "--readme",
        type=Path,
        nargs="?",
        const=COMPATIBILITY_DOC,
        help="refresh the table between the markers of PATH (default: docs/compatibility.md)",
    )
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments")
    parser.add_argument(
        "--modes",
        help="comma list of harness modes (default: $VLLM_MAMBA_FIX_HARNESS_MODES or all four)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print pytest tails")
    args = parser.parse_args(argv)
    if args.modes:
        os.environ[MODES_ENV] = args.modes  # inherited by every release's pytest

    chosen = (
        args.releases
        or (list(CI_MODES) if args.ci else None)
        or (list(releases.ALL_RELEASES) if args.all else default_releases())
    )

    def per_release(release: str) -> str | None:
        # --modes or $VLLM_MAMBA_FIX_HARNESS_MODES win; else --ci sets each release's modes.
        return None if os.environ.get(MODES_ENV) or not args.ci else CI_MODES.get(release)

    started = time.monotonic()
    # Download and extract first, one at a time (pip and the disk do not parallelise).
    for release in chosen:
        try:
            releases.pythonpath_for(release)
        except Exception as exc:
            print(f"{release}: cannot prepare overlay: {exc}", file=sys.stderr)
    print(f"{'release':8} {'family':6} {'result':6} {'time':>6}  stock | plugin | does")
    rows: list[Row] = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [
            pool.submit(run_release, r, args.timeout, args.pytest_args.split(), per_release(r))
            for r in chosen
        ]
        for future in futures:
            row = future.result()
            rows.append(row)
            print(
                f"{row.release:8} {row.family:6} {row.result:6} {row.seconds:5.0f}s  "
                f"{row.stock} | {row.plugin} | {row.does}",
                flush=True,
            )
            for mode, cell in row.modes.items():
                print(f"    {mode:10} {cell}", flush=True)
            if args.verbose or row.result != "pass":
                print("    " + row.detail.replace("\n", "\n    "), flush=True)
    total = time.monotonic() - started
    import vllm_mamba_fix

    note = (
        f"Generated by `python -m tools.matrix {' '.join(argv or sys.argv[1:])}`".rstrip()
        + f" with vllm-mamba-fix {vllm_mamba_fix.__version__} on "
        + time.strftime("%Y-%m-%d")
        + f" ({len(rows)} releases, {total:.0f} s)."
    )
    table = markdown(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(f"{note}\n\n{table}")
    args.out.with_suffix(".json").write_text(
        json.dumps([asdict(r) for r in rows], indent=1, default=str)
    )
    if args.readme:
        update_readme(args.readme, table, note)
    print(f"\n{len(rows)} releases in {total:.0f} s; table written to {args.out}")
    passed = sum(r.result == "pass" for r in rows)
    print(f"matrix: {passed} passed, {len(rows) - passed} failed")  # CI reads this closing line
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
