"""Issue 21 item 1: the stall end never ends a request that would have completed.

Generated as the property suite's scenarios (tests/properties/_support.py: 1-4
concurrent text and image/video requests arriving at different steps, repeats
that hit the prefix cache, encoder caches down to one image, images 0 tokens
apart in every mode), each with drawn perturbations:

- preemption: a KV pool of about one max_model_len request, so concurrent
  requests preempt each other (vLLM's own ``_preempt_request``);
- aborts: text requests finished at drawn steps with ``finish_requests``, as the
  engine core does for a client that disconnects (churn: resources freed and
  requests admitted mid-run);
- a saturated encoder budget: one step's encoder budget the size of the largest
  input, shared by every request.

The watchdog's clock moves 100 s on every reading, so every time bound is past at
once: a stall is named on its 3rd 0 and ended on the 2nd 0 after, the most eager
the rule can be. For every request R the plugin ends, the same run is repeated with
R exempt from ending (the counterfactual); R must not complete there either, unless
another request of a hold across requests was ended there instead (issue 35 item 3: one
end breaks the hold), and then R must not complete in a run that ends nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.properties._support import FIGURES, profile, scenarios
from tests.stall_end_helpers import (
    Clock,
    capture_finishes,
    ended,
    load_with_stall_end,
    update_wrapped,
)
from tools import prop_adapters as pa
from tools import sched_harness as harness
from tools.prop_adapters import PropRequest, PropScenario
from tools.sched_harness import HarnessConfig, Mode
from vllm_mamba_fix.rules import stall_watch

IDLE_STEPS = 30
ENV = {"VLLM_MAMBA_FIX_STALL_SECONDS": "30", "VLLM_MAMBA_FIX_END_STALLS_AFTER": "30"}


@dataclass(frozen=True)
class Case:
    scenario: PropScenario
    preempt: bool
    saturated_encoder: bool
    aborts: tuple[tuple[int, str], ...]  # (step, text request id)

    def config(self, mode: Mode) -> HarnessConfig:
        cfg = self.scenario.config(mode)
        changes: dict[str, Any] = {}
        if self.preempt:
            # The smallest pool vLLM's start-up check lets hold one max_model_len request
            # (see build); two long requests at once preempt.
            longest = max(r.prompt_len + r.max_tokens for r in self.scenario.requests) + 16
            # vLLM wants the token budget and long-prefill threshold within max_model_len.
            max_len = max(longest, 1024, self.scenario.budget, self.scenario.threshold)
            changes["max_model_len"] = max_len
            changes["num_blocks"] = max_len // self.scenario.block_size + 2
        if self.saturated_encoder:
            sizes = [n for r in self.scenario.requests for _, n in r.mm_spans]
            changes["encoder_compute_tokens"] = max(sizes, default=0) or None
        return dataclasses.replace(cfg, **changes)


@st.composite
def seeds(draw: st.DrawFn, cache: int) -> tuple[PropRequest, ...]:
    """Maybe a request that stalls for good: two images 0-1 tokens apart that do not fit the
    encoder cache together (the look-ahead stall under MTP), or one larger than the cache."""
    kind = draw(st.sampled_from(["none", "apart", "too-large"]))
    if kind == "none":
        return ()
    before, after = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    if kind == "too-large":
        size = cache + draw(st.integers(1, 64))
        images: tuple[tuple[int, int], ...] = ((before, size),)
    else:
        size, gap = max(16, cache * 3 // 4), draw(st.integers(0, 1))
        images = ((before, size), (before + size + gap, size))
    end = images[-1][0] + images[-1][1] + after
    arrival = draw(st.integers(0, 6))
    seed = PropRequest("seed", end, images, content="seed", arrival=arrival)
    if kind == "too-large" or not draw(st.booleans()):
        return (seed,)
    # A healthy neighbour kept waiting by the seed's held image: its own image fits the
    # cache alone, not beside the seed's (the 0s that must never end it).
    size = draw(st.integers(cache - max(16, cache * 3 // 4) + 1, cache))
    offset = draw(st.integers(1, 200))
    neighbour = PropRequest(
        "neighbour", offset + size + draw(st.integers(1, 200)), ((offset, size),),
        content="neighbour", arrival=arrival + draw(st.integers(0, 3)),
    )  # fmt: skip
    return (seed, neighbour)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    scenario = draw(scenarios(min_image_gap=0, videos=draw(st.booleans())))
    # Churn: text requests arriving mid-run, some aborted as a disconnecting client's are.
    churn = tuple(
        PropRequest(f"churn{i}", draw(st.integers(16, 3000)), content=f"churn{i}",
                    arrival=draw(st.integers(0, 8)), max_tokens=draw(st.integers(1, 4)))
        for i in range(draw(st.integers(0, 2)))
    )  # fmt: skip
    extra = churn + draw(seeds(scenario.encoder_cache))
    scenario = dataclasses.replace(scenario, requests=scenario.requests + extra)
    texts = [r.request_id for r in scenario.requests if not r.has_mm]
    aborts = draw(
        st.lists(st.tuples(st.integers(1, 12), st.sampled_from(texts)), max_size=2)
        if texts
        else st.just([])
    )
    return Case(scenario, draw(st.booleans()), draw(st.booleans()), tuple(sorted(aborts)))


@dataclass
class Run:
    completed: set[str]
    ended: set[str]
    aborted: set[str]
    preemptions: int
    steps: int


def _load(monkeypatch: pytest.MonkeyPatch, **env: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    harness.load_plugins()


@contextmanager
def plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The plugin as vLLM loads it (forced where a release leaves it off), the end on."""
    with pa.clean_env():
        for name, value in ENV.items():
            monkeypatch.setenv(name, value)
        harness.unload_plugin()
        load_with_stall_end(lambda **env: _load(monkeypatch, **env))
        monkeypatch.setattr(stall_watch, "clock", Clock(per_call=100.0))
        try:
            with update_wrapped():
                yield
        finally:
            harness.unload_plugin()


