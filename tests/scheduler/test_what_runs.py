"""Issue 20 item 4: the record and the active line say exactly what runs, on the real scheduler.

- a scheduler without Mamba KV cache groups: no warning, no "carries split", idle in its record;
- the same class built twice: one active line, one settlement;
- a scheduler built before the plugin loaded: its record, line and block unit at its first split;
- a subclass whose own schedule() splits first (a backport of #51603 onto this release) gets a
  wrapper of its own with only the rules its code needs, and no split correction runs on it.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from tests.active_line import parse_active
from tests.platforms.layout import CONFIG, REQUEST
from tests.platforms.old_order import build_old_order_subclass
from tools import sched_harness as harness
from tools.sched_harness import HarnessConfig, RequestSpec
from vllm_mamba_fix import records, stats
from vllm_mamba_fix.decide.policy import Rule
from vllm_mamba_fix.facts.targets import SPLIT_METHOD
from vllm_mamba_fix.facts.versions import Family, Verdict
from vllm_mamba_fix.observe.record import ClassRecord, MethodState
from vllm_mamba_fix.rules.table import SPLIT_RULES

BASE = "vllm.v1.core.sched.scheduler.Scheduler"
SMALL = HarnessConfig(block_size=256, max_num_batched_tokens=384, encoder_cache_tokens=256,
                      max_model_len=2048)  # fmt: skip
TWO_IMAGES = RequestSpec("two", 537, ((1, 256), (259, 256)), max_tokens=2)


def _record(name: str) -> ClassRecord:
    (found,) = [r for r in records() if r.scheduler_class == name]
    return found


def _active(log: list[str], name: str) -> list[str]:
    return [m for m in log if f" active: {name} carries" in m]


def test_a_scheduler_without_mamba_groups_gets_no_split_line(
    load_plugin, vllm_log: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    load_plugin()  # 0.28+: only the block-unit rule wraps the split
    built = harness.build_scheduler(dataclasses.replace(SMALL, attention_only=True))
    assert built.scheduler.need_mamba_block_aligned_split is False
    found = _record(BASE)
    assert found.split_idle is not None and "never calls the split" in found.split_idle
    assert not found.rules & {Rule.SPLIT, Rule.BLOCK_UNIT}
    assert found.plan.rules & SPLIT_RULES <= found.left_out  # planned, never called
    plugin_warnings = [
        r.getMessage() for r in caplog.records
        if r.name.startswith("vllm.mamba_fix") and r.levelno >= logging.WARNING
    ]  # fmt: skip
    assert plugin_warnings == []
    lines = [m for m in vllm_log if " active: " in m or "not needed for" in m]
    assert len(lines) == 1, lines
    parsed = parse_active(lines[0])
    if parsed is None:  # no rule runs at all: the not-needed line says why
        assert "split rules idle" in lines[0] and "carries split" not in lines[0], lines[0]
    else:
        assert not {"split", "block-unit"} & set(parsed.rules), lines[0]
        assert "split rules idle" in parsed.notes, lines[0]


def test_the_same_class_built_twice_logs_one_line(
    family: Family, load_plugin, vllm_log: list[str], tmp_path: Path
) -> None:
    load_plugin()  # 0.28+: only the block-unit rule wraps the split
    classes = [BASE]
    cfg = SMALL
    if family.verdict is Verdict.PATCH:  # a subclass whose wrapper is its own
        subclass = build_old_order_subclass(tmp_path, reverse=True)
        classes.append(f"{subclass.__module__}.{subclass.__qualname__}")
        harness.build_scheduler(SMALL)
        cfg = dataclasses.replace(SMALL, scheduler_cls=subclass)
    harness.build_scheduler(cfg)
    first = _record(classes[-1])
    harness.build_scheduler(cfg)
    for name in classes:
        assert len(_active(vllm_log, name)) == 1, vllm_log
    assert _record(classes[-1]).methods == first.methods  # no note flips on the second build
    if len(classes) > 1:
        assert "installed on NewOrderScheduler only" in first.method(SPLIT_METHOD).note


def test_a_scheduler_built_before_the_plugin_is_met_at_its_first_split(
    family: Family, load_plugin, vllm_log: list[str]
) -> None:
    run = harness.Harness(SMALL)  # stock: the plugin loads only after this scheduler exists
    assert not [r for r in records() if r.block is not None]
    load_plugin()  # 0.28+: only the block-unit rule wraps the split
    run.add(TWO_IMAGES)
    result = run.run()
    if family.verdict is Verdict.PATCH:
        assert result.completed, result.stall_at
    found = _record(BASE)
    assert found.block is not None and found.block.mamba == run.built.block_size
    assert len(_active(vllm_log, BASE)) == 1, vllm_log


def test_a_backported_new_order_subclass_gets_only_its_own_rules(
    family: Family, load_plugin, tmp_path: Path
) -> None:
    if family.verdict is not Verdict.PATCH:
        pytest.skip(f"family {family.name}: the base itself splits first")
    subclass = build_old_order_subclass(tmp_path, reverse=True)
    name = f"{subclass.__module__}.{subclass.__qualname__}"
    load_plugin()  # 0.28+: only the block-unit rule wraps the split
    harness.run_requests([REQUEST], CONFIG)  # the base first: its wrapper carries the split rule
    before = stats()
    result = harness.run_requests([REQUEST], dataclasses.replace(CONFIG, scheduler_cls=subclass))
    split = _record(name).method(SPLIT_METHOD)
    assert split is not None and split.state is MethodState.WRAPPED
    assert split.owner == name and split.rules == {Rule.BLOCK_UNIT}, split
    assert Rule.SPLIT not in _record(name).rules and not _record(name).inherited
    assert Rule.SPLIT in _record(BASE).rules
    after = stats()
    deadlock_keys = ("collapses_prevented", "chunks_stopped_at_encoder_input")
    assert all(after[k] == before[k] for k in deadlock_keys), (before, after)
    assert result.completed, result.stall_at  # the backported order needs no rule
