"""The entry point (doctor/checks/delivery.py): without it vLLM never loads the plugin."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.doctor.conftest import PACKAGE_DIR, _fake_vllm, _run


def test_entry_point_missing_is_not_protected(tmp_path: Path) -> None:
    # -S: no site-packages, so no installed metadata; link in only what the doctor imports.
    site = _fake_vllm(tmp_path / "site", "0.27.1")
    import packaging
    import pluggy

    for module in (packaging, pluggy):
        (site / module.__name__).symlink_to(Path(module.__file__).parent)
    (site / "vllm_mamba_fix").symlink_to(PACKAGE_DIR)
    cmd = [sys.executable, "-S", "-m", "vllm_mamba_fix", "doctor", "--json"]
    run = _run(cmd, {"PYTHONPATH": str(site)}, cwd=tmp_path)
    assert run.code == 1, run.err
    data = run.json()
    assert not data["entry_point"]["found"]
    assert any(
        "no vllm.general_plugins entry point named 'mamba_fix'" in p for p in data["problems"]
    )
