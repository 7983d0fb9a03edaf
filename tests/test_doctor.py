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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tools.releases import installed_release
from vllm_mamba_fix.config import Mode
from vllm_mamba_fix.doctor import (
    FALLBACK_METHODS,
    SpeculativeMethods,
    classify_speculative,
)
from vllm_mamba_fix.evidence import Evidence
from vllm_mamba_fix.policy import Rule
from vllm_mamba_fix.rules import plan
from vllm_mamba_fix.versions import Verdict, family_for

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "vllm_mamba_fix"
CONSOLE_SCRIPT = Path(sys.executable).with_name("vllm-mamba-fix")
TIMEOUT = 600  # seconds; the real runs import vLLM and may share a busy machine
OUR_ENV = (
    "VLLM_MAMBA_FIX",
    "VLLM_MAMBA_FIX_SCOPE",
    "VLLM_MAMBA_FIX_STALL_SECONDS",
    "VLLM_PLUGINS",
    "PYTHONPATH",
)


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
    """The fix rules the version alone asks for (the real releases' code agrees)."""
    by_version = plan(Settings(), family_for(vllm_version), Evidence())
    fixes = (Rule.SPLIT, Rule.SPECULATIVE_STALL)
    return [v.rule.value for v in by_version.verdicts if v.rule in fixes and v.active]


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


@needs_affected_vllm
def test_both_evidences_are_shown_and_the_code_decides(real: dict[str, Run]) -> None:
    data = real["json"].json()
    evidence = data["evidence"]
    assert evidence["read_from"] == "vllm.v1.core.sched.scheduler.Scheduler"
    assert evidence["split_after_encoder"] is True  # every affected release: the matrix agrees
    rules = {r["rule"]: r for r in data["rules"]}
    assert list(rules) == ["split", "speculative-stall", "stall-watchdog"]
    split = rules["split"]
    assert split["version"]["active"] is split["code"]["active"] is True
    assert (split["decided_by"], split["active"], split["installs"]) == ("code", True, True)
    speculative = rules["speculative-stall"]
    assert speculative["active"] is ("speculative-stall" in _needed_by_version(_VLLM))
    assert speculative["version"]["active"] is speculative["active"]
    watchdog = rules["stall-watchdog"]
    assert (watchdog["decided_by"], watchdog["active"], watchdog["needed"]) == (
        "setting",
        True,
        None,
    )
    # Before the engine starts, the speculative set-up is invisible; the list is the release's.
    spec = data["speculative"]
    assert spec["visible"] is False and spec["eagle_type"] is None
    assert spec["eagle_methods_from"] == "vllm.config.speculative (use_eagle)"
    if _VLLM == "0.27.1":
        assert spec["eagle_methods"] == list(FALLBACK_METHODS.eagle)


@needs_affected_vllm
def test_default_dry_run_patches_through_the_import_hook_and_undoes(real: dict[str, Run]) -> None:
    data = real["json"].json()
    dry = data["dry_run"]
    assert dry["ran"] and not dry["forced"]
    assert dry["patched"] and dry["restored"] and dry["via"] == "import hook"
    assert dry["wrapped_methods"] == ["_mamba_block_aligned_split", "_try_schedule_encoder_inputs"]
    by_class = {s["class"].rsplit(".", 1)[1]: s for s in data["schedulers"]}
    for name in ("Scheduler", "AsyncScheduler"):
        assert by_class[name]["reached"] is True
        assert by_class[name]["overridden_by"] is None
        assert all(m["reached"] for m in by_class[name]["methods"].values())
        # The plugin's typed record for the class: both rule methods carry its wrapper.
        record = by_class[name]["record"]
        assert record["scheduler_class"] == by_class[name]["class"]
        states = {m["name"]: (m["state"], m["owner"], m["wraps"]) for m in record["methods"]}
        stock = "vllm.v1.core.sched.scheduler.Scheduler"
        assert states == {
            "_mamba_block_aligned_split": ("wrapped", stock, f"{stock}._mamba_block_aligned_split"),
            "_try_schedule_encoder_inputs": (
                "wrapped", stock, f"{stock}._try_schedule_encoder_inputs",
            ),
        }  # fmt: skip
        expected_rules = {*_needed_by_version(_VLLM), "stall-watchdog"}
        assert set(record["rules"]) == expected_rules and record["left_out"] == []
        assert record["block_size"] is None  # a dry run builds no scheduler
    assert {r["scheduler_class"] for r in data["install_records"]} == {
        by_class[name]["class"] for name in ("Scheduler", "AsyncScheduler")
    }
    assert data["block_size"] is None
    # The plugin's own active line is shown (captured), one per class it settled.
    for name in ("Scheduler", "AsyncScheduler"):
        assert any(f"active: {by_class[name]['class']} carries " in m for m in dry["log"])


