"""Importing vLLM and the scheduler classes (doctor/checks/vllm_import.py): an unreadable
version, vLLM not importable, a ``--scheduler-cls`` that does not load."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.doctor.conftest import _doctor, _fake_run, _fake_vllm, _run


def test_unreadable_version_with_force_is_protected(tmp_path: Path) -> None:
    site = _fake_vllm(tmp_path / "site", "not-a-version")
    run = _run(_doctor("--json"), {"PYTHONPATH": str(site), "VLLM_MAMBA_FIX": "force"})
    assert run.code == 0, run.err
    data = run.json()
    assert (data["status"], data["policy"]["verdict"]) == ("protected", "needed-will-patch")


def test_unreadable_version_cannot_tell(tmp_path: Path) -> None:
    run = _fake_run(tmp_path, "not-a-version")
    assert run.code == 3, run.err
    assert "result: CANNOT TELL" in run.out
    assert "cannot read the vLLM version" in run.out


def test_vllm_not_importable_cannot_tell(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('broken build\\nline 2')\n")
    run = _run(_doctor("--json"), {"PYTHONPATH": str(tmp_path)})
    assert run.code == 3, run.err
    data = run.json()
    assert data["status"] == "unknown"
    assert data["vllm"]["error"] == "ImportError: broken build"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--scheduler-cls", "no_such_module_xyz.Sched"), "cannot import 'no_such_module_xyz'"),
        (("--scheduler-cls", "vllm.v1.core.sched.scheduler.Nope"), "has no attribute 'Nope'"),
    ],
)
def test_unloadable_scheduler_cls_is_invalid_input(
    tmp_path: Path, args: tuple[str, ...], needle: str
) -> None:
    run = _fake_run(tmp_path, "0.27.1", *args)
    assert run.code == 2, run.err
    assert needle in run.out
    assert "result: INVALID INPUT" in run.out
    assert "Traceback" not in run.out + run.err
