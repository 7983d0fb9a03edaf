"""CI's matrix subset (tools.releases.CI_MODES, what `python -m tools.matrix --ci` runs): one
release per family, modes that exist."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tools import releases
from tools.matrix import CI_MODES, default_releases
from tools.sched_harness import MODES_BY_NAME
from vllm_mamba_fix.facts.versions import family_for


def test_one_release_per_family_and_every_family() -> None:
    families = [family_for(release).name for release in CI_MODES]
    assert len(families) == len(set(families)), families
    assert set(families) == {family_for(r).name for r in releases.ALL_RELEASES}


def test_ci_releases_are_published_and_modes_known() -> None:
    for release, modes in CI_MODES.items():
        assert release in releases.ALL_RELEASES
        names = list(MODES_BY_NAME) if modes == "all" else modes.split(",")
        assert names and all(name in MODES_BY_NAME for name in names), (release, modes)


def test_every_mode_on_the_last_affected_release_only() -> None:
    assert CI_MODES["0.27.1"] == "all"
    assert [r for r, modes in CI_MODES.items() if modes == "all"] == ["0.27.1"]


def test_the_newest_release_represents_the_newest_family() -> None:
    from packaging.version import Version

    newest = max(releases.ALL_RELEASES, key=Version)
    assert newest in CI_MODES


def test_exhaustive_run_covers_twenty_one_releases_and_every_ci_family() -> None:
    chosen = default_releases()
    assert len(chosen) == 21
    assert {family_for(r).name for r in chosen} == {family_for(r).name for r in CI_MODES}


# --------------------------------------------------------------------------
# The per-cell cache (tools/matrix_cache.py) that makes the full run resumable.


def test_all_modes_are_the_harness_modes() -> None:
    from tools.matrix import ALL_MODES

    assert list(ALL_MODES) == list(MODES_BY_NAME)


def test_the_key_covers_what_the_release_subprocess_runs() -> None:
    from tools import matrix_cache

    # The subprocess runs these suites with the package and tools on PYTHONPATH.
    for source in ("vllm_mamba_fix", "tools", "tests/scheduler", "tests/properties"):
        assert source in matrix_cache.KEY_SOURCES
        assert (matrix_cache.REPO / source).is_dir(), source
    assert "tests/conftest.py" in matrix_cache.KEY_SOURCES  # it parametrizes sched_mode
    assert "HYPOTHESIS_PROFILE" in matrix_cache.PROFILE_ENVS


def _tree(root: Path) -> None:
    for rel in (
        "vllm_mamba_fix/rules/table.py",
        "tools/sched_harness.py",
        "tests/scheduler/t.py",
        "tests/properties/t.py",
        "tests/conftest.py",
        "pyproject.toml",
        "docs/x.md",
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"# {rel}\n")  # fmt: skip


def _key(root: Path, release: str = "0.27.1", cell: str = "sync", **settings: str) -> str:
    from tools import matrix_cache

    return matrix_cache.cell_key(release, cell, matrix_cache.sources_digest(root), "env", settings)


@pytest.mark.parametrize(
    "changed",
    ["vllm_mamba_fix/rules/table.py", "tools/sched_harness.py", "tests/scheduler/t.py",
     "tests/properties/t.py", "tests/conftest.py", "pyproject.toml",
     "vllm_mamba_fix/new_module.py"],
)  # fmt: skip
def test_a_changed_source_file_invalidates_the_cell(tmp_path: Path, changed: str) -> None:
    _tree(tmp_path)
    before = _key(tmp_path)
    assert _key(tmp_path) == before  # the same sources give the same key
    (tmp_path / changed).write_text("# changed\n")
    assert _key(tmp_path) != before


def test_files_outside_the_sources_and_bytecode_leave_the_key(tmp_path: Path) -> None:
    _tree(tmp_path)
    before = _key(tmp_path)
    (tmp_path / "docs/x.md").write_text("# edited docs\n")
    (tmp_path / "tools/__pycache__").mkdir()
    (tmp_path / "tools/__pycache__/sched_harness.cpython-311.pyc").write_bytes(b"\0")
    assert _key(tmp_path) == before


def test_release_cell_and_profile_are_in_the_key(tmp_path: Path) -> None:
    _tree(tmp_path)
    base = _key(tmp_path)
    assert _key(tmp_path, release="0.26.0") != base
    assert _key(tmp_path, cell="async") != base
    assert _key(tmp_path, HYPOTHESIS_PROFILE="long") != base


def test_settings_name_the_hypothesis_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    from tools.matrix import run_settings

    monkeypatch.delenv("HYPOTHESIS_PROFILE", raising=False)
    ci = run_settings([])
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "long")
    assert run_settings([]) != ci
    assert run_settings(["-x"]) != run_settings([])


# A stand-in for the release's pytest process: the cells it would write, as
# tools.matrix._run_cells returns them. What is tested is run_release's reuse.
def _probe(cell: str) -> dict[str, Any]:
    common = {"version": "0.27.1", "family": "0.27", "architecture": "Qwen3_5",
              "default_active": True, "default_methods": ["split"],
              "default_rules": ["split"]}  # fmt: skip
    if cell == "base":
        return {**common, "base": {"speculative_stall": None, "videos": None}}
    result = {"completed": True, "stall_at": {}, "violations": 0, "steps": 5}
    stalled = {"completed": False, "stall_at": {"r": 11616}, "violations": 0, "steps": 30}
    mode = {"unsupported": None, "skipped": {}, "block_size": 1056, "stock": {"s": stalled},
            "patched": {"s": result}, "actions": {"collapses_prevented": 1}}  # fmt: skip
    return {**common, cell: mode}


class FakeRuns:
    def __init__(self, ok: bool = True) -> None:
        self.calls: list[list[str]] = []
        self.ok = ok

    def __call__(self, release: str, cells: list[str], timeout: float, args: list[str]) -> Any:
        self.calls.append(list(cells))
        tests = {"passed": 2, "failed": 0 if self.ok else 1, "skipped": 0,
                 "failures": [] if self.ok else ["t::x"]}  # fmt: skip
        ran = {
            c: {"tests": tests, "probe": _probe(c), "ok": self.ok, "seconds": 1.0} for c in cells
        }
        return ran, "ran"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VLLM_MAMBA_FIX_CACHE", str(tmp_path / "cache"))
    _tree(tmp_path / "src")
    return tmp_path / "src"


def _keys(root: Path) -> Any:
    from tools import matrix_cache
    from tools.matrix import Keys

    return Keys(matrix_cache.sources_digest(root), "env", {"p": "ci"}, root)


def test_a_rerun_reuses_finished_cells_and_runs_only_the_missing(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tools import matrix

    runs = FakeRuns()
    monkeypatch.setattr(matrix, "_run_cells", runs)
    first = matrix.run_release("0.27.1", 60, [], ["sync"], _keys(cache))
    assert runs.calls == [["base", "sync"]] and first.result == "pass"
    again = matrix.run_release("0.27.1", 60, [], ["sync", "async"], _keys(cache))
    assert runs.calls[1:] == [["async"]]  # base and sync came from the cache
    assert (again.cells_run, again.cells_reused) == (1, 2) and again.result == "pass"
    assert again.passed == 6 and again.does == "patches (split): 2 collapses prevented"
    matrix.run_release("0.27.1", 60, [], ["sync", "async"], _keys(cache))
    assert len(runs.calls) == 2  # nothing left to run
    matrix.run_release("0.27.1", 60, [], ["sync"], _keys(cache), fresh=True)
    assert runs.calls[2:] == [["base", "sync"]]  # --fresh ignores the cache


def test_a_changed_source_file_reruns_every_cell(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tools import matrix

    runs = FakeRuns()
    monkeypatch.setattr(matrix, "_run_cells", runs)
    matrix.run_release("0.27.1", 60, [], ["sync"], _keys(cache))
    (cache / "vllm_mamba_fix/rules/table.py").write_text("# a new rule\n")
    row = matrix.run_release("0.27.1", 60, [], ["sync"], _keys(cache))
    assert runs.calls == [["base", "sync"], ["base", "sync"]] and row.cells_reused == 0


def test_failed_cells_and_cells_of_changed_sources_are_not_stored(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tools import matrix

    failing = FakeRuns(ok=False)
    monkeypatch.setattr(matrix, "_run_cells", failing)
    row = matrix.run_release("0.27.1", 60, [], ["sync"], _keys(cache))
    assert row.result == "FAIL" and "FAILED t::x" in row.detail
    keys = _keys(cache)

    class EditDuringRun(FakeRuns):
        def __call__(self, *args: Any) -> Any:
            (cache / "tools/sched_harness.py").write_text("# edited while it ran\n")
            return super().__call__(*args)

    edits = EditDuringRun()
    monkeypatch.setattr(matrix, "_run_cells", edits)
    row = matrix.run_release("0.27.1", 60, [], ["sync"], keys)
    assert "cells not stored" in row.detail
    runs = FakeRuns()
    monkeypatch.setattr(matrix, "_run_cells", runs)
    matrix.run_release("0.27.1", 60, [], ["sync"], keys)
    assert runs.calls == [["base", "sync"]]  # neither run left a cell under this key


def test_reuse_sources_finishes_a_regeneration_after_a_commit(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    from tools import matrix

    runs = FakeRuns()
    monkeypatch.setattr(matrix, "_run_cells", runs)
    old = _keys(cache)
    matrix.run_release("0.27.1", 60, [], ["sync"], old)
    (cache / "vllm_mamba_fix/rules/table.py").write_text("# a small later commit\n")
    new = dataclasses.replace(_keys(cache), earlier=(old.sources,))
    row = matrix.run_release("0.27.1", 60, [], ["sync", "async"], new)
    assert runs.calls == [["base", "sync"], ["async"]]  # only the unfinished cell runs
    assert (row.cells_reused, row.earlier) == (2, 2)
    note = matrix.table_note(["--reuse-sources", old.sources], [row], 1.0)
    assert "2 from runs of earlier sources (--reuse-sources)" in note
    with pytest.raises(SystemExit):
        matrix.main(["--ci", "--reuse-sources", old.sources])