@needs_affected_vllm
def test_console_script_defaults_to_doctor_with_human_output(real: dict[str, Run]) -> None:
    if "script" not in real:
        pytest.skip(f"console script not installed at {CONSOLE_SCRIPT}")
    run = real["script"]
    assert run.code == 0, run.err
    assert "needed, will patch" in run.out
    assert "result: PROTECTED" in run.out
    assert "wrappers verified; undone" in run.out
    assert "version (family " in run.out and "; code: needed" in run.out
    assert "speculative       decided by the engine at start, not visible yet" in run.out
    assert "stall watchdog after 30 s" in run.out
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
    # A dry run with VLLM_MAMBA_FIX=auto still shows that enabling it would work.
    assert data["dry_run"]["forced"] and data["dry_run"]["patched"]
    assert data["dry_run"]["mode"] == "auto"
    assert not any(r["active"] for r in data["rules"])
    assert {r["decided_by"] for r in data["rules"]} == {"setting"}


@needs_affected_vllm
def test_vllm_plugins_without_us_is_not_protected(real: dict[str, Run]) -> None:
    run = real["plugins"]
    assert run.code == 1, run.err
    assert "result: NOT PROTECTED" in run.out
    assert "does not list 'mamba_fix'" in run.out
    assert "vLLM does not strip spaces" in run.out  # " mamba_fix" is not "mamba_fix"
    # The same run passed an MTP --speculative-config.
    assert "method mtp ('qwen3_5_mtp' is an MTP model type" in run.out


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
    # Overriding the encoder method escapes the encoder rules (the split still reaches it).
    encoder = by_class["doctor_test_sched.EncoderOverridingScheduler"]
    methods = encoder["methods"]
    assert methods["_mamba_block_aligned_split"] == {"overridden_by": None, "reached": True}
    assert methods["_try_schedule_encoder_inputs"]["overridden_by"] == (
        "doctor_test_sched.EncoderOverridingScheduler"
    )
    named = [p for p in data["problems"] if "EncoderOverridingScheduler" in p]
    if "speculative-stall" in _needed_by_version(_VLLM):
        assert named and "speculative-stall and stall-watchdog do not reach it" in named[0]
    else:  # only the watchdog is lost: a warning
        assert not named
    # One typed record per class given, and the dry run undid what settling them wrapped.
    states = {
        s["class"].rsplit(".", 1)[1]: {m["name"]: m["state"] for m in s["record"]["methods"]}
        for s in data["schedulers"]
    }
    split, encoder = "_mamba_block_aligned_split", "_try_schedule_encoder_inputs"
    assert states["OverridingScheduler"][split] == "overridden"
    assert states["EncoderOverridingScheduler"] == {split: "wrapped", encoder: "overridden"}
    assert states["InheritingScheduler"] == {split: "wrapped", encoder: "wrapped"}
    assert data["dry_run"]["restored"] is True


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


