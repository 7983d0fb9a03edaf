"""Shared by the doctor's tests: ``vllm-mamba-fix doctor`` in real subprocesses.

Two kinds of run:
- against the real installed vLLM (an affected release): the ``real`` runs start once per
  session, in parallel, and tests in several files read each result;
- against a tiny fake ``vllm`` package on PYTHONPATH (well under a second each,
  :func:`_fake_vllm`), for cases the real install cannot show: other releases, a changed
  signature, a missing entry point, vLLM not importable.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tools.releases import installed_release
from vllm_mamba_fix.decide.policy import Rule
from vllm_mamba_fix.facts.config import ALL_VARIABLES, Settings
from vllm_mamba_fix.facts.evidence import Evidence
from vllm_mamba_fix.facts.versions import Verdict, family_for
from vllm_mamba_fix.rules.table import plan

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "vllm_mamba_fix"
CONSOLE_SCRIPT = Path(sys.executable).with_name("vllm-mamba-fix")
TIMEOUT = 600  # seconds; the real runs import vLLM and may share a busy machine
REPO = PACKAGE_DIR.parent
OUR_ENV = (*ALL_VARIABLES, "VLLM_PLUGINS", "PYTHONPATH")


@dataclass(frozen=True)
class Run:
    code: int
    out: str
    err: str

    def json(self) -> dict[str, Any]:
        return json.loads(self.out)  # stdout must hold nothing but the report


def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> Run:
    full_env = {k: v for k, v in os.environ.items() if k not in OUR_ENV}
    full_env.update(env or {})
    proc = subprocess.run(
        cmd, env=full_env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


def _doctor(*args: str) -> list[str]:
    return [sys.executable, "-m", "vllm_mamba_fix", "doctor", *args]


_VLLM = installed_release()
needs_affected_vllm = pytest.mark.skipif(
    _VLLM is None or family_for(_VLLM).verdict is not Verdict.PATCH,
    reason=f"needs an installed vLLM release that the fix targets (found {_VLLM})",
)

# --- real vLLM -----------------------------------------------------------------------

CUSTOM_SCHEDULERS = """\
from vllm.v1.core.sched.async_scheduler import AsyncScheduler


class OverridingScheduler(AsyncScheduler):
    def _mamba_block_aligned_split(self, request, num_new_tokens, *args, **kwargs):
        return num_new_tokens


class EncoderOverridingScheduler(AsyncScheduler):
    def _try_schedule_encoder_inputs(self, *args, **kwargs):
        return super()._try_schedule_encoder_inputs(*args, **kwargs)


class InheritingScheduler(AsyncScheduler):
    pass
