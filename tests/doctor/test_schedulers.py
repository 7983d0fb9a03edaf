"""The dry run (doctor/checks/schedulers.py): patch, settle and verify each scheduler class,
undo; per class what it carries, what it overrides, what it inherits, and signatures that no
longer match."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.doctor.conftest import (
    _VLLM,
    ENCODER_CHANGED,
    SPLIT_CHANGED,
    UPDATE_CODE,
    Run,
    _doctor,
    _fake_run,
    _fake_vllm,
    _needed_by_version,
    _rules,
    _run,
    needs_affected_vllm,
)


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
        # The watchdog and the stall end ride update_from_output (issue 44): only the
        # speculative-stall rule is lost.
        assert named and "; speculative-stall does not reach it" in named[0], named
    else:  # no rule of the encoder check is needed there
        assert not named
    # One typed record per class given, and the dry run undid what settling them wrapped.
    states = {
        s["class"].rsplit(".", 1)[1]: {m["name"]: m["state"] for m in s["record"]["methods"]}
        for s in data["schedulers"]
    }
    split, encoder = "_mamba_block_aligned_split", "_try_schedule_encoder_inputs"
    update = "update_from_output"
    assert states["OverridingScheduler"][split] == "overridden"
    # The watchdog and the stall end ride update_from_output (issue 44), which it does not
    # override: they still reach it.
    assert states["EncoderOverridingScheduler"] == {
        split: "wrapped", encoder: "overridden", update: "wrapped",
    }  # fmt: skip
    assert states["InheritingScheduler"] == dict.fromkeys((split, encoder, update), "wrapped")
    assert data["dry_run"]["restored"] is True


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
    site = _fake_vllm(tmp_path / "site", "0.32.0", code=UPDATE_CODE)  # the watchdog's carrier
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