@pytest.mark.parametrize(
    ("vllm_version", "family", "needed", "wrapped"),
    [
        ("0.25.1", "0.24", ["split", "speculative-stall"], 2),
        # 0.28-0.32: upstream fixed the split, not the speculative stall.
        ("0.32.0", "0.28", ["speculative-stall"], 1),
    ],
)
def test_fake_affected_release_is_protected(
    tmp_path: Path, vllm_version: str, family: str, needed: list[str], wrapped: int
) -> None:
    data = _fake_run(tmp_path, vllm_version, "--json").json()
    assert (data["status"], data["exit_code"], data["family"]["name"]) == ("protected", 0, family)
    assert data["policy"]["needed_rules"] == needed
    assert data["dry_run"]["patched"] and data["dry_run"]["restored"]
    assert len(data["dry_run"]["wrapped_methods"]) == wrapped
    # No code to read in the fake: the version decides, and the report says so.
    assert data["evidence"]["split_after_encoder"] is None and data["evidence"]["problem"]
    rules = _rules(data)
    assert [rules[r]["decided_by"] for r in needed] == ["version"] * len(needed)
    assert all(rules[r]["code"]["active"] is None for r in rules)
    assert rules["stall-watchdog"]["active"] and rules["stall-watchdog"]["installs"]


def test_code_evidence_patches_a_pre_fix_dev_build(tmp_path: Path) -> None:
    run = _fake_run(tmp_path, "0.28.0.dev3", code=PRE_FIX_CODE)
    assert run.code == 0, run.err
    assert "result: PROTECTED" in run.out
    assert "needs split (by code) and speculative-stall (by code)" in run.out
    assert "Scheduler.schedule budgets encoder inputs before the split;" in run.out
    assert "the version alone would have left it (a pre-fix build)" in run.out
    assert "version (family 0.28): not needed; code: needed" in run.out


def test_code_evidence_leaves_a_backport_alone(tmp_path: Path) -> None:
    data = _fake_run(tmp_path, "0.27.1", "--json", code=BACKPORT_CODE).json()
    assert (data["status"], data["exit_code"]) == ("not-needed", 0)
    assert data["evidence"]["split_after_encoder"] is False
    assert data["evidence"]["deferred_encoder_free"] is False
    rules = _rules(data)
    for name in ("split", "speculative-stall"):
        assert rules[name]["version"]["active"] is True and rules[name]["code"]["active"] is False
        assert (rules[name]["decided_by"], rules[name]["active"]) == ("code", False)
    assert "the version alone would have patched (a backport)" in data["summary"]
    assert data["dry_run"]["wrapped_methods"] == []


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


def test_encoder_signature_mismatch_loses_the_encoder_rules(tmp_path: Path) -> None:
    data = _fake_run(tmp_path, "0.32.0", "--json", encoder=ENCODER_CHANGED).json()
    assert (data["status"], data["exit_code"]) == ("not-protected", 1)
    (problem,) = data["problems"]
    assert problem.startswith("speculative-stall would not apply: Scheduler._try_schedule")
    assert "_try_schedule_encoder_inputs has an unexpected signature" in problem
    assert "stall-watchdog would not apply" in " ".join(data["warnings"])


@pytest.mark.parametrize(
    ("stall", "seconds", "text", "warned"),
    [
        (None, 30.0, "stall watchdog after 30 s", False),
        ("off", None, "stall watchdog off", False),
        ("soon", 30.0, "stall watchdog after 30 s", True),  # invalid: warned, default applies
    ],
)
def test_stall_watchdog_setting_is_reported(
    tmp_path: Path, stall: str | None, seconds: float | None, text: str, warned: bool
) -> None:
    site = _fake_vllm(tmp_path / "site", "0.32.0")
    env = {"PYTHONPATH": str(site)}
    if stall is not None:
        env["VLLM_MAMBA_FIX_STALL_SECONDS"] = stall
    data = _run(_doctor("--json"), env).json()
    assert (data["status"], data["exit_code"]) == ("protected", 0)
    assert data["settings"]["stall_seconds"] == seconds
    assert data["settings"]["env"]["VLLM_MAMBA_FIX_STALL_SECONDS"] == stall
    watchdog = _rules(data)["stall-watchdog"]
    assert watchdog["active"] is (seconds is not None)
    problems = data["settings"]["problems"]
    assert bool(problems) is warned
    if warned:
        assert "VLLM_MAMBA_FIX_STALL_SECONDS='soon' is not a number" in problems[0]
        assert problems[0] in " ".join(data["warnings"])
    human = _run(_doctor(), env).out
    assert f"mode auto, scope multimodal, {text}" in human


