"""Stock vLLM as the oracle (issue 27 item 2): one workload, run on stock and with the plugin.

Every workload runs twice on the real `Scheduler` (or `AsyncScheduler`, with or without
vLLM's own MTP `SpeculativeConfig`) of the release `import vllm` finds:

- stock: the plugin unregistered, vLLM's own methods;
- plugin: loaded through vLLM's `load_general_plugins()` with its defaults (nothing
  forced, no variable set), the watchdog's clock (`vllm_mamba_fix.decide.stalls.clock`) moving
  100 s on every reading, longer than both bounds (30 s to name, 60 s to end), so the
  watchdog names and the end ends as early as they ever could.

`check` then holds the plugin to stock (the oracle of issue 27):
1. every request stock completes, the plugin completes: none ended, none waiting;
2. when stock completes every request with no violation (3), the plugin needs no more steps;
3. in the cache's block, the plugin's prefill chunks have no boundary violation (a chunk
   starting mid-block crosses no boundary), except where vLLM's own design makes a crossing
   correct: the prompt's last chunk after a fine-grained hit with internal prefill
   checkpoints (0.32+, by feature). Past the last cacheable boundary under EAGLE (stock
   0.15-0.26) a crossing is a violation: it caches a stale state (vLLM #51113);
4. where stock completes every request with no violation, the plugin's chunks are stock's;
5. a request stock never completes, the plugin completes, or ends it with proof: the same
   plugin run, with that request exempt from ending, never completes it either. A request
   stock leaves waiting even with an encoder cache and budget that hold every input is
   vLLM's own hang (a KV pool too small for the requests together, `perturbed`'s
   preemption), outside what the plugin handles: it may wait, never be ended unproven.

Every mode runs on each release whatever the matrix cell (the `diff_mode` fixture, not
`sched_mode`): CI's one release per family runs the suite in all four modes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.stall_end_helpers import Clock, capture_finishes, ended
from tools import prop_adapters as pa
from tools import sched_harness as harness
from tools.prop_adapters import PropRequest, PropScenario
from tools.sched_harness import HarnessConfig, Mode
from vllm_mamba_fix.decide import stalls
from vllm_mamba_fix.facts import config as plugin_config
from vllm_mamba_fix.facts.versions import release_of
from vllm_mamba_fix.observe import counters
from vllm_mamba_fix.rules import stall_watch

IDLE_STEPS = 16  # steps with no progress anywhere: what is left waits forever
PER_CALL = 100.0  # virtual seconds per clock reading: past both bounds at once
PLUGIN_VARIABLES = (*plugin_config.ALL_VARIABLES, plugin_config.ENV_VLLM_PLUGINS)
EXAMPLES_ENV = "VLLM_MAMBA_FIX_DIFFERENTIAL_EXAMPLES"
MODES_ENV = "VLLM_MAMBA_FIX_DIFFERENTIAL_MODES"
SHRINK_ENV = "VLLM_MAMBA_FIX_DIFFERENTIAL_SHRINK"


def release() -> tuple[int, int]:
    return (release_of(harness.vllm_version()) or (0, 0, 0))[:2]


def has_internal_checkpoints() -> bool:
    """Whether Mamba specs may carry prefill checkpoints saved inside a chunk (read by
    feature: 0.29 has the checkpoint blocks, 0.30+ also their alignment; 0.32.0 has them
    beside prefix_match_unit's fine-grained hits)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return "num_prefill_checkpoint_blocks" in {f.name for f in dataclasses.fields(MambaSpec)}


def modes() -> tuple[Mode, ...]:
    """Every harness mode, whatever the matrix cell: the suite's own CI unit is the release.
    $VLLM_MAMBA_FIX_DIFFERENTIAL_MODES (comma list) narrows it by hand."""
    raw = os.environ.get(MODES_ENV, "").strip()
    if not raw or raw == "all":
        return harness.MODES
    names = {n.strip() for n in raw.split(",")}
    return tuple(m for m in harness.MODES if m.name in names)


@pytest.fixture(params=modes(), ids=str)
def diff_mode(request: pytest.FixtureRequest) -> Mode:
    """A harness mode of the differential suite; skipped where the release cannot build it.
    Not `sched_mode`: the matrix's mode cells would run only CI_MODES' modes."""
    reason = harness.mode_unsupported_reason(request.param)
    if reason:
        pytest.skip(f"{request.param}: {reason}")
    mode: Mode = request.param
    return mode


@dataclass(frozen=True)
class Workload:
    """A scenario plus what happens to it: a small KV pool (preemption), aborts at given
    steps (a client gone), the priority policy, a saturated encoder budget, and (0.32+)
    fine-grained prefix hits with internal checkpoints."""

    scenario: PropScenario
    preempt: bool = False
    aborts: tuple[tuple[int, str], ...] = ()  # (step, request id)
    priority: bool = False
    saturated_encoder: bool = False
    prefix_match_unit: int | None = None
    checkpoint_alignment: int | None = None
    encoder_compute_tokens: int | None = None  # one step's encoder budget; None: vLLM's

    @property
    def requests(self) -> tuple[PropRequest, ...]:
        return self.scenario.requests

    def config(self, mode: Mode) -> HarnessConfig:
        s = self.scenario
        cfg = s.config(mode)
        changes: dict[str, Any] = {
            "scheduling_policy": "priority" if self.priority else "fcfs",
            "prefix_match_unit": self.prefix_match_unit,
            "prefill_checkpoint_alignment": self.checkpoint_alignment,
        }
        if self.preempt:
            # About one and a half max_model_len requests: two long requests at once
            # preempt (one only leaves vLLM's own KV hangs, no room to finish either).
            longest = max(r.prompt_len + r.max_tokens for r in s.requests) + 16
            max_len = max(longest, 1024, s.budget, s.threshold)
            changes["max_model_len"] = max_len
            changes["num_blocks"] = 3 * max_len // (2 * s.block_size) + 2
        if self.encoder_compute_tokens is not None:
            changes["encoder_compute_tokens"] = self.encoder_compute_tokens
        if self.saturated_encoder:
            sizes = [n for r in s.requests for _, n in r.mm_spans]
            changes["encoder_compute_tokens"] = max(sizes, default=0) or None
        return dataclasses.replace(cfg, **changes)

    def max_steps(self, mode: Mode) -> int:
        s = self.scenario
        unit = min(s.block_size, s.configured_block_size or s.block_size)
        cap = max(1, min(s.budget, s.threshold or s.budget, unit))
        prefill = sum(math.ceil(r.prompt_len / cap) + 2 * len(r.mm_spans) for r in s.requests)
        decode = sum(r.max_tokens + 2 for r in s.requests)
        arrivals = max(r.arrival for r in s.requests)
        return 60 + arrivals + 3 * (prefill + decode)


@dataclass
class Outcome:
    """One run: chunks per request, and how each request left."""

    block: int  # the Mamba KV groups' block (the cache's)
    chunks: dict[str, list[tuple[int, int, int]]]
    prompt_len: dict[str, int]
    finished_at: dict[str, int]
    completed: set[str]  # finished by vLLM on its own terms
    ended: set[str]  # ended by the plugin
    aborted: set[str]  # aborted by the workload (a client gone)
    waiting: set[str]  # never finished (waiting forever, or never submitted)
    steps: int
    corrections: list[tuple[int, str, str]] = field(default_factory=list)
    preemptions: int = 0

    def spans(self, rid: str) -> list[tuple[int, int]]:
        return [(s, e) for _, s, e in self.chunks.get(rid, [])]


def _build(cfg: HarnessConfig) -> harness.Harness:
    """The harness; a KV pool vLLM rejects as too small for one request grows by a quarter."""
    while True:
        try:
            return harness.Harness(cfg)
        except ValueError as exc:
            if cfg.num_blocks is None or "max seq len" not in str(exc):
                raise
            cfg = dataclasses.replace(cfg, num_blocks=cfg.num_blocks * 5 // 4 + 1)


def drive(w: Workload, mode: Mode) -> Outcome:
    """Submit the requests at their steps (a repeat once its original finished), abort at
    the given steps, and step until every request finished or nothing moved for a while."""
    from vllm.v1.request import RequestStatus

    h = _build(w.config(mode))
    finishes = capture_finishes(h.scheduler)
    corrections: list[tuple[int, str, str]] = []
    original_record = counters.record

    def record(action: Any, request_id: str, *args: Any) -> None:
        corrections.append((h.step_index, request_id, action.value))
        original_record(action, request_id, *args)

    pending = list(w.requests)
    aborted: set[str] = set()
    finished_at: dict[str, int] = {}
    idle, limit = 0, w.max_steps(mode)
    counters.record = record  # type: ignore[assignment]
    try:
        while h.step_index < limit:
            for req in list(pending):
                ready = (req.after in h.finished) if req.after else h.step_index >= req.arrival
                if ready:
                    pa.add(h, req)
                    pending.remove(req)
            for step, rid in w.aborts:
                request = h.requests.get(rid)
                if step == h.step_index and request is not None and not request.is_finished():
                    h.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                    aborted.add(rid)
            for rid, request in h.requests.items():
                if request.is_finished() and rid not in h.finished:
                    h.finished.add(rid)  # aborted outside a step
            if not pending and len(h.finished) == len(h.requests):
                break
            idle = 0 if h.advance() else idle + 1
            for rid in h.finished:
                finished_at.setdefault(rid, h.step_index)
            if idle >= IDLE_STEPS and not pending:
                break
    finally:
        counters.record = original_record  # type: ignore[assignment]
    gone = ended(finishes)
    completed = {rid for rid in finishes if rid not in gone and rid not in aborted}
    waiting = {r.request_id for r in w.requests} - set(finishes) - aborted
    result = h.result()
    return Outcome(
        block=h.block_size,
        chunks=result.chunks,
        prompt_len=result.prompt_len,
        finished_at=finished_at,
        completed=completed,
        ended=gone,
        aborted=aborted,
        waiting=waiting,
        steps=max(finished_at.values(), default=h.step_index),
        corrections=corrections,
        preemptions=sum(getattr(r, "num_preemptions", 0) for r in h.requests.values()),
    )


# --------------------------------------------------------------------------
# Stock and the plugin as registered


@contextlib.contextmanager
def _no_plugin_variables() -> Iterator[None]:
    saved = {name: os.environ.pop(name, None) for name in PLUGIN_VARIABLES}
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


@contextlib.contextmanager
def stock() -> Iterator[None]:
    with _no_plugin_variables(), pa.stock():
        yield


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """The plugin as vLLM loads it, with its defaults, under the virtual clock."""
    saved_clock = stalls.clock
    with _no_plugin_variables():
        harness.unload_plugin()
        harness.load_plugins()
        stalls.clock = Clock(per_call=PER_CALL)
        try:
            yield
        finally:
            stalls.clock = saved_clock
            harness.unload_plugin()


@contextlib.contextmanager
def exempt(request_id: str) -> Iterator[None]:
    """The counterfactual: ``request_id`` is never ordered to end; the rest is unchanged."""
    consider = stall_watch.consider

    def all_but(scheduler: Any, request: Any, *args: Any) -> None:
        if request.request_id != request_id:
            consider(scheduler, request, *args)

    stall_watch.consider = all_but  # type: ignore[assignment]
    try:
        yield
    finally:
        stall_watch.consider = consider  # type: ignore[assignment]


def run_both(w: Workload, mode: Mode) -> tuple[Outcome, Outcome]:
    with stock():
        reference = drive(w, mode)
    with registered():
        mine = drive(w, mode)
    return reference, mine


# --------------------------------------------------------------------------
# The oracle


def violations(w: Workload, run: Outcome, mode: Mode) -> list[tuple[str, int, int]]:
    """Prefill chunks that start mid-block (the cache's) and cross the next boundary, less
    the crossings vLLM's own design makes correct (see the module docstring, 3)."""
    b = run.block
    unit = w.prefix_match_unit if w.checkpoint_alignment and has_internal_checkpoints() else None
    bad = []
    for rid, chunks in run.chunks.items():
        prompt = run.prompt_len[rid]
        for _, s, e in chunks:
            if s >= prompt or not s % b or e <= (s // b + 1) * b:
                continue
            if unit and e >= prompt and s % unit == 0:
                continue  # 0.32+: the backend saves the checkpoint inside this chunk
            bad.append((rid, s, e))
    return bad


def describe(w: Workload, mode: Mode) -> str:
    return f"vLLM {harness.vllm_version()}, {mode.name}: {w!r}"


def beyond_the_plugin(w: Workload, mode: Mode, reference: Outcome) -> set[str]:
    """The requests stock leaves waiting even with no encoder pressure at all (an encoder
    cache and budget that hold every input): a hang of vLLM's own (a KV pool too small for
    the requests together), not one of the split or the encoder inputs the plugin handles."""
    if not reference.waiting:
        return set()
    roomy = dataclasses.replace(
        w, scenario=dataclasses.replace(w.scenario, encoder_cache=1 << 24),
        saturated_encoder=False,
    )  # fmt: skip
    with stock():
        free = drive(roomy, mode)
    return reference.waiting & free.waiting


def check(w: Workload, mode: Mode) -> dict[str, int]:
    """Run `w` on stock and with the plugin in `mode`; assert the oracle; return figures."""
    reference, mine = run_both(w, mode)
    where = describe(w, mode)
    lost = reference.completed - mine.completed
    assert not lost, (
        f"stock completes {sorted(lost)}, the plugin does not (ended {sorted(mine.ended)}, "
        f"waiting {sorted(mine.waiting)}); plugin chunks {_chunks(mine, lost)}, stock "
        f"{_chunks(reference, lost)}; {where}"
    )
    beyond = beyond_the_plugin(w, mode, reference)
    left = mine.waiting - beyond
    assert not left, f"waiting forever with the plugin: {sorted(left)}; {where}"
    bad = violations(w, mine, mode)
    assert not bad, f"plugin chunks crossing a cache-block boundary from mid-block: {bad}; {where}"
    stock_bad = violations(w, reference, mode)
    # Stock is the reference for speed where it is right; where its chunks cross a cache
    # boundary (wrong states cached), stopping at the boundary may cost steps (counted).
    if not reference.waiting and not stock_bad:
        assert mine.steps <= reference.steps, (
            f"the plugin needs {mine.steps} steps, stock {reference.steps}; {where}"
        )
    if not reference.waiting and not stock_bad:
        differ = {
            rid: (mine.spans(rid), reference.spans(rid))
            for rid in reference.chunks
            if mine.spans(rid) != reference.spans(rid)
        }
        assert not differ, (
            f"stock is right; the plugin's chunks differ (mine, stock): {differ}; {where}"
        )
    proven = 0
    for rid in sorted(mine.ended):
        with registered(), exempt(rid):
            left_alone = drive(w, mode)
        assert rid not in left_alone.completed, (
            f"{rid} was ended, but the plugin left to itself completes it in "
            f"{left_alone.finished_at.get(rid)} steps; {where}"
        )
        proven += 1
    return {
        "workloads": 1,
        "requests": len(w.requests),
        "stock_stalled_requests": len(reference.waiting),
        "stock_hangs_beyond_the_plugin": len(beyond),
        "stock_violations": len(stock_bad),
        "plugin_ended": len(mine.ended),
        "ends_proven": proven,
        "identical_runs": int(mine.chunks == reference.chunks),
        "extra_steps_fixing_stock": max(mine.steps - reference.steps, 0) if stock_bad else 0,
        "steps_stock": reference.steps,
        "steps_plugin": mine.steps,
        "corrections": len(mine.corrections),
        "preemptions": mine.preemptions,
        "aborted": len(mine.aborted),
    }


def _chunks(run: Outcome, rids: set[str]) -> dict[str, list[tuple[int, int]]]:
    return {rid: run.spans(rid)[:8] for rid in sorted(rids)}
