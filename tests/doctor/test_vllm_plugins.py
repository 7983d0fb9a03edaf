"""``VLLM_PLUGINS`` (doctor/checks/delivery.py): a list without the plugin is not
protected."""

from __future__ import annotations

from tests.doctor.conftest import Run, needs_affected_vllm


@needs_affected_vllm
def test_vllm_plugins_without_us_is_not_protected(real: dict[str, Run]) -> None:
    run = real["plugins"]
    assert run.code == 1, run.err
    assert "result: NOT PROTECTED" in run.out
    assert "does not list 'mamba_fix'" in run.out
    assert "vLLM does not strip spaces" in run.out  # " mamba_fix" is not "mamba_fix"
    # The same run passed an MTP --speculative-config.
    assert "mtp: EAGLE-type ('qwen3_5_mtp' is an MTP model type" in run.out