@pytest.mark.parametrize(
    ("vllm_version", "family", "needle"),
    [("0.33.0", "0.33+", "not needed on vLLM 0.33.0"), ("0.14.1", "<0.15", "no Scheduler.")],
)
def test_unaffected_release_is_not_needed(
    tmp_path: Path, vllm_version: str, family: str, needle: str
) -> None:
    run = _fake_run(tmp_path, vllm_version, "--json")
    assert run.code == 0, run.err
    data = run.json()
    assert (data["status"], data["family"]["name"]) == ("not-needed", family)
    assert needle in data["summary"]


@pytest.mark.parametrize(
    ("vllm_version", "args", "code", "result"),
    [
        ("0.33.0", (), 0, "result: NOT NEEDED"),
        ("0.30.0", (), 1, "result: NOT PROTECTED"),  # the speculative-stall rule is off
        # ... unless the set-up is not EAGLE-type, so the stall cannot arise.
        ("0.30.0", ("--speculative-config", '{"method": "ngram"}'), 0, "result: NOT NEEDED"),
    ],
)
def test_disabled_is_fine_only_where_nothing_is_needed(
    tmp_path: Path, vllm_version: str, args: tuple[str, ...], code: int, result: str
) -> None:
    site = _fake_vllm(tmp_path / "site", vllm_version)
    run = _run(_doctor(*args), {"PYTHONPATH": str(site), "VLLM_MAMBA_FIX": "off"})
    assert run.code == code, run.out + run.err
    assert result in run.out


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


# --- in-process ----------------------------------------------------------------------

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


# --- the JSON contract ---------------------------------------------------------------

