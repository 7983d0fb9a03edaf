"""Issue 44 item 2 on the real Scheduler: what one split call of the plugin runs.

``sys.setprofile`` records, for every split call vLLM makes while the harness steps a real
scheduler, the package files whose functions run between the wrapper's call and its return,
with vLLM's own answer and the wrapper's. A scheduler's first call, which settles it, is set
aside. A corrected call (the wrapper returns another answer than vLLM's) enters at most four
package files, the wrapper's own counted; a call vLLM answers with the whole chunk enters no
package file but the wrapper's. Both with the block sizes agreeing and with the block-unit
rule engaged (the configured block half the cache's).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import vllm_mamba_fix
from tools import scenarios as sc
from tools import sched_harness as harness
from tools.sched_harness import HarnessConfig, Mode, RequestSpec
from vllm_mamba_fix.facts.blocks import CacheConfigView
from vllm_mamba_fix.facts.versions import Family, Verdict

PACKAGE = str(Path(vllm_mamba_fix.__file__).resolve().parent) + "/"
WRAPPER_FILE = "rules/split_rule.py"
SETTLING_FILE = "rules/split_settle.py"
MOST_FILES = 4

# The block-unit rule engaged (tests/scheduler/test_block_units.py's reuse layout): cache
# block 256, configured 128 after the build, a budget above one block.
ENGAGED = HarnessConfig(
    block_size=256, configured_block_size=128, configured_after_build=True,
    max_num_batched_tokens=384, encoder_cache_tokens=256, max_model_len=2048,
)  # fmt: skip
ENGAGED_REQUESTS = (
    RequestSpec("two-images", 1100, ((300, 256), (558, 256)), max_tokens=2, seed=12),
    RequestSpec("mm-after-text", 1000, ((600, 256),), max_tokens=2, seed=11),
    RequestSpec("text", 900, max_tokens=2, seed=11),
)


@dataclass
class Call:
    asked: int
    files: set[str] = field(default_factory=set)
    vllm_answer: int | None = None  # the first answer of vLLM's split within the call
    answer: int | None = None  # the wrapper's

    @property
    def corrected(self) -> bool:
        return self.answer != self.vllm_answer

    @property
    def settling(self) -> bool:
        return SETTLING_FILE in self.files


@contextmanager
def traced_split_calls(scheduler: Any) -> Iterator[list[Call]]:
    """Every split call of ``scheduler``'s class while the block runs, as :class:`Call`."""
    wrapper = inspect.getattr_static(type(scheduler), "_mamba_block_aligned_split")
    wrapper_code, original_code = wrapper.__code__, wrapper.__wrapped__.__code__
    calls: list[Call] = []
    current: list[Call] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call":
            if code is wrapper_code and not current:
                current.append(Call(frame.f_locals["num_new_tokens"]))
            elif current and code.co_filename.startswith(PACKAGE):
                current[0].files.add(code.co_filename[len(PACKAGE) :])
        elif event == "return" and current:
            if code is original_code and current[0].vllm_answer is None:
                current[0].vllm_answer = arg
            elif code is wrapper_code:
                current[0].answer = arg
                current[0].files.add(WRAPPER_FILE)
                calls.append(current.pop())

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


def _split_rule_family(family: Family) -> None:
    if family.verdict is not Verdict.PATCH:
        pytest.skip(f"vLLM family {family.name}: the split rule is not installed")


def _assert_calls(calls: list[Call]) -> None:
    looked = [c for c in calls if not c.settling]
    corrected = [c for c in looked if c.corrected]
    assert corrected, "the workload made no correction: the test would prove nothing"
    for call in corrected:
        assert len(call.files) <= MOST_FILES, (call, sorted(call.files))
    whole = [c for c in looked if c.vllm_answer == c.asked]
    assert whole, "no whole chunk"
    for call in whole:
        if call.corrected:  # only the EAGLE remainder's wait (0.15-0.26 under MTP) changes one
            assert call.answer == 0, call
            continue
        assert call.files == {WRAPPER_FILE}, (call, sorted(call.files))


def test_a_corrected_call_enters_at_most_four_package_files(
    family: Family, sched_mode: Mode, load_plugin: Any
) -> None:
    _split_rule_family(family)
    assert load_plugin(), "the split rule is not installed"
    scenario = sc.TWO_IMAGES
    h = harness.Harness(sched_mode.apply(scenario.config))
    h.add(*scenario.specs)
    with traced_split_calls(h.scheduler) as calls:
        result = h.run(max_steps=60)
    assert result.completed, result.stall_at
    _assert_calls(calls)


def test_an_engaged_call_enters_no_more_files(
    family: Family, sched_mode: Mode, load_plugin: Any
) -> None:
    """The block-unit rule engaged: its view is the scheduler's; a call meets no more."""
    _split_rule_family(family)
    assert load_plugin(), "the split rule is not installed"
    try:
        h = harness.Harness(sched_mode.apply(dataclasses.replace(ENGAGED)))
    except (ValueError, harness.ModeUnsupported) as exc:
        pytest.skip(f"this release rejects the configuration: {exc}")
    h.add(*ENGAGED_REQUESTS)
    with traced_split_calls(h.scheduler) as calls:
        result = h.run(max_steps=80)
    assert result.completed, result.stall_at
    view = vars(h.scheduler)["cache_config"]
    assert isinstance(view, CacheConfigView) and view.block_size == 256, "not engaged"
    _assert_calls(calls)


def test_vllm_reads_the_engaged_view_without_package_code(
    sched_mode: Mode, load_plugin: Any
) -> None:
    """Every field of the view but its block is the live config's, read by vLLM with no
    package function running (0.34's ``update_from_output`` reads
    ``cache_config.enable_prefix_caching`` once per request; a proxy's ``__getattr__`` ran
    there on every read)."""
    load_plugin()  # the block-unit rule: every release with the split, 0.34 included
    try:
        h = harness.Harness(sched_mode.apply(dataclasses.replace(ENGAGED)))
    except (ValueError, harness.ModeUnsupported) as exc:
        pytest.skip(f"this release rejects the configuration: {exc}")
    h.add(*ENGAGED_REQUESTS)
    h.run(max_steps=3)
    view = vars(h.scheduler)["cache_config"]
    real = h.scheduler.vllm_config.cache_config  # the scheduler's own, beneath the view
    assert isinstance(view, CacheConfigView), "not engaged"
    names = [f.name for f in dataclasses.fields(real) if f.name != "block_size"]
    entered: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            entered.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        read = [getattr(view, name) for name in names]
    finally:
        sys.setprofile(None)
    assert not entered, f"package code ran on vLLM's reads: {sorted(set(entered))}"
    assert read == [getattr(real, name) for name in names]
    assert isinstance(view, type(real))  # what vLLM may check of its config
    assert (view.block_size, real.block_size) == (256, 128)
    real.num_gpu_blocks_override = 7  # a change of the live config reads through
    assert view.num_gpu_blocks_override == 7
