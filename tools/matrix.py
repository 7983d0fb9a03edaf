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

Resumable: each release runs as cells (its `base` cell: the tests that take no mode
and the mode-free probes; one cell per mode), and a finished cell is cached under a
key that hashes everything that decides it (tools/matrix_cache.py). A re-run runs
only the cells it does not find, so the full run can be done in pieces:

    python -m tools.matrix 0.15.0 0.15.1 0.16.0 -j 1   # a piece; its cells are cached
    python -m tools.matrix --stop-after 1200          # starts no release after 20 minutes
    python -m tools.matrix --readme                   # the rest, then the whole table
    python -m tools.matrix --fresh                    # ignore the cache, run every cell
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tools import matrix_cache, releases
from tools.releases import CI_MODES, default_releases  # defined with the release list

REPO = Path(__file__).resolve().parent.parent
REPORT_ENV = "VLLM_MAMBA_FIX_MATRIX_REPORT"
MODES_ENV = "VLLM_MAMBA_FIX_HARNESS_MODES"  # tools.sched_harness.MODES_ENV (no vLLM import here)
README_START = "<!-- matrix:start -->"
README_END = "<!-- matrix:end -->"
COMPATIBILITY_DOC = REPO / "docs" / "compatibility.md"  # where --readme writes by default
# tools.sched_harness.MODES, by name (that module imports vLLM; the unit test pins the two).
ALL_MODES: tuple[str, ...] = ("sync", "async", "sync+mtp2", "async+mtp2")


# --------------------------------------------------------------------------
# Probe: runs inside the release's pytest process (see tests/scheduler/conftest.py)


