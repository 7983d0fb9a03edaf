"""Issue 27 item 2: stock vLLM as the oracle of every rule (see _differential, _diff_workloads).

Each generated workload runs on stock and with the plugin as registered, on the real
scheduler of this release, in every harness mode (sync, async, sync+mtp2, async+mtp2), with
the watchdog's clock past both bounds on every reading. `_differential.check` holds the
plugin to stock.

Size: the ci profile runs `ci_examples` per test and mode; $VLLM_MAMBA_FIX_DIFFERENTIAL_EXAMPLES
sets it by hand (`VLLM_MAMBA_FIX_DIFFERENTIAL_EXAMPLES=200 python -m tools.matrix 0.25.1`),
HYPOTHESIS_PROFILE=long runs the release-check size. The tests take no `sched_mode`: they are
the release matrix's base cell, so CI runs every mode on its one release per family.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hypothesis import Phase, event, given, settings
from hypothesis import strategies as st

from tests.properties import _diff_workloads as wl
from tests.properties import _differential
from tests.properties._differential import EXAMPLES_ENV, SHRINK_ENV, Workload, check
from tests.properties._support import FIGURES, PROFILE_NAME
from tools.sched_harness import Mode

_EXAMPLES = int(os.environ.get(EXAMPLES_ENV, "0")) or None


_SHRINK = os.environ.get(SHRINK_ENV, "") == "1"


def sized(ci_examples: int) -> settings:
    """The property suite's profile; the differential variable wins in the ci profile.

    The ci profile reports the first failing workload as drawn (derandomized: the same in
    every run) without shrinking it: each shrink step is two scheduler runs or more, and a
    failing release must not blow CI's time. $VLLM_MAMBA_FIX_DIFFERENTIAL_SHRINK=1 and the
    long profile shrink it to a minimal counterexample.
    """
    base = settings.get_profile(PROFILE_NAME)
    if PROFILE_NAME != "ci":
        return base
    # Not $VLLM_MAMBA_FIX_PROPERTY_EXAMPLES (the matrix sets it to 8 for the invariant tests):
    # this suite's CI size is its own, counted in workloads per release and mode.
    phases = tuple(p for p in base.phases if _SHRINK or p is not Phase.shrink)
    return settings(base, max_examples=_EXAMPLES or ci_examples, phases=phases)


diff_mode = _differential.diff_mode  # the fixture, every harness mode


def _run(mode: Mode, data: st.DataObject, strategy: Callable[[Mode], Any], family: str) -> None:
    workload: Workload = data.draw(strategy(mode), label="workload")
    figures = check(workload, mode)
    for key in sorted(k for k in figures if k.startswith("reach_")):
        event(key)  # --hypothesis-show-statistics lists them; FIGURES counts them per mode
    FIGURES.add(mode.name, **{f"differential_{family}_{k}": v for k, v in figures.items()})


@sized(ci_examples=4)
@given(data=st.data())
def test_starved_behind_long_prefills(diff_mode: Mode, data: st.DataObject) -> None:
    _run(diff_mode, data, wl.starved, "starved")


@sized(ci_examples=4)
@given(data=st.data())
def test_two_block_sizes(diff_mode: Mode, data: st.DataObject) -> None:
    _run(diff_mode, data, wl.two_sizes, "two_sizes")


@sized(ci_examples=4)
@given(data=st.data())
def test_preemption_aborts_churn_priority(diff_mode: Mode, data: st.DataObject) -> None:
    _run(diff_mode, data, wl.perturbed, "perturbed")


@sized(ci_examples=3)
@given(data=st.data())
def test_fine_grained_prefix_hits(diff_mode: Mode, data: st.DataObject) -> None:
    _run(diff_mode, data, wl.fine_grained, "fine_grained")


@sized(ci_examples=2)
@given(data=st.data())
def test_crowd_sharing_an_encoder_cache(diff_mode: Mode, data: st.DataObject) -> None:
    _run(diff_mode, data, wl.crowd, "crowd")


@sized(ci_examples=3)
@given(data=st.data())
def test_inputs_at_block_boundaries(diff_mode: Mode, data: st.DataObject) -> None:
    _run(diff_mode, data, wl.boundary, "boundary")


@sized(ci_examples=1)  # about 10 s a workload and mode: 5-6 requests, three runs each
@given(data=st.data())
def test_tight_blocks_budgets_and_caches(diff_mode: Mode, data: st.DataObject) -> None:
    _run(diff_mode, data, wl.tight, "tight")
