"""The second oracle's plumbing (issue 35 item 2): workloads and traces cross the process
boundary unchanged, and each release answers to the fixed releases of its rules."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.properties import _diff_workloads as wl
from tests.properties._differential import Outcome, Workload
from tests.properties._reference import SPECULATIVE_FIXED, SPLIT_FIXED, fixed_releases
from tools.prop_adapters import PropRequest, PropScenario
from tools.sched_harness import ASYNC_MTP2, SYNC, SYNC_MTP2, VideoSpec

STRATEGIES = (wl.starved, wl.two_sizes, wl.perturbed, wl.fine_grained, wl.crowd, wl.boundary)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(data=st.data(), which=st.sampled_from(STRATEGIES))
def test_workload_json_round_trip(data: st.DataObject, which: object) -> None:
    workload: Workload = data.draw(which(SYNC_MTP2))  # type: ignore[operator]
    assert Workload.from_json(json.loads(json.dumps(workload.to_json()))) == workload


def test_every_field_crosses() -> None:
    """Each field away from its default, so a field the JSON forms drop shows."""
    request = PropRequest(
        "r1", 900, ((10, 100),), content="c", arrival=2, after="r0", max_tokens=3,
        videos=(VideoSpec(200, 2, 30, fps=1.5, is_embed=False),), priority=-1,
    )  # fmt: skip
    workload = Workload(
        PropScenario(64, 300, 500, 128, (request,), configured_block_size=32,
                     configured_after_build=True),
        preempt=True, aborts=((3, "r1"),), priority=True, saturated_encoder=True,
        prefix_match_unit=16, checkpoint_alignment=16,
    )  # fmt: skip
    assert Workload.from_json(json.loads(json.dumps(workload.to_json()))) == workload


def test_outcome_json_round_trip() -> None:
    outcome = Outcome(
        block=64, chunks={"r0": [(0, 0, 64), (1, 64, 100)]}, prompt_len={"r0": 100},
        finished_at={"r0": 2}, completed={"r0"}, ended=set(), aborted={"t"}, waiting={"w"},
        steps=2, corrections=[(1, "r0", "stopped-at-encoder-input")], preemptions=1,
        hits={"r0": 0, "r1": 64}, concurrent_mm=2, resumed_while_held=1,
    )  # fmt: skip
    assert Outcome.from_json(json.loads(json.dumps(outcome.to_json()))) == outcome


def test_each_rule_answers_to_its_fixed_release() -> None:
    assert fixed_releases((0, 15), SYNC) == (SPLIT_FIXED,)
    assert fixed_releases((0, 23), SYNC_MTP2) == (SPLIT_FIXED,)
    assert fixed_releases((0, 27), ASYNC_MTP2) == (SPLIT_FIXED, SPECULATIVE_FIXED)
    assert fixed_releases((0, 28), SYNC) == ()
    assert fixed_releases((0, 32), SYNC_MTP2) == (SPECULATIVE_FIXED,)
    assert fixed_releases((0, 33), SYNC_MTP2) == ()
