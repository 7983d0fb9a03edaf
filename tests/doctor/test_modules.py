"""The doctor package's shape: small modules, the
environment read only through the config, ``plan()`` called only for the version column."""

from __future__ import annotations

from tests.doctor.conftest import PACKAGE_DIR


def test_doctor_modules_stay_small() -> None:
    sizes = {
        str(path.relative_to(PACKAGE_DIR / "doctor")): len(path.read_text().splitlines())
        for path in (PACKAGE_DIR / "doctor").rglob("*.py")
    }
    assert {"cli.py", "verdict.py", "render.py", "checks/schedulers.py"} <= set(sizes)
    assert not (PACKAGE_DIR / "doctor.py").exists()
    assert max(sizes.values()) < 400, sizes


def _lines(folder: str) -> int:
    return sum(len(p.read_text().splitlines()) for p in (PACKAGE_DIR / folder).rglob("*.py"))


def test_doctor_is_smaller_than_the_rules_it_reports_on() -> None:
    """Issue 45 item 2: the verdict reads the install records (the plan views are gone) and
    the text report is rendered from the JSON, so doctor ends up smaller than rules/."""
    assert not (PACKAGE_DIR / "doctor" / "plans.py").exists()
    assert _lines("doctor") < _lines("rules"), (_lines("doctor"), _lines("rules"))


def test_doctor_reads_the_records_and_plans_only_the_version_column() -> None:
    """The environment only through config; plan() called only by doctor/core.py, for what
    the release data alone says (the records hold every other view)."""
    import ast

    offenders = []
    for path in sorted((PACKAGE_DIR / "doctor").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            name = str(path.relative_to(PACKAGE_DIR))
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                offenders.append(f"{name}:{node.lineno} reads the environment")
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "vllm_mamba_fix.rules.table"
                and any(alias.name == "plan" for alias in node.names)
                and path.name != "core.py"
            ):
                offenders.append(f"{name}:{node.lineno} plans again")
    assert offenders == []