# Pinned from the doctor before it became a package (commit 9d8ec53, vLLM 0.27.1 and the
# fakes below): every field path of its --json output ("a.b"; "a[].b" inside a list) and
# its exit code, per case. Fields may be added; none of these may go.
PINNED_FIELDS = frozenset(
    {
        "dry_run",
        "dry_run.already_active",
        "dry_run.forced",
        "dry_run.log",
        "dry_run.overriding_subclasses",
        "dry_run.patched",
        "dry_run.ran",
        "dry_run.restored",
        "dry_run.via",
        "dry_run.wrapped_methods",
        "elapsed_seconds",
        "entry_point",
        "entry_point.count",
        "entry_point.distribution",
        "entry_point.distribution_version",
        "entry_point.found",
        "entry_point.group",
        "entry_point.name",
        "entry_point.value",
        "evidence",
        "evidence.deferred_encoder_free",
        "evidence.problem",
        "evidence.read_from",
        "evidence.split_after_encoder",
        "exit_code",
        "family",
        "family.name",
        "family.summary",
        "family.verdict",
        "platform_plugins",
        "policy",
        "policy.needed",
        "policy.needed_rules",
        "policy.reason",
        "policy.should_patch",
        "policy.verdict",
        "problems",
        "rules",
        "rules[].active",
        "rules[].code",
        "rules[].code.active",
        "rules[].code.reason",
        "rules[].decided_by",
        "rules[].installs",
        "rules[].method",
        "rules[].needed",
        "rules[].problem",
        "rules[].reason",
        "rules[].rule",
        "rules[].version",
        "rules[].version.active",
        "rules[].version.reason",
        "schedulers",
        "schedulers[].class",
        "schedulers[].derives_from_scheduler",
        "schedulers[].loaded",
        "schedulers[].methods",
        "schedulers[].methods._mamba_block_aligned_split",
        "schedulers[].methods._mamba_block_aligned_split.overridden_by",
        "schedulers[].methods._mamba_block_aligned_split.reached",
        "schedulers[].methods._try_schedule_encoder_inputs",
        "schedulers[].methods._try_schedule_encoder_inputs.overridden_by",
        "schedulers[].methods._try_schedule_encoder_inputs.reached",
        "schedulers[].overridden_by",
        "schedulers[].problems",
        "schedulers[].reached",
        "schedulers[].role",
        "settings",
        "settings.env",
        "settings.env.VLLM_MAMBA_FIX",
        "settings.env.VLLM_MAMBA_FIX_SCOPE",
        "settings.env.VLLM_MAMBA_FIX_STALL_SECONDS",
        "settings.mode",
        "settings.problems",
        "settings.scope",
        "settings.stall_seconds",
        "speculative",
        "speculative.eagle_methods",
        "speculative.eagle_methods_from",
        "speculative.eagle_type",
        "speculative.plugin",
        "speculative.plugin_text",
        "speculative.source",
        "speculative.visible",
        "status",
        "summary",
        "timings_seconds",
        "timings_seconds.dry_run",
        "timings_seconds.import_vllm",
        "tool",
        "tool.name",
        "tool.package_path",
        "tool.python",
        "tool.version",
        "vllm",
        "vllm.distribution",
        "vllm.distribution.name",
        "vllm.distribution.version",
        "vllm.importable",
        "vllm.path",
        "vllm.version",
        "vllm_plugins",
        "vllm_plugins.allows",
        "vllm_plugins.value",
        "warnings",
    }
)
# Present only where the dry run ran (not on a release with nothing to patch).
DRY_RUN_FIELDS = frozenset(
    {
        "dry_run.already_active",
        "dry_run.forced",
        "dry_run.log",
        "dry_run.overriding_subclasses",
        "dry_run.patched",
        "dry_run.restored",
        "dry_run.via",
        "dry_run.wrapped_methods",
        "schedulers[].class",
        "schedulers[].derives_from_scheduler",
        "schedulers[].loaded",
        "schedulers[].methods",
        "schedulers[].methods._mamba_block_aligned_split",
        "schedulers[].methods._mamba_block_aligned_split.overridden_by",
        "schedulers[].methods._mamba_block_aligned_split.reached",
        "schedulers[].methods._try_schedule_encoder_inputs",
        "schedulers[].methods._try_schedule_encoder_inputs.overridden_by",
        "schedulers[].methods._try_schedule_encoder_inputs.reached",
        "schedulers[].overridden_by",
        "schedulers[].problems",
        "schedulers[].reached",
        "schedulers[].role",
        "timings_seconds.dry_run",
    }
)
# Present only where vLLM was imported.
IMPORTED_FIELDS = frozenset(
    {
        "evidence",
        "evidence.deferred_encoder_free",
        "evidence.problem",
        "evidence.read_from",
        "evidence.split_after_encoder",
        "family.name",
        "family.summary",
        "family.verdict",
        "platform_plugins",
        "policy",
        "policy.needed",
        "policy.needed_rules",
        "policy.reason",
        "policy.should_patch",
        "policy.verdict",
        "rules",
        "rules[].active",
        "rules[].code",
        "rules[].code.active",
        "rules[].code.reason",
        "rules[].decided_by",
        "rules[].installs",
        "rules[].method",
        "rules[].needed",
        "rules[].problem",
        "rules[].reason",
        "rules[].rule",
        "rules[].version",
        "rules[].version.active",
        "rules[].version.reason",
        "speculative",
        "speculative.eagle_methods",
        "speculative.eagle_methods_from",
        "speculative.eagle_type",
        "speculative.plugin",
        "speculative.plugin_text",
        "speculative.source",
        "speculative.visible",
        "vllm.distribution",
        "vllm.distribution.name",
        "vllm.distribution.version",
        "vllm.path",
        "vllm.version",
    }
)


def _field_paths(value: Any, prefix: str = "") -> set[str]:
    """Every key path of a JSON value: "a.b" for nested objects, "a[].b" inside lists."""
    paths: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else key
            paths |= {path, *_field_paths(item, path)}
    elif isinstance(value, list):
        for item in value:
            paths |= _field_paths(item, f"{prefix}[]")
    return paths


def _assert_pinned(
    run: Run, code: int, status: str, extra: frozenset[str], absent: frozenset[str]
) -> None:
    data = run.json()
    assert (run.code, data["exit_code"], data["status"]) == (code, code, status), run.err
    missing = ((PINNED_FIELDS - absent) | extra) - _field_paths(data)
    assert not missing, f"fields the doctor no longer writes: {sorted(missing)}"


