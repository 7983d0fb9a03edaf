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
from vllm_mamba_fix.decide.policy import Rule
from vllm_mamba_fix.doctor import (
    FALLBACK_METHODS,
    SpeculativeMethods,
    classify_speculative,
)
from vllm_mamba_fix.doctor.checks.speculative import OWN_KV_GROUP_TEXT
from vllm_mamba_fix.facts.config import ALL_VARIABLES, Mode, Settings
from vllm_mamba_fix.facts.evidence import Evidence
from vllm_mamba_fix.facts.versions import Verdict, family_for
from vllm_mamba_fix.rules.table import plan

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "vllm_mamba_fix"
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


@needs_affected_vllm
def test_both_evidences_are_shown_and_the_code_decides(real: dict[str, Run]) -> None:
    data = real["json"].json()
    evidence = data["evidence"]
    assert evidence["read_from"] == "vllm.v1.core.sched.scheduler.Scheduler"
    assert evidence["split_after_encoder"] is True  # every affected release: the matrix agrees
    rules = {r["rule"]: r for r in data["rules"]}
    # The rule table's order; block-unit and stall-end were added to it (issues 20, 21).
    assert list(rules) == [
        "split", "block-unit", "speculative-stall", "stall-watchdog", "stall-end",
    ]  # fmt: skip
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
    assert dry["wrapped_methods"] == [
        "_mamba_block_aligned_split", "_try_schedule_encoder_inputs", "update_from_output",
    ]  # fmt: skip
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
            "update_from_output": ("wrapped", stock, f"{stock}.update_from_output"),
        }  # fmt: skip
        # block-unit rides the split's wrapper and stall-end the update's, on by default.
        expected_rules = {*_needed_by_version(_VLLM), "block-unit", "stall-watchdog", "stall-end"}
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
        # stall-end rides the encoder wrapper too (issue 21); named in table order.
        assert (
            named
            and "speculative-stall, stall-watchdog and stall-end do not reach it" in (named[0])
        )
    else:  # only the watchdog is lost: a warning
        assert not named
    # One typed record per class given, and the dry run undid what settling them wrapped.
    states = {
        s["class"].rsplit(".", 1)[1]: {m["name"]: m["state"] for m in s["record"]["methods"]}
        for s in data["schedulers"]
    }
    split, encoder = "_mamba_block_aligned_split", "_try_schedule_encoder_inputs"
    update = "update_from_output"
    assert states["OverridingScheduler"][split] == "overridden"
    # Its ends would never be ordered: the update wrapper is taken off it too.
    assert states["EncoderOverridingScheduler"] == {
        split: "wrapped", encoder: "overridden", update: "stock",
    }  # fmt: skip
    assert states["InheritingScheduler"] == dict.fromkeys((split, encoder, update), "wrapped")
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


