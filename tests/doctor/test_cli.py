"""The command line (doctor/cli.py): the console script's default, bad arguments."""

from __future__ import annotations

import re
import sys

import pytest

from tests.doctor.conftest import CONSOLE_SCRIPT, Run, _run, needs_affected_vllm


@needs_affected_vllm
def test_console_script_defaults_to_doctor_with_human_output(real: dict[str, Run]) -> None:
    if "script" not in real:
        pytest.skip(f"console script not installed at {CONSOLE_SCRIPT}")
    run = real["script"]
    assert run.code == 0, run.err
    assert "needed, will patch" in run.out
    assert "result: PROTECTED" in run.out
    assert "wrappers verified; undone" in run.out
    assert re.search(r"^  split +runs +needed; by code: ", run.out, re.M), run.out
    assert "speculative       set by the engine at start (not given to doctor)" in run.out
    assert "stall watchdog after 30 s" in run.out
    assert "Traceback" not in run.out + run.err
    assert "Triton" not in run.out  # vLLM's own log lines go to stderr


@pytest.mark.parametrize(
    "args",
    [
        ("doctor", "--scheduler-cls", "not a path"),
        ("--bogus",),
        ("frobnicate",),
        ("doctor", "--speculative-config", "{method: mtp}"),
        ("doctor", "--speculative-config", '["mtp"]'),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(args: tuple[str, ...]) -> None:
    run = _run([sys.executable, "-m", "vllm_mamba_fix", *args])
    assert run.code == 2
    assert run.out == ""
    assert "Traceback" not in run.err
    assert run.err.strip().splitlines()[-1].startswith("vllm-mamba-fix")