def probe() -> dict[str, Any]:
    """Measure stock and patched behaviour of every scenario on the imported vLLM,
    in every harness mode of the cells this process runs ($VLLM_MAMBA_FIX_MATRIX_CELLS,
    default: the base cell and every selected mode).

    `modes` holds each mode's scenarios (or why the release cannot build the mode),
    the scenarios left out of it with the reason, and the corrections its patched
    runs made; `base` (None when the base cell is not run here) the mode-free probes.
    """
    import vllm_mamba_fix
    from tools import scenarios as sc
    from tools import sched_harness as harness
    from vllm_mamba_fix.facts.versions import family_for

    version = harness.vllm_version()
    family = family_for(version)
    wanted = {c for c in os.environ.get(matrix_cache.CELLS_ENV, "").split(",") if c}
    modes = [m for m in harness.selected_modes() if not wanted or m.name in wanted]
    with_base = not wanted or matrix_cache.BASE in wanted
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
    base: dict[str, Any] | None = None
    saved = {k: os.environ.pop(k, None) for k in ("VLLM_MAMBA_FIX", "VLLM_PLUGINS")}
    try:
        harness.unload_plugin()
        stock = {
            m: {s.name: s.run(by_name[m]) for s in scenarios} for m, scenarios in runnable.items()
        }
        harness.load_plugins()
        # The split rule, not merely a wrapped split: the block-unit rule wraps it everywhere.
        default_active = harness.split_rule_installed()
        default_methods = _wrapped_methods()
        default_rules = _installed_rules()
        if with_base:
            speculative = _speculative_stall_probe(stock_only=False) if default_methods else None
            videos = _video_probe() if default_methods else None
            harness.unload_plugin()
            stock_speculative = _speculative_stall_probe(stock_only=True)
            stock_videos = _video_probe()
            harness.load_plugins()
            layout = _video_layout_source()
            base = {
                "speculative_stall": {"stock": stock_speculative, "plugin": speculative},
                "videos": {"stock": stock_videos, "plugin": videos, "layout": layout},
            }
        if not default_active:
            os.environ["VLLM_MAMBA_FIX"] = "force"
            harness.unload_plugin()
            harness.load_plugins()
        patched: dict[str, dict[str, Any]] = {}
        for m, scenarios in runnable.items():
            before = vllm_mamba_fix.stats()  # counters only (facts live in the record)
            patched[m] = {s.name: s.run(by_name[m]) for s in scenarios}
            after = vllm_mamba_fix.stats()
            per_mode[m]["actions"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        # Also cancels the exit summary: pytest has closed its streams by then.
        harness.unload_plugin()
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
    return {
        "version": version,
        "family": family.name,
        "architecture": harness.supported_architecture(),
        "default_active": default_active,
        "default_methods": default_methods,
        "default_rules": default_rules,
        "modes": per_mode,
        "base": base,
    }


def _installed_rules() -> list[str]:
    """The rules the wrappers installed now carry, in the rule table's order."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_mamba_fix.rules import table as rules

    carried = set().union(
        *(rules.carried_by(Scheduler.__dict__.get(n), n) for n in rules.RULE_METHODS)
    )
    return [spec.rule.value for spec in rules.RULES if spec.rule in carried]


def _wrapped_methods() -> list[str]:
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_mamba_fix.install import patch
    from vllm_mamba_fix.rules import table as rules

    return [name for name in rules.RULE_METHODS if patch.is_wrapped(Scheduler, name)]


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
    seconds: float = 0.0  # this run's wall time for the row
    detail: str = ""
    probe: dict[str, Any] = field(default_factory=dict)
    cells_run: int = 0
    cells_reused: int = 0  # found in the cache under their key
    stored: list[str] = field(default_factory=list)  # when the reused cells were made
    test_seconds: float = 0.0  # pytest time of all its cells, reused ones included
    earlier: int = 0  # cells reused from earlier sources (--reuse-sources)


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
    rules = ", ".join(data.get("default_rules") or [])
    if data["default_active"]:
        row.does = f"patches ({rules}): {summary}"
    elif rules:
        row.does = f"by default: {rules} (no split rule); force adds the split: {summary}"
    else:
        row.does = f"inactive by default (not needed); force: {summary}"


def modes_for(release: str, ci: bool) -> list[str]:
    """This release's harness modes: --modes / $VLLM_MAMBA_FIX_HARNESS_MODES win; else under
    --ci the release's CI_MODES entry; else all four."""
    raw = (os.environ.get(MODES_ENV) or (CI_MODES.get(release) if ci else None) or "all").strip()
    names = list(ALL_MODES) if raw == "all" else [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_MODES]
    if unknown or not names:
        raise SystemExit(f"unknown harness modes {unknown or raw!r}; known: {list(ALL_MODES)}")
    return [m for m in ALL_MODES if m in names]


@dataclass(frozen=True)
class Keys:
    """What every cell key of this run shares (tools.matrix_cache.cell_key)."""

    sources: str
    environment: str
    settings: dict[str, str]
    root: Path = REPO  # where `sources` was hashed
    # --reuse-sources: earlier source digests whose finished cells count too (never in CI).
    earlier: tuple[str, ...] = ()

    @classmethod
    def now(cls, pytest_args: list[str]) -> Keys:
        return cls(
            matrix_cache.sources_digest(),
            matrix_cache.environment_digest(),
            run_settings(pytest_args),
        )

    def of(self, release: str, cell: str, sources: str | None = None) -> str:
        return matrix_cache.cell_key(
            release, cell, sources or self.sources, self.environment, self.settings
        )


def _subprocess_env(release: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = releases.pythonpath_for(release, base=str(REPO))
    env.setdefault("VLLM_MAMBA_FIX_PROPERTY_EXAMPLES", "8")
    for name in ("VLLM_MAMBA_FIX", "VLLM_MAMBA_FIX_SCOPE", "VLLM_PLUGINS"):
        env.pop(name, None)
    return env


def run_settings(pytest_args: list[str]) -> dict[str, str]:
    """The settings of a run that decide a cell beyond the sources: the hypothesis profile,
    every other VLLM_* / HYPOTHESIS_* variable the subprocess sees, and the pytest args."""
    env = dict(os.environ)
    env.setdefault("VLLM_MAMBA_FIX_PROPERTY_EXAMPLES", "8")
    own = {
        REPORT_ENV, MODES_ENV, matrix_cache.CELLS_ENV, matrix_cache.OUTCOMES_ENV,
        "VLLM_MAMBA_FIX_CACHE", "VLLM_MAMBA_FIX", "VLLM_MAMBA_FIX_SCOPE", "VLLM_PLUGINS",
    }  # fmt: skip
    settings = {
        k: v for k, v in env.items() if k.startswith(("VLLM_", "HYPOTHESIS_")) and k not in own
    }
    settings.update({k: env.get(k, "") for k in matrix_cache.PROFILE_ENVS})
    settings["pytest_args"] = " ".join(pytest_args)
    return settings


def _run_cells(
    release: str, cells: list[str], timeout: float, pytest_args: list[str]
) -> tuple[dict[str, dict[str, Any]], str]:
    """Run the given cells of one release in one pytest process.

    Returns each cell's stored form ({"tests", "probe", "ok", "seconds"}) and the
    output's summary; a cell is ok when the process finished, wrote its probe, and
    none of the cell's tests failed.
    """
    modes = [c for c in cells if c != matrix_cache.BASE]
    start = time.monotonic()
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix=f"matrix-{release}-") as tmp:
        report, outcomes = Path(tmp) / "probe.json", Path(tmp) / "outcomes.json"
        env = _subprocess_env(release)
        env[REPORT_ENV], env[matrix_cache.OUTCOMES_ENV] = str(report), str(outcomes)
        env[matrix_cache.CELLS_ENV] = ",".join(cells)
        env[MODES_ENV] = ",".join(modes) or ALL_MODES[0]  # base alone: no mode item is kept
        cmd = [
            sys.executable, "-m", "pytest", "tests/scheduler", "tests/properties",
            "-m", "matrix", "-q", "-p", "no:cacheprovider", "-p", "tools.matrix_cache",
            *pytest_args,
        ]  # fmt: skip
        try:
            proc = subprocess.run(
                cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return {}, f"timed out after {timeout:.0f}s"
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        summary = [ln for ln in lines if re.match(r"(FAILED|ERROR) |=+ .*(passed|failed)", ln)]
        detail = "\n".join([*summary, "...", *lines[-15:]])
        if proc.returncode not in (0, 1) or not report.exists() or not outcomes.exists():
            return {}, detail + f"\npytest exited {proc.returncode} without a complete report"
        data, counts = json.loads(report.read_text()), json.loads(outcomes.read_text())
    seconds = (time.monotonic() - start) / len(cells)  # the process's time, shared out
    if data["version"] != release:
        return {}, detail + f"\nimported vLLM {data['version']}, not {release}"
    common = {k: v for k, v in data.items() if k not in ("modes", "base")}
    for cell in cells:
        tests = counts.get(cell, {"passed": 0, "failed": 0, "skipped": 0, "failures": []})
        part = data["base"] if cell == matrix_cache.BASE else data["modes"].get(cell)
        probe = {**common, cell: part}
        ok = part is not None and not tests["failed"]
        out[cell] = {"tests": tests, "probe": probe, "ok": ok, "seconds": seconds}
    if proc.returncode == 1 and all(c["ok"] for c in out.values()):
        # pytest says something failed, and no cell owns it: trust none of them.
        for cell in out.values():
            cell["ok"] = False
    return out, detail


def merge(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One release's probe, in the shape _describe reads, from its cells' stored parts."""
    first = next(iter(cells.values()))["probe"]
    shared = ("version", "family", "architecture", "default_active", "default_methods",
              "default_rules")  # fmt: skip
    data: dict[str, Any] = {k: first.get(k) for k in shared}
    base = (cells.get(matrix_cache.BASE) or {}).get("probe", {}).get(matrix_cache.BASE) or {}
    data["speculative_stall"] = base.get("speculative_stall")
    data["videos"] = base.get("videos")
    data["modes"] = {
        m: cells[m]["probe"][m] for m in ALL_MODES if m in cells and cells[m]["probe"].get(m)
    }
    runnable = [m for m, d in data["modes"].items() if not d.get("unsupported")]
    first_mode = runnable[0] if runnable else None  # sync where it runs
    data["block_size"] = data["modes"][first_mode]["block_size"] if first_mode else None
    data["stock"] = data["modes"][first_mode]["stock"] if first_mode else {}
    data["patched"] = data["modes"][first_mode]["patched"] if first_mode else {}
    actions: dict[str, int] = {}
    for mode in data["modes"].values():
        for key, value in mode.get("actions", {}).items():
            actions[key] = actions.get(key, 0) + value
    data["actions"] = actions
    return data


def run_release(
    release: str,
    timeout: float,
    pytest_args: list[str],
    modes: list[str],
    keys: Keys,
    fresh: bool = False,
) -> Row:
    """One row: the cells found under their keys, the others run now (and stored when ok)."""
    row = Row(release)
    start = time.monotonic()
    cells = [matrix_cache.BASE, *modes]
    found: dict[str, dict[str, Any]] = {}
    if not fresh:
        for cell in cells:
            for sources in (keys.sources, *keys.earlier):
                hit = matrix_cache.load(release, cell, keys.of(release, cell, sources))
                if hit and hit.get("ok"):
                    found[cell] = {**hit, "sources": sources}
                    break
    missing = [c for c in cells if c not in found]
    details = [f"cached: {', '.join(found)}"] if found else []
    try:
        if missing:
            ran, detail = _run_cells(release, missing, timeout, pytest_args)
            details.append(detail)
            # Sources changed while the process ran: its result has no key that fits.
            unchanged = matrix_cache.sources_digest(keys.root) == keys.sources
            for cell, data in ran.items():
                if data["ok"] and unchanged:
                    matrix_cache.store(release, cell, keys.of(release, cell), data)
            if ran and not unchanged:
                details.append("sources changed during the run: cells not stored")
            found.update(ran)
        row.cells_run, row.cells_reused = len(missing), len(cells) - len(missing)
        done = [found[c] for c in cells if c in found]
        row.stored = sorted(str(c["stored"]) for c in done if "stored" in c)
        row.earlier = sum(c.get("sources", keys.sources) != keys.sources for c in done)
        for part in done:
            row.passed += part["tests"]["passed"]
            row.failed += part["tests"]["failed"]
            row.skipped += part["tests"]["skipped"]
            for nodeid in part["tests"]["failures"]:
                details.append(f"FAILED {nodeid}")
        row.test_seconds = sum(c["seconds"] for c in done)
        ok = len(done) == len(cells) and all(c["ok"] for c in done)
        row.result = "pass" if ok and row.passed else "FAIL"
        if done:
            row.probe = merge({c: found[c] for c in cells if c in found})
            _describe(row, row.probe)
    except Exception as exc:  # a broken release must not stop the matrix
        row.result = "FAIL"
        details.append(f"{type(exc).__name__}: {exc}")
    row.detail = "\n".join(details)
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
    parser.add_argument(
        "--fresh", action="store_true", help="run every cell, ignoring cached results"
    )
    parser.add_argument(
        "--stop-after",
        type=float,
        metavar="SECONDS",
        help="start no release after SECONDS (finished cells stay cached; run again to resume)",
    )
    parser.add_argument(
        "--reuse-sources",
        action="append",
        default=[],
        metavar="DIGEST",
        help="also reuse finished cells of these earlier source digests (the 'sources' line of "
        "a run), to finish a regeneration after small commits; the table says how many; not "
        "with --ci",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print pytest tails")
    args = parser.parse_args(argv)
    if args.ci and args.reuse_sources:
        parser.error("--ci runs every cell of these sources: no --reuse-sources")
    if args.modes:
        os.environ[MODES_ENV] = args.modes  # every release runs these

    chosen = (
        args.releases
        or (list(CI_MODES) if args.ci else None)
        or (list(releases.ALL_RELEASES) if args.all else default_releases())
    )
    modes = {r: modes_for(r, args.ci) for r in chosen}
    pytest_args = args.pytest_args.split()
    keys = dataclasses.replace(Keys.now(pytest_args), earlier=tuple(args.reuse_sources))
    print(f"sources {keys.sources}")  # what --reuse-sources names
    started = time.monotonic()
    # Download and extract first, one at a time (pip and the disk do not parallelise).
    for release in chosen:
        try:
            releases.pythonpath_for(release)
        except Exception as exc:
            print(f"{release}: cannot prepare overlay: {exc}", file=sys.stderr)
    print(f"{'release':8} {'family':6} {'result':6} {'time':>6}  stock | plugin | does")

    def one(release: str) -> Row:
        if args.stop_after is not None and time.monotonic() - started > args.stop_after:
            return Row(release, result="not run", detail=f"--stop-after {args.stop_after:.0f}")
        return run_release(release, args.timeout, pytest_args, modes[release], keys, args.fresh)

    rows: list[Row] = []
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for row in pool.map(one, chosen):
            rows.append(row)
            reused = f", {row.cells_reused} cached" if row.cells_reused else ""
            if "cells not stored" in row.detail:
                reused += "; sources changed while it ran, cells not stored"
            print(
                f"{row.release:8} {row.family:6} {row.result:6} {row.seconds:5.0f}s  "
                f"({row.cells_run} cells run{reused}) "
                f"{row.stock} | {row.plugin} | {row.does}",
                flush=True,
            )
            for mode, cell in row.modes.items():
                print(f"    {mode:10} {cell}", flush=True)
            if args.verbose or row.result != "pass":
                print("    " + row.detail.replace("\n", "\n    "), flush=True)
    total = time.monotonic() - started
    note = table_note(argv if argv is not None else sys.argv[1:], rows, total)
    table = markdown(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(f"{note}\n\n{table}")
    args.out.with_suffix(".json").write_text(
        json.dumps([asdict(r) for r in rows], indent=1, default=str)
    )
    unfinished = [r.release for r in rows if r.result == "not run"]
    if args.readme and unfinished:
        print(f"{args.readme} not refreshed: {len(unfinished)} releases not run ({unfinished})")
    elif args.readme:
        update_readme(args.readme, table, note)
    print(f"\n{len(rows)} releases in {total:.0f} s; table written to {args.out}")
    passed = sum(r.result == "pass" for r in rows)
    print(f"matrix: {passed} passed, {len(rows) - passed} failed")  # CI reads this closing line
    return 0 if passed == len(rows) else 1


def table_note(argv: list[str], rows: list[Row], total: float) -> str:
    """The line above the table: command, package version, date, and where the cells came from.

    tests/test_docs.py reads the version and the date from it."""
    import vllm_mamba_fix

    run = sum(r.cells_run for r in rows)
    reused = sum(r.cells_reused for r in rows)
    stored = sorted(s[:10] for r in rows for s in r.stored)
    earlier = sum(r.earlier for r in rows)
    tests = sum(r.test_seconds for r in rows)
    where = f"{run} release/mode cells run now"
    if reused:
        span = stored[0] if stored[0] == stored[-1] else f"{stored[0]} to {stored[-1]}"
        same = reused - earlier
        where += f", {same} reused from runs of the same sources" if same else ""
        where += f", {earlier} from runs of earlier sources (--reuse-sources)" if earlier else ""
        where += f" (stored {span})"
    return (
        f"Generated by `python -m tools.matrix {' '.join(argv)}`".rstrip()
        + f" with vllm-mamba-fix {vllm_mamba_fix.__version__} on {time.strftime('%Y-%m-%d')}"
        + f" ({len(rows)} releases; {where}; {tests:.0f} s of pytest, {total:.0f} s wall)."
    )


if __name__ == "__main__":
    raise SystemExit(main())
