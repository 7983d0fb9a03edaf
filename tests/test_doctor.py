"""``vllm-mamba-fix doctor`` in real subprocesses.

Two kinds of run:
- against the real installed vLLM (an affected release): the runs start once,
  in parallel, and several tests read each result;
- against a tiny fake ``vllm`` package on PYTHONPATH (well under a second
  each), for cases the real install cannot show: other releases, a changed
  signature, a missing entry point, vLLM not importable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tools.releases import installed_release
from vllm_mamba_fix.versions import Verdict, family_for

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "vllm_mamba_fix"
CONSOLE_SCRIPT = Path(sys.executable).with_name("vllm-mamba-fix")
TIMEOUT = 600  # seconds; the real runs import vLLM and may share a busy machine
OUR_ENV = ("VLLM_MAMBA_FIX", "VLLM_MAMBA_FIX_SCOPE", "VLLM_PLUGINS", "PYTHONPATH")


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


class InheritingScheduler(AsyncScheduler):
    pass
"""


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Every real-vLLM run of this file, started together."""
    if _VLLM is None or family_for(_VLLM).verdict is not Verdict.PATCH:
        pytest.skip(f"needs an installed vLLM release that the fix targets (found {_VLLM})")
    site = tmp_path_factory.mktemp("custom_sched")
    (site / "doctor_test_sched.py").write_text(CUSTOM_SCHEDULERS)
    jobs: dict[str, tuple[list[str], dict[str, str]]] = {
        "json": (_doctor("--json"), {}),
        "script": ([str(CONSOLE_SCRIPT)], {}),  # no subcommand: doctor is the default
        "off": (_doctor("--json"), {"VLLM_MAMBA_FIX": "0"}),
        # Two faults in one run: the plugin list, and an invalid value of ours.
        "plugins": (
            _doctor(),
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
    assert "affected" in data["policy"]["reason"]
    assert (
        data["entry_point"]["found"] and data["entry_point"]["value"] == "vllm_mamba_fix:register"
    )
    assert data["vllm_plugins"] == {"value": None, "allows": True}
    assert data["settings"]["mode"] == "auto" and data["settings"]["problems"] == []
    assert data["problems"] == []
    assert isinstance(data["elapsed_seconds"], float)


@needs_affected_vllm
def test_default_dry_run_patches_through_the_import_hook_and_undoes(real: dict[str, Run]) -> None:
    data = real["json"].json()
    dry = data["dry_run"]
    assert dry["ran"] and not dry["forced"]
    assert dry["patched"] and dry["restored"] and dry["via"] == "import hook"
    assert any(" active: patched Scheduler._mamba_block_aligned_split" in m for m in dry["log"])
    by_class = {s["class"].rsplit(".", 1)[1]: s for s in data["schedulers"]}
    for name in ("Scheduler", "AsyncScheduler"):
        assert by_class[name]["reached"] is True
        assert by_class[name]["overridden_by"] is None


@needs_affected_vllm
def test_console_script_defaults_to_doctor_with_human_output(real: dict[str, Run]) -> None:
    if "script" not in real:
        pytest.skip(f"console script not installed at {CONSOLE_SCRIPT}")
    run = real["script"]
    assert run.code == 0, run.err
    assert "needed, will patch" in run.out
    assert "result: PROTECTED" in run.out
    assert "wrapper verified; undone" in run.out
    assert "Traceback" not in run.out + run.err
    assert "Triton" not in run.out  # vLLM's own log lines go to stderr


@needs_affected_vllm
def test_disabled_on_affected_release_is_not_protected(real: dict[str, Run]) -> None:
    run = real["off"]
    assert run.code == 1, run.err
    data = run.json()
    assert data["status"] == "not-protected"
    assert data["policy"]["verdict"] == "needed-will-not-patch"
    assert any("disabled by VLLM_MAMBA_FIX='0'" in p for p in data["problems"])
    assert "VLLM_MAMBA_FIX" in data["summary"]
    # The forced dry run still shows that enabling it would work.
    assert data["dry_run"]["forced"] and data["dry_run"]["patched"]


@needs_affected_vllm
def test_vllm_plugins_without_us_is_not_protected(real: dict[str, Run]) -> None:
    run = real["plugins"]
    assert run.code == 1, run.err
    assert "result: NOT PROTECTED" in run.out
    assert "does not list 'mamba_fix'" in run.out
    assert "vLLM does not strip spaces" in run.out  # " mamba_fix" is not "mamba_fix"


@needs_affected_vllm
def test_invalid_env_value_is_reported(real: dict[str, Run]) -> None:
    run = real["plugins"]
    assert "invalid value: VLLM_MAMBA_FIX_SCOPE='images-only' is not one of" in run.out
    assert "scope multimodal" in run.out  # the default applies


@needs_affected_vllm
def test_custom_scheduler_that_overrides_is_named(real: dict[str, Run]) -> None:
    run = real["custom"]
    assert run.code == 1, run.err
    data = run.json()
    assert data["status"] == "not-protected"
    by_class = {s["class"]: s for s in data["schedulers"]}
    bad = by_class["doctor_test_sched.OverridingScheduler"]
    assert bad["overridden_by"] == "doctor_test_sched.OverridingScheduler"
    assert bad["reached"] is False
    good = by_class["doctor_test_sched.InheritingScheduler"]
    assert good["reached"] is True and good["overridden_by"] is None
    assert any("doctor_test_sched.OverridingScheduler" in p for p in data["problems"])
    assert not any("InheritingScheduler" in p for p in data["problems"])


# --- fake vLLM -----------------------------------------------------------------------

SPLIT_OK = "self, request, num_new_tokens, num_new_local_computed_tokens=0"
SPLIT_CHANGED = "self, req, tokens"


def _fake_vllm(root: Path, vllm_version: str, signature: str = SPLIT_OK) -> Path:
    """A ``vllm`` package with just the scheduler module the doctor imports."""
    sched = root / "vllm" / "v1" / "core" / "sched"
    sched.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(f"__version__ = {vllm_version!r}\n")
    for pkg in (root / "vllm" / "v1", root / "vllm" / "v1" / "core", sched):
        (pkg / "__init__.py").touch()
    (sched / "scheduler.py").write_text(
        textwrap.dedent(f"""\
            class Scheduler:
                def _mamba_block_aligned_split({signature}):
                    return 0
            """)
    )
    (sched / "async_scheduler.py").write_text(
        "from vllm.v1.core.sched.scheduler import Scheduler\n\n\n"
        "class AsyncScheduler(Scheduler):\n    pass\n"
    )
    return root


def _fake_run(tmp_path: Path, vllm_version: str, *args: str, **kwargs: str) -> Run:
    site = _fake_vllm(tmp_path / "site", vllm_version, **kwargs)
    return _run(_doctor(*args), {"PYTHONPATH": str(site)})


def test_fake_affected_release_is_protected(tmp_path: Path) -> None:
    data = _fake_run(tmp_path, "0.25.1", "--json").json()
    assert (data["status"], data["exit_code"], data["family"]["name"]) == ("protected", 0, "0.24")
    assert data["dry_run"]["patched"] and data["dry_run"]["restored"]


def test_invalid_env_value_alone_keeps_protection(tmp_path: Path) -> None:
    site = _fake_vllm(tmp_path / "site", "0.27.1")
    run = _run(_doctor("--json"), {"PYTHONPATH": str(site), "VLLM_MAMBA_FIX": "maybe"})
    assert run.code == 0, run.err
    data = run.json()
    assert (data["status"], data["settings"]["mode"]) == ("protected", "auto")
    assert data["settings"]["env"]["VLLM_MAMBA_FIX"] == "maybe"
    (problem,) = data["settings"]["problems"]
    assert "VLLM_MAMBA_FIX='maybe'" in problem
    assert problem in " ".join(data["warnings"])


def test_signature_mismatch_is_not_protected(tmp_path: Path) -> None:
    run = _fake_run(tmp_path, "0.27.1", signature=SPLIT_CHANGED)
    assert run.code == 1, run.err
    assert "result: NOT PROTECTED" in run.out
    assert "unexpected signature" in run.out


@pytest.mark.parametrize(
    ("vllm_version", "family", "needle"),
    [("0.32.0", "0.28+", "not needed on vLLM 0.32.0"), ("0.14.1", "<0.15", "no Scheduler.")],
)
def test_unaffected_release_is_not_needed(
    tmp_path: Path, vllm_version: str, family: str, needle: str
) -> None:
    run = _fake_run(tmp_path, vllm_version, "--json")
    assert run.code == 0, run.err
    data = run.json()
    assert (data["status"], data["family"]["name"]) == ("not-needed", family)
    assert needle in data["summary"]


def test_not_needed_even_when_disabled(tmp_path: Path) -> None:
    site = _fake_vllm(tmp_path / "site", "0.30.0")
    run = _run(_doctor(), {"PYTHONPATH": str(site), "VLLM_MAMBA_FIX": "off"})
    assert run.code == 0, run.err
    assert "result: NOT NEEDED" in run.out


def test_unreadable_version_with_force_is_protected(tmp_path: Path) -> None:
    site = _fake_vllm(tmp_path / "site", "not-a-version")
    run = _run(_doctor("--json"), {"PYTHONPATH": str(site), "VLLM_MAMBA_FIX": "force"})
    assert run.code == 0, run.err
    data = run.json()
    assert (data["status"], data["policy"]["verdict"]) == ("protected", "needed-will-patch")


def test_unreadable_version_cannot_tell(tmp_path: Path) -> None:
    run = _fake_run(tmp_path, "not-a-version")
    assert run.code == 3, run.err
    assert "result: CANNOT TELL" in run.out
    assert "cannot read the vLLM version" in run.out


def test_vllm_not_importable_cannot_tell(tmp_path: Path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('broken build\\nline 2')\n")
    run = _run(_doctor("--json"), {"PYTHONPATH": str(tmp_path)})
    assert run.code == 3, run.err
    data = run.json()
    assert data["status"] == "unknown"
    assert data["vllm"]["error"] == "ImportError: broken build"


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


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--scheduler-cls", "no_such_module_xyz.Sched"), "cannot import 'no_such_module_xyz'"),
        (("--scheduler-cls", "vllm.v1.core.sched.scheduler.Nope"), "has no attribute 'Nope'"),
    ],
)
def test_unloadable_scheduler_cls_is_invalid_input(
    tmp_path: Path, args: tuple[str, ...], needle: str
) -> None:
    run = _fake_run(tmp_path, "0.27.1", *args)
    assert run.code == 2, run.err
    assert needle in run.out
    assert "result: INVALID INPUT" in run.out
    assert "Traceback" not in run.out + run.err


@pytest.mark.parametrize(
    "args", [("doctor", "--scheduler-cls", "not a path"), ("--bogus",), ("frobnicate",)]
)
def test_bad_arguments_give_one_line_and_exit_2(args: tuple[str, ...]) -> None:
    run = _run([sys.executable, "-m", "vllm_mamba_fix", *args])
    assert run.code == 2
    assert run.out == ""
    assert "Traceback" not in run.err
    assert run.err.strip().splitlines()[-1].startswith("vllm-mamba-fix")