@needs_affected_vllm
@pytest.mark.parametrize(
    ("run_name", "code", "status", "extra"),
    [
        ("json", 0, "protected", frozenset()),
        ("off", 1, "not-protected", frozenset({"dry_run.mode"})),
        ("custom", 1, "not-protected", frozenset()),
    ],
)
def test_json_fields_and_exit_codes_are_pinned_on_real_vllm(
    real: dict[str, Run], run_name: str, code: int, status: str, extra: frozenset[str]
) -> None:
    _assert_pinned(real[run_name], code, status, extra, frozenset())


@pytest.mark.parametrize(
    ("vllm_version", "fake", "args", "code", "status", "extra", "absent"),
    [
        ("0.32.0", {"encoder": ENCODER_CHANGED}, (), 1, "not-protected",
         frozenset({"dry_run.error"}), frozenset()),
        ("0.33.0", {}, (), 0, "not-needed", frozenset({"dry_run.error"}), frozenset()),
        ("0.14.1", {}, (), 0, "not-needed", frozenset(), DRY_RUN_FIELDS),
        ("not-a-version", {}, (), 3, "unknown", frozenset({"dry_run.mode"}), frozenset()),
        ("0.27.1", {}, ("--scheduler-cls", "no_such_module_xyz.Sched",
                        "--speculative-config", '{"method": "mtp"}'),
         2, "invalid-input",
         frozenset({"schedulers[].error", "speculative.how", "speculative.invalid",
                    "speculative.method", "speculative.model", "speculative.resolved_method"}),
         frozenset()),
        (None, {}, (), 3, "unknown", frozenset({"vllm.error"}), DRY_RUN_FIELDS | IMPORTED_FIELDS),
    ],
)  # fmt: skip
def test_json_fields_and_exit_codes_are_pinned_on_fakes(
    tmp_path: Path,
    vllm_version: str | None,
    fake: dict[str, str],
    args: tuple[str, ...],
    code: int,
    status: str,
    extra: frozenset[str],
    absent: frozenset[str],
) -> None:
    if vllm_version is None:  # vLLM not importable
        (tmp_path / "vllm").mkdir()
        (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('broken build')\n")
        run = _run(_doctor("--json"), {"PYTHONPATH": str(tmp_path)})
    else:
        run = _fake_run(tmp_path, vllm_version, "--json", *args, **fake)
    _assert_pinned(run, code, status, extra, absent)


# --- per class, and no log text ------------------------------------------------------

# A platform scheduler with its own copy of schedule() in the pre-0.28 order (encoder
# inputs budgeted before the split), as vllm-ascend's vllm_ascend/core/recompute_scheduler.py
# keeps on any vLLM.
OLD_ORDER_SCHEDULER = """\
from vllm.v1.core.sched.scheduler import Scheduler


class OldOrderScheduler(Scheduler):
    def schedule(self):
        n = self._try_schedule_encoder_inputs(None, 0, 8, 8, shift_computed_tokens=1)[1]
        return self._mamba_block_aligned_split(None, n)
"""


def test_scheduler_cls_with_its_own_old_order_schedule_is_reported_per_class(
    tmp_path: Path,
) -> None:
    site = _fake_vllm(tmp_path / "site", "0.32.0")
    (site / "platform_sched.py").write_text(OLD_ORDER_SCHEDULER)
    name = "platform_sched.OldOrderScheduler"
    # Given twice: still one entry (and one record) per class.
    args = ("--json", "--scheduler-cls", name, "--scheduler-cls", name)
    run = _run(_doctor(*args), {"PYTHONPATH": str(site)})
    assert run.code == 0, run.out + run.err
    data = run.json()
    assert data["status"] == "protected"
    # The base is fixed upstream (0.28+); the subclass's own code needs the split.
    assert data["policy"]["needed_rules"] == ["split", "speculative-stall"]
    assert f"split (by the code of {name})" in data["policy"]["reason"]
    assert _rules(data)["split"]["needed_by_classes"] == [name]
    entries = [s for s in data["schedulers"] if s["class"] == name]
    assert len(entries) == 1
    record = entries[0]["record"]
    assert "split" in record["rules"]
    split = next(m for m in record["methods"] if m["name"] == "_mamba_block_aligned_split")
    # Installed on the subclass only, so the fixed base stays stock.
    assert (split["state"], split["owner"]) == ("wrapped", name)
    base = next(s for s in data["schedulers"] if s["class"].endswith(".scheduler.Scheduler"))
    base_split = next(
        m for m in base["record"]["methods"] if m["name"] == "_mamba_block_aligned_split"
    )
    assert base_split["state"] == "stock"
    assert data["dry_run"]["restored"] is True


# Runs doctor with the plugin's log silenced and nothing captured: the verdict must not change.
_SILENT_DOCTOR = """\
import sys
from vllm_mamba_fix._log import logger
from vllm_mamba_fix.doctor import report
report.LogCapture.emit = lambda self, record: None
logger.disabled = True
from vllm_mamba_fix.doctor import main
raise SystemExit(main(["doctor", "--json", *sys.argv[1:]]))
"""


@pytest.mark.parametrize(
    ("vllm_version", "fake", "code", "status", "needle"),
    [
        ("0.25.1", {}, 0, "protected", None),
        ("0.27.1", {"signature": SPLIT_CHANGED}, 1, "not-protected", "unexpected signature"),
        ("0.32.0", {"encoder": ENCODER_CHANGED}, 1, "not-protected", "unexpected signature"),
        ("0.27.1", {"code": BACKPORT_CODE}, 0, "not-needed", None),
    ],
)
def test_verdict_does_not_depend_on_the_plugin_log(
    tmp_path: Path,
    vllm_version: str,
    fake: dict[str, str],
    code: int,
    status: str,
    needle: str | None,
) -> None:
    site = _fake_vllm(tmp_path / "site", vllm_version, **fake)
    silent = _run([sys.executable, "-c", _SILENT_DOCTOR], {"PYTHONPATH": str(site)})
    heard = _run(_doctor("--json"), {"PYTHONPATH": str(site)})
    quiet, loud = silent.json(), heard.json()
    assert quiet["dry_run"]["log"] == [] and loud["dry_run"]["log"]  # the silencing worked
    assert (silent.code, quiet["status"]) == (heard.code, loud["status"]) == (code, status)
    assert quiet["problems"] == loud["problems"]
    if needle is not None:
        assert needle in quiet["problems"][0]


# --- the verdict, from typed inputs --------------------------------------------------


def _policy_inputs(vllm_version: str) -> tuple[Any, Any]:
    family = family_for(vllm_version)
    return family, plan(Settings(), family, Evidence())


def test_needed_rules_follow_release_classes_and_speculative_method() -> None:
    from vllm_mamba_fix.doctor import verdict

    family, by_code = _policy_inputs("0.32.0")
    assert verdict.needed_rules(family, Mode.AUTO, by_code, False) == {Rule.SPECULATIVE_STALL}
    assert verdict.needed_rules(family, Mode.AUTO, by_code, True) == frozenset()
    by_class = verdict.needed_rules(family, Mode.AUTO, by_code, False, frozenset({Rule.SPLIT}))
    assert by_class == {Rule.SPLIT, Rule.SPECULATIVE_STALL}
    unknown, unknown_plan = _policy_inputs("not-a-version")
    assert verdict.needed_rules(unknown, Mode.AUTO, unknown_plan, False) == frozenset()
    assert verdict.needed_rules(unknown, Mode.FORCE, unknown_plan, False) == {Rule.SPLIT}


def test_problems_and_status_from_typed_inputs() -> None:
    from vllm_mamba_fix.doctor import verdict

    family, by_code = _policy_inputs("0.27.1")
    needed = verdict.needed_rules(family, Mode.OFF, by_code, False)
    chosen = verdict.policy(family, "0.27.1", needed, False, "disabled", by_code, "")
    assert chosen.verdict == "needed-will-not-patch"
    delivery = verdict.Delivery(Mode.OFF, "0", "no entry point", False, "other")
    rule_problems = {Rule.SPLIT: "split would not apply: x"}
    found = verdict.problems(chosen, delivery, rule_problems, ("class y",))
    assert found == [
        "disabled by VLLM_MAMBA_FIX='0'",
        "no entry point",
        "VLLM_PLUGINS='other' does not list 'mamba_fix'; vLLM will not load the plugin",
        "split would not apply: x",
        "class y",
    ]
    assert verdict.status(chosen, [], found) == "not-protected"
    assert verdict.status(chosen, ["bad"], found) == "invalid-input"
    ok = verdict.Delivery(Mode.AUTO, None, None, True, None)
    will = verdict.policy(family, "0.27.1", needed, True, "", by_code, "")
    assert verdict.problems(will, ok, {}, ()) == []
    assert verdict.status(will, [], []) == "protected"
    assert verdict.status(None, [], []) == "unknown"
    fixed, fixed_plan = _policy_inputs("0.33.0")
    none = verdict.needed_rules(fixed, Mode.AUTO, fixed_plan, False)
    calm = verdict.policy(fixed, "0.33.0", none, True, "", fixed_plan, "")
    assert (calm.verdict, verdict.status(calm, [], [])) == ("not-needed", "not-needed")


def test_doctor_modules_stay_small() -> None:
    sizes = {
        str(path.relative_to(PACKAGE_DIR / "doctor")): len(path.read_text().splitlines())
        for path in (PACKAGE_DIR / "doctor").rglob("*.py")
    }
    assert {"cli.py", "verdict.py", "render.py", "checks/schedulers.py"} <= set(sizes)
    assert not (PACKAGE_DIR / "doctor.py").exists()
    assert max(sizes.values()) < 400, sizes


# Another platform plugin assigns its own copy of the split onto the base class, as
# vllm-ascend v0.21.0rc1's vllm_ascend/patch/platform/patch_scheduler.py does.
STAND_IN_PLUGIN = """\
from vllm.v1.core.sched.scheduler import Scheduler


def _mamba_block_aligned_split(self, request, num_new_tokens, num_new_local_computed_tokens=0):
    return 0


Scheduler._mamba_block_aligned_split = _mamba_block_aligned_split


class PlatformScheduler(Scheduler):
    pass
"""


@pytest.mark.parametrize("order", ["after", "before"])
def test_a_split_another_plugin_assigns_is_wrapped_in_either_order(
    tmp_path: Path, order: str
) -> None:
    site = _fake_vllm(tmp_path / "site", "0.27.1")
    (site / "stand_in_plugin.py").write_text(STAND_IN_PLUGIN)
    if order == "before":  # assigned before the plugin patches (at interpreter start)
        (site / "sitecustomize.py").write_text("import stand_in_plugin\n")
    run = _run(
        _doctor("--json", "--scheduler-cls", "stand_in_plugin.PlatformScheduler"),
        {"PYTHONPATH": str(site)},
    )
    assert run.code == 0, run.out + run.err
    data = run.json()
    assert data["status"] == "protected"
    assert data["dry_run"]["via"] == ("import hook" if order == "after" else "immediate")
    by_class = {s["class"]: s for s in data["schedulers"]}
    states = set()
    for name in ("vllm.v1.core.sched.scheduler.Scheduler", "stand_in_plugin.PlatformScheduler"):
        split = next(
            m
            for m in by_class[name]["record"]["methods"]
            if m["name"] == "_mamba_block_aligned_split"
        )
        # Either way the split that runs is the plugin's wrapper around the stand-in's copy.
        assert split["wraps"] == "stand_in_plugin._mamba_block_aligned_split"
        assert by_class[name]["methods"]["_mamba_block_aligned_split"]["reached"] is True
        states.add(split["state"])
    # Assigned after the patch: the first class settled finds and wraps the replacement.
    assert states == ({"wrapped-replacement", "wrapped"} if order == "after" else {"wrapped"})
    assert data["dry_run"]["restored"] is True