@pytest.mark.parametrize(
    ("vllm_version", "family", "needed", "wrapped"),
    [
        ("0.25.1", "0.24", ["split", "speculative-stall"], 2),
        # 0.28-0.32: upstream fixed the split, not the speculative stall. The split is still
        # wrapped, for the block-unit rule (vLLM #54076), on every release that has it.
        ("0.32.0", "0.28", ["speculative-stall"], 2),
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
    # The block-unit rule still installs, so never "not needed": it engages at engine start.
    assert (data["status"], data["exit_code"]) == ("protected", 0)
    assert data["policy"]["verdict"] == "installed-per-scheduler"
    assert data["evidence"]["split_after_encoder"] is False
    assert data["evidence"]["deferred_encoder_free"] is False
    rules = _rules(data)
    for name in ("split", "speculative-stall"):
        assert rules[name]["version"]["active"] is True and rules[name]["code"]["active"] is False
        assert (rules[name]["decided_by"], rules[name]["active"]) == ("code", False)
    assert "the version alone would have patched (a backport)" in data["summary"]
    # Only the block-unit rule's wrapper: a backport still floors to cache_config.block_size.
    assert data["dry_run"]["wrapped_methods"] == ["_mamba_block_aligned_split"]
    assert _rules(data)["block-unit"]["installs"] is True
    assert _rules(data)["block-unit"]["needed"] is None  # no scheduler built: cannot tell


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
    ("vllm_version", "family", "status", "needle"),
    [
        # Only the block-unit rule installs there: what runs is said, never "not needed".
        ("0.33.0", "0.33+", "protected", "vLLM 0.33.0 needs no rule by its code or version"),
        ("0.14.1", "<0.15", "not-needed", "no Scheduler."),
    ],
)
def test_unaffected_release_is_not_needed(
    tmp_path: Path, vllm_version: str, family: str, status: str, needle: str
) -> None:
    run = _fake_run(tmp_path, vllm_version, "--json")
    assert run.code == 0, run.err
    data = run.json()
    assert (data["status"], data["family"]["name"]) == (status, family)
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


DFLASH = (
    '{"method": "dflash", "model": "z-lab/Qwen3.5-35B-A3B-DFlash", "num_speculative_tokens": 8}'
)


@pytest.mark.parametrize(
    ("env", "code", "status", "line"),
    [
        ({}, 0, "protected", "the rule will engage at engine start"),
        ({"VLLM_MAMBA_FIX_BLOCK_RULE": "0"}, 1, "not-protected", "nothing aligns"),
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
    assert f"the two block sizes will differ: --speculative-config dflash: {OWN_KV_GROUP_TEXT}" in (
        human.out
    )
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
        "settings.other_env",
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
        # dry_run.error is now null here: the block-unit rule installs on 0.33 too.
        ("0.33.0", {}, (), 0, "protected", frozenset({"dry_run.error"}), frozenset()),
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
    # The subclass gets its own wrapper carrying the split rule; the fixed base keeps one
    # that carries only the block-unit rule (which wraps the split on every release).
    assert (split["state"], split["owner"]) == ("wrapped", name)
    assert split["rules"] == ["block-unit", "split"]
    base = next(s for s in data["schedulers"] if s["class"].endswith(".scheduler.Scheduler"))
    base_split = next(
        m for m in base["record"]["methods"] if m["name"] == "_mamba_block_aligned_split"
    )
    assert (base_split["state"], base_split["rules"]) == ("wrapped", ["block-unit"])
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
        ("0.27.1", {"code": BACKPORT_CODE}, 0, "protected", None),
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
    # A per-scheduler rule that installs: protected (exit 0), never "not needed".
    block = frozenset({Rule.BLOCK_UNIT})
    runs = verdict.policy(fixed, "0.33.0", none, True, "", fixed_plan, "", None, block)
    assert (runs.verdict, verdict.status(runs, [], [])) == ("installed-per-scheduler", "protected")
    assert "installed: block-unit [version: " in runs.reason
    assert verdict.status(runs, [], ["x"]) == "not-protected"
    # ... unless the plugin will not act at all (VLLM_MAMBA_FIX=0).
    off = verdict.policy(fixed, "0.33.0", none, False, "", fixed_plan, "", None, block)
    assert off.verdict == "not-needed"


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


# --- the rule table: switches, the new rules, what runs per class ----------------------


def test_settings_show_every_variable_and_the_rule_switches(tmp_path: Path) -> None:
    site = _fake_vllm(tmp_path / "site", "0.27.1", code=UPDATE_CODE)
    env = {"PYTHONPATH": str(site), "VLLM_MAMBA_FIX_END_STALLS_AFTER": "5"}
    data = _run(_doctor("--json"), env).json()
    settings = data["settings"]
    assert list(settings["env"]) == list(ALL_VARIABLES)  # the config's own list, in order
    assert settings["env"]["VLLM_MAMBA_FIX_END_STALLS_AFTER"] == "5"
    assert settings["end_stalls_after"] == 5.0
    assert settings["switches"] == {
        "VLLM_MAMBA_FIX_SPLIT_RULE": {"rule": "split", "on": True},
        "VLLM_MAMBA_FIX_BLOCK_RULE": {"rule": "block-unit", "on": True},
    }
    stall_end = _rules(data)["stall-end"]
    assert (stall_end["active"], stall_end["installs"], stall_end["needed"]) == (True, True, None)
    assert stall_end["switch"] == "VLLM_MAMBA_FIX_END_STALLS_AFTER"
    human = _run(_doctor(), {**env, "VLLM_MAMBA_FIX_BLOCK_RULE": "maybe"}).out
    assert "a stall no rule can end is ended 5 s after it is named" in human
    assert "rule switches: VLLM_MAMBA_FIX_SPLIT_RULE on (split), VLLM_MAMBA_FIX_BLOCK_RULE on" in (
        human
    )
    assert "invalid value: VLLM_MAMBA_FIX_BLOCK_RULE='maybe'" in human
    off = _run(_doctor("--json"), {**env, "VLLM_MAMBA_FIX_END_STALLS_AFTER": "off"}).json()
    assert off["settings"]["end_stalls_after"] is None
    assert (off["status"], _rules(off)["stall-end"]["active"]) == ("protected", False)


def test_a_needed_rule_switched_off_is_not_protected(tmp_path: Path) -> None:
    site = _fake_vllm(tmp_path / "site", "0.27.1")
    run = _run(_doctor("--json"), {"PYTHONPATH": str(site), "VLLM_MAMBA_FIX_SPLIT_RULE": "0"})
    assert run.code == 1, run.err
    data = run.json()
    assert data["status"] == "not-protected"
    assert data["problems"] == ["split is switched off by VLLM_MAMBA_FIX_SPLIT_RULE=0"]
    split = _rules(data)["split"]
    assert (split["needed"], split["active"], split["decided_by"]) == (True, False, "setting")
    # The rest still installs: the block-unit rule on the split, the encoder rules.
    assert data["dry_run"]["wrapped_methods"] == [
        "_mamba_block_aligned_split", "_try_schedule_encoder_inputs",
    ]  # fmt: skip
    assert _rules(data)["block-unit"]["installs"] is True


def test_block_rule_switched_off_on_0_33_warns_and_leaves_the_base_recorded(
    tmp_path: Path,
) -> None:
    site = _fake_vllm(tmp_path / "site", "0.33.0")
    run = _run(_doctor("--json"), {"PYTHONPATH": str(site), "VLLM_MAMBA_FIX_BLOCK_RULE": "off"})
    assert run.code == 0, run.err
    data = run.json()
    # Nothing 0.33 is known to need: a mismatch shows only on a built scheduler.
    assert (data["status"], data["problems"]) == ("not-needed", [])
    block = _rules(data)["block-unit"]
    assert (block["active"], block["needed"], block["installs"]) == (False, None, False)
    assert block["reason"] == "VLLM_MAMBA_FIX_BLOCK_RULE=0" and block["block_facts"] == []
    assert any(
        w.startswith("block-unit will not run") and "pin --block-size" in w
        for w in data["warnings"]
    )
    assert data["dry_run"]["wrapped_methods"] == []
    # The base class is recorded though nothing was installed: doctor reads its plan.
    base = next(s for s in data["schedulers"] if s["class"].endswith(".scheduler.Scheduler"))
    assert base["record"]["rules"] == [] and base["record"]["left_out"] == []
    assert data["dry_run"]["error"].startswith("no rule to install: split [")


def test_block_rule_on_0_33_is_installed_and_engages_at_engine_start(tmp_path: Path) -> None:
    run = _fake_run(tmp_path, "0.33.0")
    assert run.code == 0, run.err
    assert "NOT NEEDED" not in run.out  # a rule installs: never "not needed"
    assert "result: PROTECTED: vLLM 0.33.0 needs no rule by its code or version" in run.out
    assert "policy            installed, engages per scheduler:" in run.out
    assert "block-unit        active, by version:" in run.out
    assert (
        "installed; it engages at engine start for each scheduler whose Mamba KV cache block "
        "differs from cache_config.block_size"
    ) in run.out
    assert "patched Scheduler._mamba_block_aligned_split on import" in run.out
    assert "block-unit will not run" not in run.out


NEW_UNDER_OLD = (
    OLD_ORDER_SCHEDULER
    + """

class NewUnderOld(OldOrderScheduler):
    def schedule(self):
        n = self._mamba_block_aligned_split(None, 8)
        return self._try_schedule_encoder_inputs(None, 0, n, 8)[1]
"""
)


def test_a_class_settled_before_its_base_got_a_wrapper_reports_what_it_inherits(
    tmp_path: Path,
) -> None:
    site = _fake_vllm(tmp_path / "site", "0.32.0")
    (site / "platform_sched.py").write_text(NEW_UNDER_OLD)
    # The subclass first: settled while its base still had no wrapper of its own.
    names = ("platform_sched.NewUnderOld", "platform_sched.OldOrderScheduler")
    args = [arg for name in names for arg in ("--scheduler-cls", name)]
    env = {"PYTHONPATH": str(site)}
    data = _run(_doctor("--json", *args), env).json()
    assert data["status"] == "protected"
    record = next(s for s in data["schedulers"] if s["class"] == names[0])["record"]
    # Its own code splits first, so its plan leaves the split rule out; the wrapper it
    # resolves (OldOrderScheduler's) carries it, and that is what runs.
    assert record["inherited"] == ["split"] and "split" in record["rules"]
    split = next(m for m in record["methods"] if m["name"] == "_mamba_block_aligned_split")
    assert (split["owner"], split["rules"]) == (names[1], ["block-unit", "split"])
    human = _run(_doctor(*args), env).out
    assert f"inherits split from {names[1]}'s wrapper" in human


# Builds real schedulers first (the plugin loaded as vLLM loads it), then runs doctor in
# the same process: one with the Mamba KV cache block (256) above cache_config.block_size
# (128), as vLLM #54076 reports; an AsyncScheduler over attention layers only.
_BUILT_THEN_DOCTOR = """\
import json, sys
from tools import sched_harness as harness
from tools.sched_harness import HarnessConfig
harness.load_plugins()
small = dict(block_size=256, max_num_batched_tokens=192, encoder_cache_tokens=256,
             max_model_len=1024)
harness.build_scheduler(HarnessConfig(configured_block_size=128, **small))
harness.build_scheduler(HarnessConfig(async_scheduling=True, attention_only=True, **small))
from vllm_mamba_fix.doctor import run
from vllm_mamba_fix.doctor.render import render_text
report = run()
with open(sys.argv[1], "w") as out:
    json.dump({"data": report.data, "text": render_text(report, 0.0)}, out, default=str)
"""


@needs_affected_vllm
@pytest.mark.parametrize("block_rule", ["on", "0"])
def test_a_built_schedulers_block_sizes_decide_the_block_rule(
    tmp_path: Path, block_rule: str
) -> None:
    out = tmp_path / "doctor.json"
    run = _run(
        [sys.executable, "-c", _BUILT_THEN_DOCTOR, str(out)],
        {"VLLM_MAMBA_FIX_BLOCK_RULE": block_rule, "PYTHONPATH": str(REPO)},
        cwd=REPO,
    )
    assert run.code == 0, run.err[-3000:]
    found = json.loads(out.read_text())
    data, text = found["data"], found["text"]
    sched = "vllm.v1.core.sched.scheduler.Scheduler"
    block = _rules(data)["block-unit"]
    facts = {f["class"].rsplit(".", 1)[1]: f for f in block["block_facts"]}
    assert (facts["Scheduler"]["block_size"], facts["Scheduler"]["cache_config_block_size"]) == (
        256,
        128,
    )
    assert facts["AsyncScheduler"]["split_idle"]  # no Mamba layers: vLLM never calls the split
    assert block["needed"] is True and block["needed_by_classes"] == [sched]
    assert data["dry_run"]["already_active"] and "left in place" in text
    idle = next(s for s in data["schedulers"] if s["class"].endswith("AsyncScheduler"))
    assert idle["record"]["split_idle"]
    idle_rules = "split and block-unit" if block_rule == "on" else "split"
    assert f"split rules idle ({idle_rules}): vLLM never calls the split here" in text
    if block_rule == "on":
        assert (data["status"], facts["Scheduler"]["engaged"]) == ("protected", True)
        assert "block-unit" in data["policy"]["needed_rules"]
        assert f"block-unit (by the block sizes of the built {sched})" in data["policy"]["reason"]
        assert f"engaged for {sched}: the Mamba KV cache stores 256-token blocks" in text
    else:  # the mismatch is seen and the rule is off: not protected
        assert (data["status"], facts["Scheduler"]["engaged"]) == ("not-protected", False)
        assert "block-unit is switched off by VLLM_MAMBA_FIX_BLOCK_RULE=0" in data["problems"]
        assert f"NOT engaged for {sched}" in text


def test_doctor_reads_the_tables_and_plans_only_in_plans() -> None:
    """The environment only through config; plan() called only by doctor/plans.py."""
    import ast

    offenders = []
    for path in sorted((PACKAGE_DIR / "doctor").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            name = str(path.relative_to(PACKAGE_DIR))
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                offenders.append(f"{name}:{node.lineno} reads the environment")
            if (
                isinstance(node, ast.ImportFrom)
                and node.module == "vllm_mamba_fix.rules.table"
                and any(alias.name == "plan" for alias in node.names)
                and path.name != "plans.py"
            ):
                offenders.append(f"{name}:{node.lineno} plans again")
    assert offenders == []


# The two support checks read other modules; without them (an ImportError) each is one
# info line and the verdict stands.
_WITHOUT_SUPPORT_MODULES = """\
import sys
from vllm_mamba_fix.doctor.checks import metrics, stall_end
# As a build without the two modules: importing them raises ImportError.
metrics.MODULE = "vllm_mamba_fix.no_such_metrics"
stall_end.MODULE = "vllm_mamba_fix.no_such_stall_end"
from vllm_mamba_fix.doctor import main
raise SystemExit(main(["doctor", *sys.argv[1:]]))
"""


def test_support_checks_without_their_modules_are_info_lines(tmp_path: Path) -> None:
    site = _fake_vllm(tmp_path / "site", "0.27.1")
    env = {"PYTHONPATH": str(site)}
    data = _run([sys.executable, "-c", _WITHOUT_SUPPORT_MODULES, "--json"], env).json()
    assert (data["status"], data["exit_code"]) == ("protected", 0)
    assert data["metrics"]["checked"] is False and data["stall_end"]["checked"] is False
    human = _run([sys.executable, "-c", _WITHOUT_SUPPORT_MODULES], env).out
    assert "metrics           not checked: this build has no metrics module" in human
    assert "ending stalls     not checked: this build has no stall_end module" in human


@pytest.mark.skipif(
    not (PACKAGE_DIR / "observe" / "metrics.py").exists()
    or not (PACKAGE_DIR / "rules" / "end_order.py").exists(),
    reason="needs vllm_mamba_fix.observe.metrics and vllm_mamba_fix.rules.end_order",
)
def test_support_checks_read_the_release(tmp_path: Path) -> None:
    # The fake release has neither vLLM's prometheus registry nor update_from_output.
    data = _fake_run(tmp_path, "0.27.1", "--json").json()
    assert data["status"] == "protected"  # support lines never change the verdict
    assert data["metrics"]["checked"] is True and data["metrics"]["available"] is False
    assert "get_prometheus_registry" in data["metrics"]["reason"]
    classes = data["stall_end"]["classes"]
    assert set(classes) == {
        "vllm.v1.core.sched.scheduler.Scheduler",
        "vllm.v1.core.sched.async_scheduler.AsyncScheduler",
    }
    assert all("update_from_output" in why for why in classes.values())
