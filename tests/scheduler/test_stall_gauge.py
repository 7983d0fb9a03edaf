"""Issue 37 item 3 on the real scheduler: the live stall gauge follows the stalls standing now.

The split's own hang with the split rule off (test_stall_end.py's scenario): ``running-image``
stalls at its split's 0 and is ended; ``one-image`` waits behind it for encoder cache space,
is named, and moves again once the first is gone. After every engine step the gauges at this
process's ``REGISTRY`` (the in-process route of metrics.py, the one an engine in the serving
process takes) must say how many named stalls neither moved nor ended, and when the oldest
began; both fall back to 0. A client's abort of a named stall (``_free_request``) drops it too.

The watchdog's clock and the gauge's wall clock are one virtual clock, 5 s per step.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.scheduler.test_stall_end import _watchdog_seconds
from tests.stall_end_helpers import Clock, install_clock, stall_end_installed, update_wrapped
from tools import sched_harness as harness
from tools.release_facts import facts_for
from tools.scenarios import ISSUE_CONFIG, image_request, text_request
from tools.sched_harness import Mode
from vllm_mamba_fix.facts.versions import Family
from vllm_mamba_fix.observe import counters
from vllm_mamba_fix.observe.series import OLDEST_STALL, STALLED

NAMED = re.compile(r"request \S+ stalled at token")
STEP_SECONDS = 5.0
STALL_SECONDS = 30.0


def _gauges(scheduler: Any) -> tuple[float | None, float | None]:
    """(stalled requests, oldest stall's start) as /metrics serves them for this engine."""
    from prometheus_client import REGISTRY

    config = scheduler.vllm_config
    labels = {"engine": "0", "model_name": str(config.model_config.served_model_name)}
    return (
        REGISTRY.get_sample_value(STALLED.sample, labels),
        REGISTRY.get_sample_value(OLDEST_STALL.sample, labels),
    )


def _setup(
    family: Family, sched_mode: Mode, load_plugin: Any, monkeypatch: pytest.MonkeyPatch, end: str
) -> Clock:
    if not facts_for(family).image_deadlock:
        pytest.skip(f"family {family.name}: stock's split does not hang on two images")
    if sched_mode.speculative:
        pytest.skip("the split's stall, without a drafter")
    clock = install_clock(monkeypatch)
    monkeypatch.setattr(counters, "wall_clock", clock)
    load_plugin(
        VLLM_MAMBA_FIX_SPLIT_RULE="0",
        VLLM_MAMBA_FIX_STALL_SECONDS=f"{STALL_SECONDS:g}",
        VLLM_MAMBA_FIX_END_STALLS_AFTER=end,
    )
    if not harness.split_is_wrapped():
        pytest.skip("the split is not wrapped with its rule off: no split 0 reaches the watchdog")
    if _watchdog_seconds() is None:
        pytest.skip("the plugin runs no watchdog with the split rule off on this release")
    if end != "off" and not stall_end_installed():
        pytest.skip("the plugin installs no stall end with the split rule off on this release")
    return clock


def test_the_gauge_rises_with_a_named_stall_and_falls_when_it_moves_or_ends(
    family: Family,
    sched_mode: Mode,
    load_plugin: Any,
    vllm_log: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _setup(family, sched_mode, load_plugin, monkeypatch, "30")
    with update_wrapped(30.0):
        h = harness.Harness(sched_mode.apply(ISSUE_CONFIG))
        assert _gauges(h.scheduler) == (0.0, 0.0)  # prepared with the scheduler, before a stall
        h.add(image_request("running-image", (100, 50, 200)))
        h.step()
        clock.advance(STEP_SECONDS)
        h.add(image_request("one-image", (40, 60)), text_request("queued-text", 3000))
        seen: list[tuple[float, float, float]] = []  # (now, standing, oldest start)
        while len(h.finished) < len(h.requests) and h.step_index < 200:
            h.advance()
            clock.advance(STEP_SECONDS)
            standing, oldest = _gauges(h.scheduler)
            assert (standing, oldest) == counters.standing_stalls(), h.step_index
            seen.append((clock.now, standing, oldest))
    assert len(h.finished) == len(h.requests)
    named = [m for m in vllm_log if NAMED.search(m)]
    assert len(named) == 2, named  # both requests were named
    assert max(standing for _, standing, _ in seen) >= 1
    for now, standing, oldest in seen:
        if standing:  # named only after STALL_SECONDS of 0s: its start is at least that old
            assert now - oldest >= STALL_SECONDS and oldest > 0, (now, standing, oldest)
        else:
            assert oldest == 0
    assert any("moves again" in m for m in vllm_log)  # one-image moved, running-image ended
    assert seen[-1][1:] == (0.0, 0.0)


def test_a_named_stall_the_client_aborts_stands_no_more(
    family: Family,
    sched_mode: Mode,
    load_plugin: Any,
    vllm_log: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.request import RequestStatus

    clock = _setup(family, sched_mode, load_plugin, monkeypatch, "off")
    h = harness.Harness(sched_mode.apply(ISSUE_CONFIG))
    h.add(image_request("running-image", (100, 50, 200)))
    while not any(NAMED.search(m) for m in vllm_log) and h.step_index < 100:
        h.advance()
        clock.advance(STEP_SECONDS)
    assert _gauges(h.scheduler)[0] == 1.0
    h.scheduler.finish_requests("running-image", RequestStatus.FINISHED_ABORTED)
    assert _gauges(h.scheduler) == (0.0, 0.0)
