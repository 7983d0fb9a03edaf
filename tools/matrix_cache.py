"""Per-cell result cache of the release matrix (tools/matrix.py), and its pytest plugin.

A cell is one release in one harness mode, or the release's `base` cell: the tests
that take no mode and the probe's mode-free parts (speculative stall, videos). A
finished cell is stored under a key that hashes everything that decides its result:
the package, tools/, the two suites and their conftest, pyproject.toml, the installed
distributions, the Python version, the release, the cell, the hypothesis profile and
the pytest arguments. A change to any of these gives a new key, so a stale result is
never found; a fresh clone has no cache and runs every cell.

Layout: ``$VLLM_MAMBA_FIX_CACHE/matrix/<release>/<cell>-<key>.json`` (default
``~/.cache/vllm-mamba-fix``, the overlays' cache root: tools/releases.py).

Inside the release's pytest (``-p tools.matrix_cache``), $VLLM_MAMBA_FIX_MATRIX_CELLS
keeps the items of the cells to run and $VLLM_MAMBA_FIX_MATRIX_OUTCOMES names the file
that gets each cell's test counts.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BASE = "base"  # the cell of the tests that take no `sched_mode`
CELLS_ENV = "VLLM_MAMBA_FIX_MATRIX_CELLS"
OUTCOMES_ENV = "VLLM_MAMBA_FIX_MATRIX_OUTCOMES"
# What the subprocess runs: a change to any file under these changes every key.
KEY_SOURCES: tuple[str, ...] = (
    "vllm_mamba_fix", "tools", "tests/scheduler", "tests/properties", "tests/conftest.py",
    "tests/stall_end_helpers.py",
    "pyproject.toml",
)  # fmt: skip
# The environment that decides the hypothesis profile and its size.
PROFILE_ENVS: tuple[str, ...] = ("HYPOTHESIS_PROFILE", "VLLM_MAMBA_FIX_PROPERTY_EXAMPLES")
_SKIP_PARTS = frozenset({"__pycache__", ".hypothesis", ".pytest_cache", ".ruff_cache"})


def cache_root() -> Path:
    env = os.environ.get("VLLM_MAMBA_FIX_CACHE")
    root = Path(env) if env else Path.home() / ".cache" / "vllm-mamba-fix"
    return root.expanduser() / "matrix"


def _files(root: Path, rel: str) -> list[Path]:
    path = root / rel
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []
    return sorted(
        p
        for p in path.rglob("*")
        if p.is_file() and not _SKIP_PARTS.intersection(p.parts) and p.suffix not in (".pyc",)
    )


def sources_digest(root: Path = REPO, sources: Iterable[str] = KEY_SOURCES) -> str:
    """Hash of every file under ``sources`` (path and bytes), in a fixed order."""
    digest = hashlib.sha256()
    for rel in sources:
        digest.update(f"[{rel}]".encode())
        for path in _files(root, rel):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def environment_digest() -> str:
    """Hash of the Python version and every installed distribution's version."""
    dists = sorted(
        f"{d.metadata['Name']}=={d.version}".lower()
        for d in importlib.metadata.distributions()
        if d.metadata["Name"]
    )
    return hashlib.sha256("\n".join([sys.version, *dists]).encode()).hexdigest()


def cell_key(
    release: str, cell: str, sources: str, environment: str, settings: dict[str, str]
) -> str:
    """The key of one cell: everything above, and the profile settings and pytest args."""
    text = json.dumps([release, cell, sources, environment, sorted(settings.items())])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _path(release: str, cell: str, key: str) -> Path:
    return cache_root() / release / f"{cell.replace('+', '_')}-{key}.json"


def load(release: str, cell: str, key: str) -> dict[str, Any] | None:
    """The stored cell with this key, or None (absent or unreadable)."""
    try:
        data = json.loads(_path(release, cell, key).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None


def store(release: str, cell: str, key: str, data: dict[str, Any]) -> Path:
    path = _path(release, cell, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**data, "key": key, "release": release, "cell": cell,
              "stored": time.strftime("%Y-%m-%d %H:%M:%S")}  # fmt: skip
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)  # a run killed here leaves no half-written cell
    return path


# --------------------------------------------------------------------------
# pytest plugin (loaded in the release's subprocess with `-p tools.matrix_cache`)


def cell_of(item: Any) -> str:
    """The harness mode an item runs in, or BASE when it takes none."""
    callspec = getattr(item, "callspec", None)
    mode = callspec.params.get("sched_mode") if callspec is not None else None
    return BASE if mode is None else str(mode)


_cells_of: dict[str, str] = {}
_outcomes: dict[str, str] = {}


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    wanted = {c for c in os.environ.get(CELLS_ENV, "").split(",") if c}
    if not wanted:
        return
    keep = [item for item in items if cell_of(item) in wanted]
    dropped = [item for item in items if cell_of(item) not in wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_collection_finish(session: Any) -> None:
    _cells_of.update({item.nodeid: cell_of(item) for item in session.items})


def pytest_runtest_logreport(report: Any) -> None:
    # junit's rule: a failure or error in any phase fails the test; else a skip skips it.
    before = _outcomes.get(report.nodeid)
    if report.failed:
        _outcomes[report.nodeid] = "failed"
    elif report.skipped and before != "failed":
        _outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed and before is None:
        _outcomes[report.nodeid] = "passed"


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    target = os.environ.get(OUTCOMES_ENV)
    if not target:
        return
    cells: dict[str, dict[str, Any]] = {}
    for nodeid, cell in _cells_of.items():
        counts = cells.setdefault(cell, {"passed": 0, "failed": 0, "skipped": 0, "failures": []})
        outcome = _outcomes.get(nodeid, "failed")  # collected but never reported: an error
        counts[outcome] += 1
        if outcome == "failed":
            counts["failures"].append(nodeid)
    Path(target).write_text(json.dumps(cells, indent=1))
