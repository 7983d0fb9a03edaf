"""The doctor package's shape: small modules, the environment read only through the config,
``plan()`` called only in doctor/plans.py."""

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


def test_doctor_reads_the_tables_and_plans_only_in_plans() -> None:
    """The environment only through config; plan() called only by doctor/plans.py."""
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
                and path.name != "plans.py"
            ):
                offenders.append(f"{name}:{node.lineno} plans again")
    assert offenders == []
