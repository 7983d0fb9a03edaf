"""Another plugin assigns its own copy of the split onto ``Scheduler`` (issue 16), on 0.27.1.

Mirrors vllm-ascend v0.21.0rc1 and v0.22.1rc1, vllm_ascend/patch/platform/patch_scheduler.py,
which assigns ``Scheduler._mamba_block_aligned_split = <its copy>``, with the same floor to 0.
The stand-in plugin's copy is vLLM's own function, compiled in the stand-in's module.

Both load orders must end the same way: the issue layout completes, and what happened is
said (the active line names the copy it wraps, or a warning names the replacing module).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import facts_of
from tools import scenarios as sc
from tools import sched_harness as harness
from tools.release_facts import facts_for
from vllm_mamba_fix.facts.targets import MARKER, SPLIT_METHOD
from vllm_mamba_fix.facts.versions import family_for
from vllm_mamba_fix.observe import record
from vllm_mamba_fix.observe.record import MethodState

STAND_IN = "ascend_style_patch_scheduler"
BASE = "vllm.v1.core.sched.scheduler.Scheduler"
SCENARIO = sc.TWO_IMAGES


@pytest.fixture
def scheduler_cls() -> type:
    if not facts_for(family_for(harness.vllm_version())).image_deadlock:
        pytest.skip("the stand-in's copy floors like 0.27 and earlier; this vLLM is fixed")
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


@pytest.fixture
def assign_copy(scheduler_cls: type, tmp_path: Path) -> Iterator[Callable[[], Any]]:
    """Write the stand-in plugin; yields its ``apply()`` (the assignment). Restores vLLM's own."""
    vllms_own = scheduler_cls.__dict__[SPLIT_METHOD]
    assert not hasattr(vllms_own, MARKER)
    source = textwrap.dedent(inspect.getsource(vllms_own))
    (tmp_path / f"{STAND_IN}.py").write_text(
        '"""Stand-in for vllm-ascend patch/platform/patch_scheduler.py '
        '(v0.21.0rc1, v0.22.1rc1)."""\n'
        "from __future__ import annotations\n\n"
        "from vllm.v1.core.sched import scheduler as _vllm_scheduler\n\n"
        "globals().update({k: v for k, v in vars(_vllm_scheduler).items() "
        "if not k.startswith('__')})\n\n\n"
        f"{source}\n\n"
        "def apply() -> None:\n"
        f"    _vllm_scheduler.Scheduler.{SPLIT_METHOD} = {SPLIT_METHOD}\n"
    )  # fmt: skip
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module(STAND_IN).apply
    finally:
        harness.unload_plugin()
        setattr(scheduler_cls, SPLIT_METHOD, vllms_own)
        sys.modules.pop(STAND_IN, None)
        sys.path.remove(str(tmp_path))


def _run() -> harness.RunResult:
    return harness.run_requests(
        SCENARIO.requests,
        SCENARIO.config,
        max_steps=SCENARIO.max_steps,
        stall_steps=SCENARIO.stall_steps,
    )


def _base_split() -> record.MethodRecord:
    base = next(r for r in record.records() if r.scheduler_class == BASE)
    method = base.method(SPLIT_METHOD)
    assert method is not None
    return method


def test_the_stand_in_copy_stalls_like_vllms_own(assign_copy: Callable[[], Any]) -> None:
    assign_copy()
    result = _run()
    assert result.stalled and not result.completed, result.chunks


def test_copy_assigned_before_the_plugin_is_wrapped(
    assign_copy: Callable[[], Any], scheduler_cls: type, plugin_log: pytest.LogCaptureFixture
) -> None:
    assign_copy()
    harness.load_plugins()
    result = _run()
    assert result.completed, result.stall_at
    split = _base_split()
    assert split.state is MethodState.WRAPPED
    assert split.wraps == f"{STAND_IN}.{SPLIT_METHOD}"
    installed = scheduler_cls.__dict__[SPLIT_METHOD]
    assert hasattr(installed, MARKER) and installed.__wrapped__.__module__ == STAND_IN
    active = [r for r in plugin_log.records if " active: " in r.getMessage()]
    # The line names the rule; the fields name the stand-in's method it wraps.
    assert any(
        f"active: {BASE} carries split" in r.getMessage()
        and any(STAND_IN in w for w in facts_of(r)["wraps"])
        for r in active
    ), [r.getMessage() for r in active]


def test_copy_assigned_after_the_plugin_is_wrapped_and_named(
    assign_copy: Callable[[], Any], scheduler_cls: type, plugin_log: pytest.LogCaptureFixture
) -> None:
    harness.load_plugins()
    assert harness.split_rule_installed()
    assign_copy()  # our wrapper is gone from Scheduler
    assert not hasattr(scheduler_cls.__dict__[SPLIT_METHOD], MARKER)
    result = _run()
    assert result.completed, result.stall_at
    split = _base_split()
    assert split.state is MethodState.WRAPPED_REPLACEMENT
    assert split.wraps == f"{STAND_IN}.{SPLIT_METHOD}"
    assert STAND_IN in split.note
    warnings = [r.getMessage() for r in plugin_log.records if r.levelname == "WARNING"]
    assert any(STAND_IN in m and SPLIT_METHOD in m for m in warnings), warnings
