"""Faults that need a fresh interpreter: vLLM missing, VLLM_PLUGINS, spawn, file/socket audit.

The real-vLLM checks share one probe process (``_real_vllm_probe.py``), started
in the background by the conftest: importing vLLM costs tens of seconds here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.active_line import parse_active
from tests.faults.conftest import PLUGIN_ENV, ProbeRun

REGISTER_AND_REPORT = """
import logging, sys
logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s %(message)s")
{setup}
import vllm_mamba_fix
vllm_mamba_fix.register()
vllm_mamba_fix.register()
from vllm_mamba_fix.install import import_hook
print("RESULT hook_pending", import_hook.pending_hook() is not None)
"""

META_PATH_BLOCKER = """
import importlib.abc

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, Blocker())
"""


def _run_plugin(tmp_path: Path, setup: str, pythonpath: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in PLUGIN_ENV}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    script = REGISTER_AND_REPORT.format(setup=textwrap.dedent(setup))
    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    return output


def _plugin_lines(output: str, min_level: str = "INFO") -> list[str]:
    levels = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    wanted = levels[levels.index(min_level) :]
    return [
        line
        for line in output.splitlines()
        if "vllm.mamba_fix" in line and line.split(" ", 1)[0] in wanted
    ]


def test_vllm_blocked_by_meta_path(tmp_path: Path) -> None:
    output = _run_plugin(tmp_path, META_PATH_BLOCKER)
    assert "Traceback" not in output, output
    lines = _plugin_lines(output)
    assert len(lines) == 1, output
    assert lines[0].startswith("WARNING") and "vLLM is not importable" in lines[0]
    assert "RESULT hook_pending False" in output


def test_vllm_raising_on_import(tmp_path: Path) -> None:
    """A broken vLLM install: its ``__init__`` raises something other than ImportError."""
    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise OSError('libcudart.so.12: cannot open shared object')\n"
    )
    output = _run_plugin(tmp_path, "", pythonpath=tmp_path / "site")
    assert "Traceback" not in output, output
    lines = _plugin_lines(output)
    assert len(lines) == 1, output
    assert lines[0].startswith("WARNING") and "vLLM is not importable (OSError)" in lines[0]
    assert "RESULT hook_pending False" in output


# ------------------------------------------------------------------- real vLLM


def _mamba_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "vllm-mamba-fix" in line]


def test_vllm_plugins_excluding_the_plugin(real_vllm_probe: ProbeRun) -> None:
    output = real_vllm_probe.output()
    results = real_vllm_probe.results()
    excluded = results["excluded"]
    # 'some_other_plugin', '' (load none), ' mamba_fix' and 'mamba-fix' (exact names only).
    assert excluded["plugin_imported"] == [False, False, False, False], output
    assert excluded["patched"] is False
    assert "PostImportHook" not in excluded["hooks"]
    before_hygiene = output.split("PHASE hygiene", 1)[0]
    parent_lines = [
        line for line in _mamba_lines(before_hygiene) if f"pid {excluded['pid']}" in line
    ]
    assert parent_lines == [], parent_lines


def test_spawned_engine_core_child_is_patched(real_vllm_probe: ProbeRun) -> None:
    output = real_vllm_probe.output()
    results = real_vllm_probe.results()
    child = results["child"]
    assert results["parent"]["child_exitcode"] == 0, output
    assert child["allow"] == "mamba_fix"
    assert child["patched"] is True, output
    assert child["pid"] != results["excluded"]["pid"]
    active = [line for line in _mamba_lines(output) if " active: " in line]
    # Exactly one line from the child, which built a scheduler, naming it and its class.
    from_child = [line for line in active if f"pid {child['pid']})" in line]
    assert len(from_child) == 1, output
    parsed = parse_active(from_child[0])
    assert parsed is not None and parsed.vllm == "0.27.1", from_child[0]
    assert parsed.settings == {}  # the defaults: scope multimodal among them
    assert parsed.scheduler_class == "vllm.v1.core.sched.scheduler.Scheduler"
    assert parsed.rules[0] == "split" and parsed.block is not None, from_child[0]


def test_no_traceback_and_no_plugin_errors(real_vllm_probe: ProbeRun) -> None:
    output = real_vllm_probe.output()
    assert real_vllm_probe.process.returncode == 0, output
    assert "Traceback" not in output, output
    assert not [line for line in _mamba_lines(output) if "WARNING" in line or "ERROR" in line]


def test_writes_no_files_opens_no_sockets(real_vllm_probe: ProbeRun) -> None:
    hygiene = real_vllm_probe.results()["hygiene"]
    assert hygiene["patched"] is True
    # vLLM 0.27.1 itself floors this chunk, cut at an image the encoder cache can never
    # hold, to 0; the plugin corrects it to 100.
    assert hygiene["stock"] == [0]
    assert hygiene["corrected"][0] == 100
    assert hygiene["vllm_error"] == "AttributeError"  # vLLM's error reached the caller
    assert hygiene["counters"]["collapses_prevented"] >= 1
    assert hygiene["plugin_files_read"] > 0  # the audit hook was live: it saw the plugin load
    assert hygiene["events"] == []


def test_reads_only_its_own_variables_in_real_vllm(real_vllm_probe: ProbeRun) -> None:
    hygiene = real_vllm_probe.results()["hygiene"]
    assert set(hygiene["env_read"]) == {
        "VLLM_MAMBA_FIX",
        "VLLM_MAMBA_FIX_SCOPE",
        "VLLM_MAMBA_FIX_STALL_SECONDS",
        "VLLM_MAMBA_FIX_END_STALLS_AFTER",
        "VLLM_MAMBA_FIX_SPLIT_RULE",
        "VLLM_MAMBA_FIX_BLOCK_RULE",
        "PROMETHEUS_MULTIPROC_DIR",
        "_VLLM_MAMBA_FIX_METRICS_DIR",
    }


def test_real_requests_leave_no_prompt_content_in_logs(real_vllm_probe: ProbeRun) -> None:
    from tests.faults import _real_vllm_probe as probe

    output = real_vllm_probe.output()
    lines = _mamba_lines(output)
    assert any("req-hyg-1" in line and "collapse-prevented" in line for line in lines), output
    assert any("prevented" in line and "collapses" in line for line in lines)  # exit summary
    for line in lines:
        assert probe.SENTINEL_TEXT not in line
        assert not re.search(rf"\b{probe.SENTINEL_TOKEN}\b", line)
