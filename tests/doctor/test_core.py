"""Doctor's whole run (doctor/core.py) on the installed vLLM: the default run is protected
and its JSON has every section's fields."""

from __future__ import annotations

from tests.doctor.conftest import _VLLM, PACKAGE_DIR, Run, _needed_by_version, needs_affected_vllm
from vllm_mamba_fix.facts.versions import family_for


@needs_affected_vllm
def test_default_is_protected_and_json_has_the_fields(real: dict[str, Run]) -> None:
    run = real["json"]
    assert run.code == 0, run.err
    data = run.json()
    assert data["status"] == "protected"
    assert data["exit_code"] == 0
    assert data["vllm"]["version"] == _VLLM
    assert data["family"]["name"] == family_for(_VLLM).name
    assert data["family"]["verdict"] == "patch"
    policy = data["policy"]
    assert (policy["verdict"], policy["needed"], policy["should_patch"]) == (
        "needed-will-patch",
        True,
        True,
    )
    assert policy["needed_rules"] == _needed_by_version(_VLLM)
    assert (
        data["entry_point"]["found"] and data["entry_point"]["value"] == "vllm_mamba_fix:register"
    )
    assert data["vllm_plugins"] == {"value": None, "allows": True}
    assert data["settings"]["mode"] == "auto" and data["settings"]["problems"] == []
    assert data["settings"]["stall_seconds"] == 30.0
    assert data["problems"] == []
    assert isinstance(data["elapsed_seconds"], float)
    # The support checks, where their modules are in this build.
    if (PACKAGE_DIR / "rules" / "end_order.py").exists():
        assert data["stall_end"]["checked"] is True
        assert set(data["stall_end"]["classes"]) == {
            "vllm.v1.core.sched.scheduler.Scheduler",
            "vllm.v1.core.sched.async_scheduler.AsyncScheduler",
        }
    if (PACKAGE_DIR / "observe" / "metrics.py").exists():
        assert data["metrics"]["checked"] is True
        assert isinstance(data["metrics"]["available"], bool) and data["metrics"]["reason"]