def build(cfg: HarnessConfig) -> harness.Harness:
    """The harness; a KV pool vLLM rejects as too small for one request grows by a quarter."""
    while True:
        try:
            return harness.Harness(cfg)
        except ValueError as exc:
            if cfg.num_blocks is None or "max seq len" not in str(exc):
                raise
            cfg = dataclasses.replace(cfg, num_blocks=cfg.num_blocks * 5 // 4 + 1)


def drive(case: Case, mode: Mode, max_steps: int) -> Run:
    from vllm.v1.request import RequestStatus

    h = build(case.config(mode))
    finishes = capture_finishes(h.scheduler)
    pending = list(case.scenario.requests)
    aborted: set[str] = set()
    idle = 0
    while h.step_index < max_steps:
        for req in list(pending):
            if (h.step_index >= req.arrival) if req.after is None else (req.after in h.finished):
                pa.add(h, req)
                pending.remove(req)
        for step, rid in case.aborts:
            request = h.requests.get(rid)
            if step == h.step_index and request is not None and not request.is_finished():
                h.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)
        if not pending and all(r.is_finished() for r in h.requests.values()):
            break
        idle = 0 if h.advance() else idle + 1
        if idle >= IDLE_STEPS and not pending:
            break
    completed = {
        rid for rid, f in finishes.items() if rid not in ended(finishes) and rid not in aborted
    }
    preemptions = sum(getattr(r, "num_preemptions", 0) for r in h.requests.values())
    return Run(completed, ended(finishes), aborted, preemptions, h.step_index)


@contextmanager
def exempt(monkeypatch: pytest.MonkeyPatch, request_id: str | None) -> Iterator[None]:
    """The counterfactual: ``request_id`` is never ordered to end (None: no request is)."""
    consider = stall_watch.consider

    def all_but(scheduler: Any, request: Any, *args: Any) -> None:
        if request_id is not None and request.request_id != request_id:
            consider(scheduler, request, *args)

    with monkeypatch.context() as patch:
        patch.setattr(stall_watch, "consider", all_but)
        yield


def _bound(case: Case) -> int:
    tokens = sum(r.prompt_len + r.max_tokens for r in case.scenario.requests)
    return 400 + 4 * tokens // max(case.scenario.block_size, 16)


@profile(ci_examples=25)
@given(case=cases())
def test_no_request_that_would_complete_is_ended(
    sched_mode: Mode, case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    max_steps = _bound(case)
    with plugin(monkeypatch):
        run = drive(case, sched_mode, max_steps)
        for rid in sorted(run.ended):
            with exempt(monkeypatch, rid):
                counterfactual = drive(case, sched_mode, max_steps)
            assert rid not in counterfactual.ended
            if rid in counterfactual.completed and counterfactual.ended:
                # Another request of the hold was ended instead: with no end, none completes.
                with exempt(monkeypatch, None):
                    counterfactual = drive(case, sched_mode, max_steps)
            assert rid not in counterfactual.completed, (
                f"{rid} was ended but completes when left alone "
                f"(in {counterfactual.steps} steps; ended there: {counterfactual.ended})"
            )
    FIGURES.add(
        sched_mode.name,
        stall_end_scenarios=1,
        stall_end_requests=len(case.scenario.requests),
        stall_end_ended=len(run.ended),
        stall_end_preemptions=run.preemptions,
        stall_end_scenarios_preempting=int(run.preemptions > 0),
        stall_end_aborts=len(run.aborted),
        stall_end_saturated_encoder=int(case.saturated_encoder),
    )
