"""The speculative set-up (doctor/checks/speculative.py): ``--speculative-config`` classified
as vLLM classifies it, a drafter with its own KV cache group, configs vLLM would reject."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.doctor.conftest import DFLASH, _doctor, _fake_vllm, _rules, _run
from vllm_mamba_fix.doctor import FALLBACK_METHODS, SpeculativeMethods, classify_speculative
from vllm_mamba_fix.doctor.checks.speculative import OWN_KV_GROUP_TEXT

RELEASE_METHODS = SpeculativeMethods(
    FALLBACK_METHODS.eagle,
    FALLBACK_METHODS.mtp_aliases,
    (
        "ngram",
        "medusa",
        "draft_model",
        "custom_class",
        "eagle",
        "eagle3",
        "mtp",
        "dflash",
        "dspark",
    ),
    "test",
)


@pytest.mark.parametrize(
    ("config", "method", "eagle"),
    [
        ({"method": "mtp", "num_speculative_tokens": 2}, "mtp", True),
        ({"method": "qwen3_5_mtp"}, "mtp", True),  # vLLM rewrites *_mtp model types to mtp
        ({"method": "eagle3", "model": "AngelSlim/Qwen3-8B_eagle3"}, "eagle3", True),
        ({"method": "dspark"}, "dspark", True),
        ({"method": "ngram", "prompt_lookup_max": 4}, "ngram", False),
        ({"method": "medusa", "model": "FasterDecoding/medusa-v1"}, "medusa", False),
        # No method: vLLM infers it from the draft model's name where it can ...
        ({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}, "eagle", True),
        ({"model": "[ngram]"}, "ngram", False),
        ({"model": "my_pkg.MyProposer"}, "custom_class", False),
        # ... and from its config (model_type *_mtp -> mtp) only when the engine starts.
        ({"model": "Qwen/Qwen3-0.6B"}, None, None),
    ],
)
def test_speculative_config_is_classified_like_vllm(
    config: dict[str, Any], method: str | None, eagle: bool | None
) -> None:
    found = classify_speculative(config, RELEASE_METHODS)
    assert (found["resolved_method"], found["eagle_type"], found["invalid"]) == (
        method,
        eagle,
        None,
    )


@pytest.mark.parametrize(
    ("config", "own_group"),
    [
        ({"method": "dflash", "model": "z-lab/Qwen3.5-35B-A3B-DFlash"}, True),
        ({"model": "z-lab/Qwen3-8B-DFlash-b16"}, True),  # inferred from the name, as vLLM does
        ({"method": "mtp", "num_speculative_tokens": 2}, False),
        ({"method": "eagle3", "model": "AngelSlim/Qwen3-8B_eagle3"}, False),
    ],
)
def test_a_drafter_with_its_own_kv_group_is_named(config: dict[str, Any], own_group: bool) -> None:
    assert classify_speculative(config, RELEASE_METHODS)["drafter_kv_group"] is own_group


@pytest.mark.parametrize(
    ("env", "code", "status", "line"),
    [
        ({}, 0, "protected", "result: PROTECTED"),
        (
            {"VLLM_MAMBA_FIX_BLOCK_RULE": "0"},
            1,
            "not-protected",
            "block-unit is switched off by VLLM_MAMBA_FIX_BLOCK_RULE=0",
        ),
    ],
)
def test_a_dflash_drafter_makes_the_sizes_differ_and_the_rule_engage(
    tmp_path: Path, env: dict[str, str], code: int, status: str, line: str
) -> None:
    site = _fake_vllm(tmp_path / "site", "0.33.0")
    env = {"PYTHONPATH": str(site), **env}
    data = _run(_doctor("--json", "--speculative-config", DFLASH), env).json()
    assert (data["exit_code"], data["status"]) == (code, status)
    block = _rules(data)["block-unit"]
    assert block["needed"] is True and "dflash" in block["foreseen"]
    assert "block-unit" in data["policy"]["needed_rules"]
    human = _run(_doctor("--speculative-config", DFLASH), env)
    assert human.code == code
    assert f"--speculative-config dflash: {OWN_KV_GROUP_TEXT}" in human.out
    assert line in human.out
    # MTP brings no KV cache group of its own: nothing is foreseen.
    mtp = _run(_doctor("--json", "--speculative-config", '{"method": "mtp"}'), env).json()
    assert _rules(mtp)["block-unit"]["foreseen"] is None


@pytest.mark.parametrize(
    ("config", "needle"),
    [({"num_speculative_tokens": 2}, "neither"), ({"method": "telepathy"}, "not one this vLLM")],
)
def test_speculative_config_vllm_would_reject_is_flagged(
    config: dict[str, Any], needle: str
) -> None:
    assert needle in classify_speculative(config, RELEASE_METHODS)["invalid"]
    # Without the release's own list, an unknown method is not judged.
    if "method" in config:
        assert classify_speculative(config, FALLBACK_METHODS)["invalid"] is None
