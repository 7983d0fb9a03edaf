"""The two support checks (in doctor/checks/vllm_import.py): they read
the release and never change the verdict; without their modules each is one info line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.doctor.conftest import PACKAGE_DIR, _fake_run, _fake_vllm, _run

# The two support checks read other modules; without them (an ImportError) each is one
# info line and the verdict stands.
_WITHOUT_SUPPORT_MODULES = """\
import sys
from vllm_mamba_fix.doctor.checks import vllm_import
# As a build without the two modules: importing them raises ImportError.
vllm_import.METRICS_MODULE = "vllm_mamba_fix.no_such_metrics"
vllm_import.STALL_END_MODULE = "vllm_mamba_fix.no_such_stall_end"
from vllm_mamba_fix.doctor import main
raise SystemExit(main(["doctor", *sys.argv[1:]]))
"""


def test_support_checks_without_their_modules_are_info_lines(tmp_path: Path) -> None:
    site = _fake_vllm(tmp_path / "site", "0.27.1")
    env = {"PYTHONPATH": str(site)}
    data = _run([sys.executable, "-c", _WITHOUT_SUPPORT_MODULES, "--json"], env).json()
    assert (data["status"], data["exit_code"]) == ("protected", 0)
    assert data["metrics"]["checked"] is False and data["stall_end"]["checked"] is False
    human = _run([sys.executable, "-c", _WITHOUT_SUPPORT_MODULES], env).out
    assert "metrics           not checked: this build has no metrics module" in human
    assert "ending stalls     not checked: this build has no stall_end module" in human


@pytest.mark.skipif(
    not (PACKAGE_DIR / "observe" / "metrics.py").exists()
    or not (PACKAGE_DIR / "rules" / "end_order.py").exists(),
    reason="needs vllm_mamba_fix.observe.metrics and vllm_mamba_fix.rules.end_order",
)
def test_support_checks_read_the_release(tmp_path: Path) -> None:
    # The fake release has neither vLLM's prometheus registry nor update_from_output.
    data = _fake_run(tmp_path, "0.27.1", "--json").json()
    assert data["status"] == "protected"  # support lines never change the verdict
    assert data["metrics"]["checked"] is True and data["metrics"]["available"] is False
    assert "get_prometheus_registry" in data["metrics"]["reason"]
    classes = data["stall_end"]["classes"]
    assert set(classes) == {
        "vllm.v1.core.sched.scheduler.Scheduler",
        "vllm.v1.core.sched.async_scheduler.AsyncScheduler",
    }
    assert all("update_from_output" in why for why in classes.values())
