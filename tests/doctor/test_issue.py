"""``vllm-mamba-fix doctor --report`` (doctor/render.py, issue 37 item 5): the block for a bug
report.

On the installed vLLM (0.27.1 here): the command line as users run it, with the default
settings and with a deployment that goes wrong in several ways at once; and doctor's
``run()`` inside a process that already built schedulers, where the two block sizes are
known. The expected values are read independently of the report (the interpreter, the
installed distributions, the machine) or are the settings the test sets.
"""

from __future__ import annotations

import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.doctor.conftest import (
    _VLLM,
    DFLASH,
    FENCED,
    REPO,
    Run,
    _body,
    _doctor,
    _run,
    needs_affected_vllm,
)
from vllm_mamba_fix._version import __version__
from vllm_mamba_fix.doctor import EXIT_CANNOT_TELL, EXIT_INVALID_INPUT, EXIT_NOT_PROTECTED, EXIT_OK
from vllm_mamba_fix.doctor.render import UNKNOWN_BLOCKS
from vllm_mamba_fix.facts.config import ALL_VARIABLES
from vllm_mamba_fix.rules.table import RULES

RULE_ROW = re.compile(r"^  (?P<rule>[a-z-]+) +(?P<state>runs|does not run) +(?P<why>.+)$", re.M)
SETTING_ROW = re.compile(r"^  (?P<name>VLLM_MAMBA_FIX\w*) +(?P<raw>.+?) -> (?P<rest>.+)$", re.M)


def _row(body: str, label: str) -> str:
    found = re.search(rf"^{re.escape(label)} +(.+)$", body, re.M)
    assert found is not None, (label, body)
    return found.group(1)


def _labels(body: str) -> set[str]:
    """The labels of the block's top-level rows (the column before the text)."""
    return {line[:17].strip() for line in body.splitlines() if line and not line.startswith(" ")}


def _rules(body: str) -> dict[str, tuple[str, str]]:
    return {m["rule"]: (m["state"], m["why"]) for m in RULE_ROW.finditer(body)}


def _settings(body: str) -> dict[str, tuple[str, str]]:
    return {m["name"]: (m["raw"], m["rest"]) for m in SETTING_ROW.finditer(body)}


# Everything that can go wrong at once: the plugin off, a VLLM_PLUGINS that leaves it out,
# an invalid scope, a misspelt variable, the watchdog off; and a drafter with its own KV group.
WRONG = {
    "VLLM_MAMBA_FIX": "0",
    "VLLM_PLUGINS": "lora_filesystem_resolver",
    "VLLM_MAMBA_FIX_SCOPE": "images-only",
    "VLLM_MAMBA_FIX_STALL_SECONDS": "off",
    "VLLM_MAMBA_FIX_STALL_SECOND": "5",
}