"""
MTP = '{"method": "qwen3_5_mtp", "num_speculative_tokens": 2}'


def _needed_by_version(vllm_version: str) -> list[str]:
    """The fix rules the version alone asks for (the real releases' code agrees).

    Not block-unit: it is needed only where a built scheduler's two block sizes differ,
    and a dry run builds none.
    """
    by_version = plan(Settings(), family_for(vllm_version), Evidence())
    fixes = (Rule.SPLIT, Rule.SPECULATIVE_STALL)
    return [v.rule.value for v in by_version.verdicts if v.rule in fixes and v.active]


@pytest.fixture(scope="session")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Every shared real-vLLM run of the doctor's tests, started together, once per session
    (core, rules, schedulers, settings, vllm_plugins, cli and the JSON contract read them)."""
    if _VLLM is None or family_for(_VLLM).verdict is not Verdict.PATCH:
        pytest.skip(f"needs an installed vLLM release that the fix targets (found {_VLLM})")
    site = tmp_path_factory.mktemp("custom_sched")
    (site / "doctor_test_sched.py").write_text(CUSTOM_SCHEDULERS)
    jobs: dict[str, tuple[list[str], dict[str, str]]] = {
        "json": (_doctor("--json"), {}),
        # no subcommand: doctor is the default; this checkout, as the other runs import it
        "script": ([str(CONSOLE_SCRIPT)], {"PYTHONPATH": str(REPO)}),
        "off": (_doctor("--json"), {"VLLM_MAMBA_FIX": "0"}),
        # Two faults in one run: the plugin list, and an invalid value of ours.
        "plugins": (
            _doctor("--speculative-config", MTP),
            {
                "VLLM_PLUGINS": "lora_filesystem_resolver, mamba_fix",
                "VLLM_MAMBA_FIX_SCOPE": "images-only",
            },
        ),
        "custom": (
            _doctor(
                "--json",
                "--scheduler-cls",
                "doctor_test_sched.OverridingScheduler",
                "--scheduler-cls",
                "doctor_test_sched.EncoderOverridingScheduler",
                "--scheduler-cls",
                "doctor_test_sched.InheritingScheduler",
            ),
            {"PYTHONPATH": str(site)},
        ),
    }
    if not CONSOLE_SCRIPT.exists():
        del jobs["script"]
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        futures = {name: pool.submit(_run, cmd, env) for name, (cmd, env) in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


# --- fake vLLM -----------------------------------------------------------------------

SPLIT_OK = "self, request, num_new_tokens, num_new_local_computed_tokens=0"
SPLIT_CHANGED = "self, req, tokens"
ENCODER_OK = (
    "self, request, num_computed_tokens, num_new_tokens, encoder_compute_budget, "
    "shift_computed_tokens=0"
)
ENCODER_CHANGED = "self, request, num_computed_tokens, num_new_tokens"
# Code evidence as the releases write it: a pre-fix build (encoder budgeted
# before the split; the free deferred by the look-ahead), and a backport of
# both upstream fixes. Without either, the fake has no code to read.
PRE_FIX_CODE = """
    def schedule(self):
        n = self._try_schedule_encoder_inputs(None, 0, 8, 8, shift_computed_tokens=1)[1]
        return self._mamba_block_aligned_split(None, n)

    def _free_encoder_inputs(self, request):
        spec_lookahead = 1 if self.use_eagle else 0
        return spec_lookahead
"""
# Every real release has it; the default fake leaves it out so that the stall-end
# rule's own absence can be shown.
UPDATE_CODE = """
    def update_from_output(self, scheduler_output, model_runner_output):
        return {}
"""
BACKPORT_CODE = """
    def schedule(self):
        n = self._mamba_block_aligned_split(None, 8)
        return self._try_schedule_encoder_inputs(None, 0, n, 8)[1]

    def _free_encoder_inputs(self, request):
        return request
"""


def _fake_vllm(
    root: Path,
    vllm_version: str,
    signature: str = SPLIT_OK,
    encoder: str = ENCODER_OK,
    code: str = "",
) -> Path:
    """A ``vllm`` package with just the scheduler module the doctor imports."""
    sched = root / "vllm" / "v1" / "core" / "sched"
    sched.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(f"__version__ = {vllm_version!r}\n")
    for pkg in (root / "vllm" / "v1", root / "vllm" / "v1" / "core", sched):
        (pkg / "__init__.py").touch()
    (sched / "scheduler.py").write_text(
        "class Scheduler:\n"
        f"    def _mamba_block_aligned_split({signature}):\n        return 0\n\n"
        f"    def _try_schedule_encoder_inputs({encoder}):\n        return None, 0\n{code}"
    )
    (sched / "async_scheduler.py").write_text(
        "from vllm.v1.core.sched.scheduler import Scheduler\n\n\n"
        "class AsyncScheduler(Scheduler):\n    pass\n"
    )
    return root


def _fake_run(tmp_path: Path, vllm_version: str, *args: str, **kwargs: str) -> Run:
    site = _fake_vllm(tmp_path / "site", vllm_version, **kwargs)
    return _run(_doctor(*args), {"PYTHONPATH": str(site)})


def _rules(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["rule"]: r for r in data["rules"]}


# A speculative config whose drafter brings its own KV cache group (test_speculative, test_issue).
DFLASH = (
    '{"method": "dflash", "model": "z-lab/Qwen3.5-35B-A3B-DFlash", "num_speculative_tokens": 8}'
)


# The ``--report`` block (doctor/render.py): a title line, then one fenced text block.
FENCED = re.compile(
    r"\A\*\*vllm-mamba-fix doctor --report\*\*[^\n]*\n\n(`{3,})text\n(.*)\n\1\Z", re.S
)


def _body(run: Run) -> str:
    """The fenced block's text; the whole output must be the block and its title."""
    found = FENCED.match(run.out.strip("\n"))
    assert found is not None, run.out
    return found.group(2)
