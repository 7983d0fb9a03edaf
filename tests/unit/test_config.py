from __future__ import annotations

import pytest

from vllm_mamba_fix.facts.config import Mode, Scope, load_settings, vllm_plugins_allows


@pytest.mark.parametrize(
    ("raw", "mode"),
    [
        (None, Mode.AUTO),
        ("", Mode.AUTO),
        ("auto", Mode.AUTO),
        ("1", Mode.AUTO),
        ("TRUE", Mode.AUTO),
        (" on ", Mode.AUTO),
        ("0", Mode.OFF),
        ("false", Mode.OFF),
        ("Off", Mode.OFF),
        ("force", Mode.FORCE),
    ],
)
def test_mode_values(raw: str | None, mode: Mode) -> None:
    env = {} if raw is None else {"VLLM_MAMBA_FIX": raw}
    settings = load_settings(env)
    assert settings.mode is mode
    assert settings.problems == ()


@pytest.mark.parametrize(("raw", "scope"), [("multimodal", Scope.MULTIMODAL), ("ALL", Scope.ALL)])
def test_scope_values(raw: str, scope: Scope) -> None:
    assert load_settings({"VLLM_MAMBA_FIX_SCOPE": raw}).scope is scope


def test_invalid_values_fall_back_with_one_problem_each() -> None:
    settings = load_settings({"VLLM_MAMBA_FIX": "yes please", "VLLM_MAMBA_FIX_SCOPE": "images"})
    assert settings.mode is Mode.AUTO
    assert settings.scope is Scope.MULTIMODAL
    mode_problem, scope_problem = settings.problems
    assert "VLLM_MAMBA_FIX='yes please'" in mode_problem and "force" in mode_problem
    assert "VLLM_MAMBA_FIX_SCOPE='images'" in scope_problem and "multimodal|all" in scope_problem


@pytest.mark.parametrize(
    ("raw", "allowed"),
    [
        (None, True),
        ("mamba_fix", True),
        ("other,mamba_fix", True),
        ("other", False),
        ("", False),  # vLLM: empty loads nothing
        ("other, mamba_fix", False),  # vLLM does not strip whitespace
    ],
)
def test_vllm_plugins_follows_vllms_rule(raw: str | None, allowed: bool) -> None:
    env = {} if raw is None else {"VLLM_PLUGINS": raw}
    assert vllm_plugins_allows(env) is allowed


@pytest.mark.parametrize(
    ("raw", "seconds", "problem"),
    [
        (None, 30.0, False),
        ("", 30.0, False),
        ("45", 45.0, False),
        ("0.5", 0.5, False),
        ("0", 0.0, False),
        ("OFF", None, False),
        ("-1", 30.0, True),
        ("soon", 30.0, True),
        ("nan", 30.0, True),
        ("inf", 30.0, True),
    ],
)
def test_stall_seconds(raw: str | None, seconds: float | None, problem: bool) -> None:
    env = {} if raw is None else {"VLLM_MAMBA_FIX_STALL_SECONDS": raw}
    settings = load_settings(env)
    assert settings.stall_seconds == seconds
    assert bool(settings.problems) == problem
    if problem:
        assert (
            "VLLM_MAMBA_FIX_STALL_SECONDS" in settings.problems[0]
            and "'off'" in settings.problems[0]
        )
