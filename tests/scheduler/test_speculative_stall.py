"""Issue 11 on the real scheduler: the EAGLE encoder-cache deadlock, and the stall watchdog.

Under EAGLE-type speculation (here a real MTP K=2 config) vLLM cuts an
encoder-limited chunk one look-ahead before the next image and, on 0.24-0.32,
frees an image only one look-ahead past its end. Two images fewer than 2
tokens apart that do not fit the encoder cache together then park the request
for good. The plugin ends that on 0.24-0.32; before 0.24 (the model runner
asserts on any encoder-cache miss) its watchdog names the stall instead.

Expectations come from the family (vllm_mamba_fix.facts.versions) and the mode.
"""

from __future__ import annotations

from typing import Any

import pytest

from tools import sched_harness as harness
from tools.release_facts import facts_for
from tools.scenarios import ISSUE_CONFIG, image_request, text_request
from tools.sched_harness import Mode, RunResult
from vllm_mamba_fix.facts.versions import Family, release_of

GAPS = (0, 1, 2)


def _encoder_is_wrapped() -> bool:
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_mamba_fix.facts import targets
    from vllm_mamba_fix.install import patch

    return patch.is_wrapped(Scheduler, targets.ENCODER_METHOD)


def _run(mode: Mode, gap: int) -> RunResult:
    # The text request is scheduled beside the image request and finishes early:
    # its chunks must equal stock's.
    h = harness.Harness(mode.apply(ISSUE_CONFIG))
    h.add(text_request("spec-text", 3000), image_request("spec-image", (5, gap, 200)))
    return h.run(max_steps=120, stall_steps=10)


def _speculative(mode: Mode) -> Mode:
    if not mode.speculative:
        pytest.skip(f"{mode}: no speculative decoding, no look-ahead stall")
    return mode


def _speculative_stall_on_stock(family: Family, gap: int) -> bool:
    """The look-ahead stall, whatever the split does: the deferred free parks
    gaps 0-1 (0.24-0.32); without it, the shifted cut alone parks gap 0."""
    release = release_of(harness.vllm_version()) or (0, 0, 0)
    if family.deferred_encoder_free:
        return gap < 2
    return gap == 0 and release < (0, 33, 0)


@pytest.mark.parametrize("gap", GAPS)
def test_stock(family: Family, sched_mode: Mode, gap: int) -> None:
    mode = _speculative(sched_mode)
    result = _run(mode, gap)
    expected = facts_for(family).image_deadlock or _speculative_stall_on_stock(family, gap)
    assert result.completed is not expected, (gap, result.stall_at, result.chunks)
    if expected:
        assert "spec-image" in result.stall_at


@pytest.mark.parametrize("gap", GAPS)
def test_plugin(family: Family, sched_mode: Mode, gap: int, load_plugin: Any) -> None:
    mode = _speculative(sched_mode)
    stock = _run(mode, gap)
    active = load_plugin()
    if not active and not _encoder_is_wrapped():
        assert not _speculative_stall_on_stock(family, gap) and not facts_for(family).image_deadlock
        pytest.skip(f"family {family.name}: nothing to do by default")
    patched = _run(mode, gap)
    if _speculative_stall_on_stock(family, gap) and not family.drafter_fallback:
        # Before 0.24 the plugin leaves it alone (see test_watchdog_names_the_stall).
        assert not patched.completed
        return
    assert patched.completed, (gap, patched.stall_at, patched.chunks)
    assert patched.violations() == []
    assert patched.spans("spec-text") == stock.spans("spec-text")


def test_watchdog_names_the_stall(
    family: Family,
    sched_mode: Mode,
    load_plugin: Any,
    vllm_log: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mode = _speculative(sched_mode)
    if not _speculative_stall_on_stock(family, 0) or family.drafter_fallback:
        pytest.skip(f"family {family.name}: the plugin ends this stall or there is none")
    from tests.stall_end_helpers import install_clock

    monkeypatch.setenv("VLLM_MAMBA_FIX_STALL_SECONDS", "0")
    # The watchdog samples once a second of its clock: 2 s per reading, every step.
    install_clock(monkeypatch, per_call=2.0)
    assert load_plugin() == facts_for(family).image_deadlock
    assert _encoder_is_wrapped()
    result = _run(mode, 0)
    assert not result.completed
    stalled_at = result.stall_at["spec-image"]
    warnings = [m for m in vllm_log if "stalled at token" in m]
    assert len(warnings) == 1, warnings
    (warning,) = warnings
    for needle in (
        f"request spec-image stalled at token {stalled_at} of",
        "holds encoder inputs [5, 11849)",
        "waits for [11849, 23693)",
        "encoder cache 16384 tokens",
        "likely cause: EAGLE-type speculative decoding",
        "remedy: upgrade to vLLM 0.33+, or put two or more tokens between images",
    ):
        assert needle in warning, (needle, warning)
