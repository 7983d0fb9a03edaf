"""Packaging: one version, complete metadata, and what the wheel and the sdist carry.

The installed-wheel check (vLLM loads the plugin from a non-editable install and it patches)
needs its own venv: ``tools/artefacts.sh``, a step of ``tools/test.sh``.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import vllm_mamba_fix
from tools import artefacts

ROOT = Path(__file__).resolve().parents[1]
HOME = "https://github.com/vllm-mamba-fix/vllm-mamba-fix"

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_has_one_source() -> None:
    project = _pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    attr = _pyproject()["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "vllm_mamba_fix._version.__version__"
    assert artefacts.source_version() == vllm_mamba_fix.__version__
    installed = importlib.metadata.version("vllm-mamba-fix")
    assert installed == vllm_mamba_fix.__version__, (
        f"installed metadata says {installed}, the package {vllm_mamba_fix.__version__}: "
        "reinstall (pip install -e .) after changing the version"
    )


def test_metadata() -> None:
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    classifiers = set(project["classifiers"])
    for minor in (10, 11, 12, 13):
        assert f"Programming Language :: Python :: 3.{minor}" in classifiers
    assert {"Typing :: Typed", "Operating System :: POSIX :: Linux"} <= classifiers
    assert not any(c.startswith("License ::") for c in classifiers)  # PEP 639: the expression
    assert project["requires-python"] == ">=3.10"
    urls = project["urls"]
    assert urls["Homepage"] == urls["Source"] == HOME
    assert all(url.startswith(HOME) for url in urls.values()), urls
    assert {"build", "twine"} <= {
        req.split(">")[0].split("=")[0] for req in project["optional-dependencies"]["test"]
    }


def test_license_and_marker_files() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert (ROOT / "vllm_mamba_fix" / "py.typed").is_file()
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]
    assert "py.typed" in package_data["vllm_mamba_fix"]


def test_package_discovery_finds_every_folder_of_the_package() -> None:
    """pyproject's setuptools discovery takes every subpackage (each layer is a folder)."""
    setuptools = pytest.importorskip("setuptools")
    find = _pyproject()["tool"]["setuptools"]["packages"]["find"]
    found = set(setuptools.find_packages(str(ROOT), include=find["include"]))
    folders = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "vllm_mamba_fix").rglob("__init__.py")
    }
    assert {"vllm_mamba_fix.rules", "vllm_mamba_fix.doctor.checks"} <= folders
    assert found == folders
    # A folder of modules without __init__.py would be left out of the wheel.
    loose = sorted(
        path.parent.relative_to(ROOT).as_posix()
        for path in (ROOT / "vllm_mamba_fix").rglob("*.py")
        if not (path.parent / "__init__.py").is_file()
    )
    assert not loose, loose


@pytest.fixture(scope="module")
def dist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdist, then the wheel built from it, with the project venv's setuptools (no download)."""
    pytest.importorskip("build", reason="the test extras bring `build`")
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_built_wheel_and_sdist_carry_what_they_should(
    dist_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checks = artefacts.contents(dist_dir)
    assert checks.failures == [], capsys.readouterr().out


def test_twine_check_passes(dist_dir: Path) -> None:
    pytest.importorskip("twine", reason="the test extras bring `twine`")
    files = sorted(str(p) for p in dist_dir.iterdir())
    proc = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *files],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_contents_check_catches_a_wheel_without_license_or_entry_point(
    dist_dir: Path, tmp_path: Path
) -> None:
    """The checker itself: strip LICENSE, the entry point and a module of a subpackage from a
    copy of the wheel."""
    (wheel,) = dist_dir.glob("*.whl")
    broken = tmp_path / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(broken, "w") as dst:
        for item in src.infolist():
            if item.filename.endswith("licenses/LICENSE") or item.filename.endswith("/table.py"):
                continue
            data = src.read(item)
            if item.filename.endswith("entry_points.txt"):
                data = data.replace(b"mamba_fix = ", b"other_plugin = ")
            dst.writestr(item, data)
    checks = artefacts.Checks()
    artefacts.check_wheel(broken, checks, vllm_mamba_fix.__version__)
    assert any("LICENSE" in f for f in checks.failures), checks.failures
    assert any("entry point" in f for f in checks.failures), checks.failures
    assert any("vllm_mamba_fix/rules/table.py" in f for f in checks.failures), checks.failures


def test_contents_check_catches_an_incomplete_sdist(dist_dir: Path, tmp_path: Path) -> None:
    if shutil.which("git") is None or artefacts.tracked_files(ROOT) is None:
        pytest.skip("needs a git checkout")
    import tarfile

    (sdist,) = dist_dir.glob("*.tar.gz")
    partial = tmp_path / sdist.name
    with tarfile.open(sdist) as src, tarfile.open(partial, "w:gz") as dst:
        for member in src.getmembers():
            if "/tests/unit/" in member.name:
                continue
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    checks = artefacts.Checks()
    artefacts.check_sdist(partial, checks, ROOT)
    assert any("tests/unit/" in f for f in checks.failures), checks.failures