# Builds real schedulers first (the plugin loaded as vLLM loads it): the Mamba KV cache's
# block (256) above cache_config.block_size (128), as vLLM #54076 reports; then doctor's run()
# and the report in the same process, where the built schedulers' records hold both sizes.
_BUILT_THEN_REPORT = """\
import sys
from tools import sched_harness as harness
from tools.sched_harness import HarnessConfig
harness.load_plugins()
small = dict(block_size=256, max_num_batched_tokens=192, encoder_cache_tokens=256,
             max_model_len=1024)
harness.build_scheduler(HarnessConfig(configured_block_size=128, **small))
from vllm_mamba_fix.doctor import run
from vllm_mamba_fix.doctor.render import render_issue
report = run()
with open(sys.argv[1], "w") as out:
    out.write(render_issue(report.data))
"""


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The three real runs, started together (each is mostly vLLM's import); the built
    schedulers' run writes its report to a file, which becomes its ``out``."""
    built = tmp_path_factory.mktemp("doctor-report") / "report.md"
    jobs = {
        "default": (_doctor("--report"), {}),
        "wrong": (_doctor("--report", "--speculative-config", DFLASH), WRONG),
        "built": (
            [sys.executable, "-c", _BUILT_THEN_REPORT, str(built)],
            {"PYTHONPATH": str(REPO)},
        ),
    }
    with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        futures = {name: pool.submit(_run, cmd, env, REPO) for name, (cmd, env) in jobs.items()}
        runs = {name: future.result() for name, future in futures.items()}
    built_run = runs["built"]
    assert built_run.code == 0, built_run.err[-3000:]
    runs["built"] = Run(built_run.code, built.read_text(), built_run.err)
    return runs


@needs_affected_vllm
def test_the_default_report_names_versions_rules_blocks_and_settings(
    reports: dict[str, Run],
) -> None:
    run = reports["default"]
    assert run.code == EXIT_OK, run.err[-3000:]
    body = _body(run)
    assert _row(body, "vllm-mamba-fix").startswith(f"{__version__} at {REPO / 'vllm_mamba_fix'}")
    assert "entry point mamba_fix -> vllm_mamba_fix:register" in _row(body, "vllm-mamba-fix")
    assert _row(body, "doctor").startswith("PROTECTED (exit 0): vLLM ")
    assert _row(body, "vLLM").startswith(f"{_VLLM}") and "family " in _row(body, "vLLM")
    # What vLLM's collect_env reports (torch, Python, OS, CPU, GPU) is not repeated (issue 45).
    assert not {"torch", "python", "OS", "CPU", "GPU", "vLLM platform"} & _labels(body)
    rules = _rules(body)
    assert list(rules) == [spec.rule.value for spec in RULES]
    assert {state for state, _ in rules.values()} == {"runs"}
    assert rules["split"][1].startswith("needed; by code: ")
    assert _row(body, "block sizes") == UNKNOWN_BLOCKS
    settings = _settings(body)
    assert list(settings) == list(ALL_VARIABLES)
    assert {raw for raw, _ in settings.values()} == {"unset"}
    assert settings["VLLM_MAMBA_FIX"][1] == "auto"
    assert settings["VLLM_MAMBA_FIX_STALL_SECONDS"][1] == "stall watchdog after 30 s"
    assert _row(body, "VLLM_PLUGINS") == "unset: vLLM loads 'mamba_fix'"
    schedulers = body.split("scheduler classes", 1)[1]
    assert "  vllm.v1.core.sched.scheduler.Scheduler (vLLM default): runs " in schedulers
    assert "vllm.v1.core.sched.async_scheduler.AsyncScheduler (" in schedulers
    assert "\nproblems\n" not in body


@needs_affected_vllm
def test_a_wrong_deployment_is_flagged_and_keeps_doctors_exit_code(
    reports: dict[str, Run],
) -> None:
    run = reports["wrong"]
    assert run.code == EXIT_NOT_PROTECTED, run.err[-3000:]
    body = _body(run)
    assert _row(body, "doctor").startswith("NOT PROTECTED (exit 1): ")
    rules = _rules(body)
    assert {state for state, _ in rules.values()} == {"does not run"}
    assert "disabled by VLLM_MAMBA_FIX" in rules["split"][1]
    settings = _settings(body)
    assert settings["VLLM_MAMBA_FIX"] == ("'0'", "off")
    raw, rest = settings["VLLM_MAMBA_FIX_SCOPE"]
    assert (raw, rest.split("  INVALID: ")[0]) == ("'images-only'", "multimodal")
    assert "INVALID: VLLM_MAMBA_FIX_SCOPE='images-only' is not one of" in rest
    assert settings["VLLM_MAMBA_FIX_STALL_SECONDS"] == ("'off'", "stall watchdog off")
    assert settings["VLLM_MAMBA_FIX_STALL_SECOND"][1].startswith("UNKNOWN: ")
    assert "INVALID" not in settings["VLLM_MAMBA_FIX_BLOCK_RULE"][1]
    assert (
        _row(body, "VLLM_PLUGINS") == "'lora_filesystem_resolver': vLLM does NOT load 'mamba_fix'"
    )
    assert _row(body, "speculative") == "dflash: EAGLE-type"
    # A drafter with its own KV cache group: doctor foresees the two sizes apart.
    assert _row(body, "block sizes").startswith(f"{UNKNOWN_BLOCKS}; --speculative-config dflash")
    schedulers = body.split("scheduler classes", 1)[1]
    assert "  vllm.v1.core.sched.scheduler.Scheduler (vLLM default): would run if enabled: " in (
        schedulers
    )
    problems = body.split("\nproblems\n", 1)[1]
    assert "  - disabled by VLLM_MAMBA_FIX='0'" in problems


@needs_affected_vllm
def test_a_built_schedulers_block_sizes_are_reported(reports: dict[str, Run]) -> None:
    body = _body(reports["built"])
    blocks = body.split("\nblock sizes ", 1)[1].split("\n\n", 1)[0]
    assert "of the schedulers built in this process" in blocks
    assert (
        "  vllm.v1.core.sched.scheduler.Scheduler: Mamba KV cache 256, "
        "cache_config.block_size 128 (differ, block-unit engaged)"
    ) in blocks
    assert UNKNOWN_BLOCKS not in body


def test_without_vllm_the_report_still_renders_and_cannot_tell(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('broken build')\n")
    run = _run(_doctor("--report"), {"PYTHONPATH": str(tmp_path)})
    assert run.code == EXIT_CANNOT_TELL, run.err
    body = _body(run)
    assert _row(body, "vLLM") == "not importable (ImportError: broken build)"
    assert _row(body, "rules") == "not checked (vLLM is not importable)"
    assert list(_settings(body)) == list(ALL_VARIABLES)


def test_report_and_json_exclude_each_other() -> None:
    run = _run(_doctor("--report", "--json"))
    assert run.code == EXIT_INVALID_INPUT
    assert "not allowed with argument" in run.err


def test_the_fence_outlasts_backticks_in_the_report() -> None:
    from vllm_mamba_fix.doctor.render import render_issue

    data = {"status": "unknown", "summary": "a ```quoted``` value", "tool": {}}
    text = render_issue(data)
    found = FENCED.match(text)
    assert found is not None and found.group(1) == "````", text
