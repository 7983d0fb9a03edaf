"""Stock vLLM as the oracle (issue 27 item 2): one workload, run on stock and with the plugin.

Every workload runs twice on the real `Scheduler` (or `AsyncScheduler`, with or without
vLLM's own MTP `SpeculativeConfig`) of the release `import vllm` finds:

- stock: the plugin unregistered, vLLM's own methods;
- plugin: loaded through vLLM's `load_general_plugins()` with its defaults (nothing
  forced, no variable set), the watchdog's clock (`vllm_mamba_fix.rules.stall_watch.clock`) moving
  100 s on every reading, longer than both bounds (30 s to name, 60 s to end), so the
  watchdog names and the end ends as early as they ever could.

`check` then holds the plugin to stock (the oracle of issue 27):
1. every request stock completes, the plugin completes: none ended, none waiting;
2. when stock completes every request with no violation (3), a corrected plugin run needs no
   more steps; else no more than 0.28.0 where that completes with no violation; on every
   release, over the bound only by a counted carve-out (`_carveouts`, issue 44 item 4);
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
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.stall_end_helpers import Clock, capture_finishes, ended
from tools import prop_adapters as pa
from tools import sched_harness as harness
from tools.prop_adapters import PropRequest, PropScenario
from tools.sched_harness import HarnessConfig, Mode
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
    # With `preempt`: a KV pool of about one and a half of 256 tokens or the longest request
    # (else of at least 1024 tokens, which small requests never fill; below 256, releases
    # before 0.20 start no request at all, a hang of their own).
    small_pool: bool = False

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
            # --max-num-seqs as the seed's deployment (48): every request of a crowd may run
            "max_num_seqs": max(cfg.max_num_seqs, len(s.requests)),
        }
        if self.preempt:
            # About one and a half max_model_len requests: two long requests at once
            # preempt (one only leaves vLLM's own KV hangs, no room to finish either).
            longest = max(r.prompt_len + r.max_tokens for r in s.requests) + 16
            max_len = max(longest, 256 if self.small_pool else 1024, s.budget, s.threshold)
            changes["max_model_len"] = max_len
            changes["num_blocks"] = 3 * max_len // (2 * s.block_size) + 2
        if self.encoder_compute_tokens is not None:
            changes["encoder_compute_tokens"] = self.encoder_compute_tokens
        if self.saturated_encoder:
            sizes = [n for r in s.requests for _, n in r.mm_spans]
            changes["encoder_compute_tokens"] = max(sizes, default=0) or None
        return dataclasses.replace(cfg, **changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": pa.scenario_to_json(self.scenario), "preempt": self.preempt,
            "aborts": [[step, rid] for step, rid in self.aborts], "priority": self.priority,
            "saturated_encoder": self.saturated_encoder,
            "prefix_match_unit": self.prefix_match_unit,
            "checkpoint_alignment": self.checkpoint_alignment,
            "encoder_compute_tokens": self.encoder_compute_tokens,
            "small_pool": self.small_pool,
        }  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Workload:
        return cls(
            pa.scenario_from_json(d["scenario"]), preempt=bool(d["preempt"]),
            aborts=tuple((int(step), str(rid)) for step, rid in d["aborts"]),
            priority=bool(d["priority"]), saturated_encoder=bool(d["saturated_encoder"]),
            prefix_match_unit=d["prefix_match_unit"],
            checkpoint_alignment=d["checkpoint_alignment"],
            encoder_compute_tokens=d.get("encoder_compute_tokens"),
            small_pool=bool(d.get("small_pool", False)),
        )  # fmt: skip

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
    # Prefix-hit tokens of each scheduled request: num_computed_tokens when it was first
    # scheduled (the start of its first chunk).
    hits: dict[str, int] = field(default_factory=dict)
    # Most image/video requests running at once, and resumptions after a preemption while
    # another request held an encoder-cache entry (what the generator must reach).
    concurrent_mm: int = 0
    resumed_while_held: int = 0

    def spans(self, rid: str) -> list[tuple[int, int]]:
        return [(s, e) for _, s, e in self.chunks.get(rid, [])]

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("completed", "ended", "aborted", "waiting"):
            data[name] = sorted(data[name])
        return data

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Outcome:
        return cls(
            block=int(d["block"]),
            chunks={rid: [(int(a), int(b), int(c)) for a, b, c in v]
                    for rid, v in d["chunks"].items()},
            prompt_len={rid: int(n) for rid, n in d["prompt_len"].items()},
            finished_at={rid: int(n) for rid, n in d["finished_at"].items()},
            completed=set(d["completed"]), ended=set(d["ended"]), aborted=set(d["aborted"]),
            waiting=set(d["waiting"]), steps=int(d["steps"]),
            corrections=[(int(a), str(b), str(c)) for a, b, c in d["corrections"]],
            preemptions=int(d["preemptions"]),
            hits={rid: int(n) for rid, n in d["hits"].items()},
            concurrent_mm=int(d["concurrent_mm"]),
            resumed_while_held=int(d["resumed_while_held"]),
        )  # fmt: skip


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
    watch = _Watch({r.request_id for r in w.requests if r.has_mm})
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
            watch.after_step(h)
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
        hits={rid: chunks[0][1] for rid, chunks in result.chunks.items() if chunks},
        concurrent_mm=watch.concurrent_mm,
        resumed_while_held=watch.resumed_while_held,
    )


class _Watch:
    """What a run reached, read after every step: image/video requests running at once, and
    requests resumed after a preemption (PREEMPTED, then RUNNING) with inputs left to
    encode while the encoder cache holds another request's input."""

    def __init__(self, mm: set[str]) -> None:
        self.mm = mm
        self.status: dict[str, Any] = {}
        self.concurrent_mm = self.resumed_while_held = 0

    def after_step(self, h: harness.Harness) -> None:
        from vllm.v1.request import RequestStatus

        running = [r for r in h.scheduler.running if r.request_id in self.mm]
        self.concurrent_mm = max(self.concurrent_mm, len(running))
        cached = getattr(h.scheduler.encoder_cache_manager, "cached", {}) or {}
        for rid, request in h.requests.items():
            before, now = self.status.get(rid), request.status
            self.status[rid] = now
            if before != RequestStatus.PREEMPTED or now != RequestStatus.RUNNING:
                continue
            spans = [(f.mm_position.offset, f.mm_position.length)
                     for f in (getattr(request, "mm_features", None) or [])]  # fmt: skip
            left = any(request.num_computed_tokens < s + n for s, n in spans)
            if left and any(ids - {rid} for ids in cached.values()):
                self.resumed_while_held += 1


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
    saved_clock = stall_watch.clock
    with _no_plugin_variables():
        harness.unload_plugin()
        harness.load_plugins()
        stall_watch.clock = Clock(per_call=PER_CALL)
        try:
            yield
        finally:
            stall_watch.clock = saved_clock
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
    """Run `w` on stock, with the plugin, and on stock of each fixed release answering for
    this release and mode (`_reference`); assert the oracle; return figures."""
    from tests.properties import _reference

    reference, mine = run_both(w, mode)
    started = time.monotonic()
    fixed = _reference.fixed_runs(w, mode, release())
    reference_ms = int(1000 * (time.monotonic() - started))  # CI's cost of the second oracle
    where = describe(w, mode)
    # 1. What stock or a fixed release completes, the plugin completes (a request the
    # workload aborts in the plugin's run is the client's, not a loss).
    # A request this release's stock leaves waiting even with no encoder pressure is a hang of
    # this release's own (a KV pool too small under preemption, fixed upstream elsewhere):
    # the fixed release completing it is not the split's or the plugin's doing.
    beyond = beyond_the_plugin(w, mode, reference)
    for name, run in [("stock", reference), *((f"vLLM {r}", o) for r, o in fixed.items())]:
        lost = (
            run.completed
            - mine.completed
            - mine.aborted
            - (beyond if run is not reference else set())
        )
        assert not lost, (
            f"{name} completes {sorted(lost)}, the plugin does not (ended {sorted(mine.ended)}, "
            f"waiting {sorted(mine.waiting)}); plugin chunks {_chunks(mine, lost)}, {name} "
            f"{_chunks(run, lost)}; {where}"
        )
    # 2. 0 ended, and nothing left waiting but vLLM's own hangs.
    assert not mine.ended, f"the plugin ended {sorted(mine.ended)}; {where}"
    left = mine.waiting - beyond
    assert not left, f"waiting forever with the plugin: {sorted(left)}; {where}"
    # 3. 0 cache-boundary violations.
    bad = violations(w, mine, mode)
    assert not bad, f"plugin chunks crossing a cache-block boundary from mid-block: {bad}; {where}"
    stock_bad = violations(w, reference, mode)
    # 4. No correction: stock's chunks. 5. Corrections: no more steps than stock where stock
    # completes every request with right chunks, else than 0.28.0 where that does (a run that
    # crosses a cache boundary caches wrong states: no bound on speed), on every release; over
    # it, only a counted carve-out (`check_steps`, `_carveouts`).
    if not mine.corrections:
        differ = {
            rid: (mine.spans(rid), reference.spans(rid))
            for rid in reference.chunks
            if mine.spans(rid) != reference.spans(rid)
        }
        assert not differ, f"no correction, yet chunks differ (plugin, stock): {differ}; {where}"
    carveout = check_steps(w, mode, reference, mine, fixed, where)
    hits_agreeing = check_hits(w, mode, reference, mine, stock_bad, where)
    return {
        "workloads": 1,
        "requests": len(w.requests),
        "stock_stalled_requests": len(reference.waiting),
        "stock_hangs_beyond_the_plugin": len(beyond),
        "stock_violations": len(stock_bad),
        "plugin_ended": len(mine.ended),
        "identical_runs": int(mine.chunks == reference.chunks),
        **({f"carveout_{carveout}": 1} if carveout else {}),
        "steps_stock": reference.steps,
        "steps_plugin": mine.steps,
        "corrections": len(mine.corrections),
        "corrected_workloads": int(bool(mine.corrections)),
        "preemptions": mine.preemptions,
        "aborted": len(mine.aborted),
        "hit_tokens_stock": sum(reference.hits.values()),
        "hit_tokens_plugin": sum(mine.hits.values()),
        **({"hit_tokens_sizes_agreeing": hits_agreeing} if hits_agreeing is not None else {}),
        **{f"fixed_{r}_workloads": 1 for r in fixed},
        **({"fixed_release_ms": reference_ms} if fixed else {}),
        **{f"fixed_{r}_stalled_requests": len(o.waiting) for r, o in fixed.items()},
        **{f"fixed_{r}_completes_what_stock_does_not": len(o.completed - reference.completed)
           for r, o in fixed.items()},
        **{f"fixed_{r}_steps": o.steps for r, o in fixed.items()},
        **reached(w, mode, mine),
    }  # fmt: skip


def right(w: Workload, run: Outcome | None, mode: Mode) -> bool:
    """A run that completes every request with right chunks (no boundary violation)."""
    return run is not None and not run.waiting and not violations(w, run, mode)


def step_bound(
    w: Workload, mode: Mode, reference: Outcome, fixed: dict[str, Outcome]
) -> tuple[str, int] | None:
    """Issue 44 item 4, on every release: stock's steps where stock completes every request
    with right chunks; else the split's fixed release's (0.28.0) where that does; else none.
    0.33.0 answers for completions only: it dropped the drafter's look-ahead from the cut, so
    its chunks run further from the first step on (not this release's speed)."""
    if right(w, reference, mode):
        return "stock", reference.steps
    split_fixed = fixed.get(_reference_split_fixed())
    if right(w, split_fixed, mode):
        assert split_fixed is not None
        return f"vLLM {_reference_split_fixed()}", split_fixed.steps
    return None


def _reference_split_fixed() -> str:
    from tests.properties import _reference

    return _reference.SPLIT_FIXED


def check_steps(
    w: Workload, mode: Mode, reference: Outcome, mine: Outcome, fixed: dict[str, Outcome],
    where: str,
) -> str | None:  # fmt: skip
    """The step bound (`step_bound`) of a corrected run; over it, the first counted carve-out
    (`_carveouts`) whose counterfactual brings the run within it. Returns its name."""
    from tests.properties import _carveouts

    bound = step_bound(w, mode, reference, fixed)
    if not mine.corrections or bound is None or mine.steps <= bound[1]:
        return None
    name, steps = bound
    split_fixed = fixed.get(_reference_split_fixed())
    bounds = [("", steps)]  # the bound, then 0.28's where stock's bound is over it
    if name == "stock" and split_fixed is not None and right(w, split_fixed, mode):
        bounds.append((_carveouts.ZERO_THAT_CLEARS, max(steps, split_fixed.steps)))
    runs: dict[str, Outcome] = {"": mine}
    for over, limit in bounds:
        for carveout, contexts in [("", ()), *_carveouts.COUNTERFACTUALS.items()]:
            if carveout not in runs:
                with contextlib.ExitStack() as stack:
                    for context in contexts:
                        stack.enter_context(context())
                    with registered():
                        runs[carveout] = drive(w, mode)
            other = runs[carveout]
            eagle = _carveouts.eagle_last_cacheable_realigns(w, other, mode, release())
            if right(w, other, mode) and other.steps <= limit + eagle:
                names = [n for n in (carveout, over) if n]
                if other.steps > limit:
                    names.append(_carveouts.EAGLE_LAST_CACHEABLE)
                return "+".join(names)
    fixed_steps = {r: o.steps for r, o in fixed.items()}
    raise AssertionError(
        f"the plugin corrected and needs {mine.steps} steps, more than {name}'s {steps} "
        f"(stock {reference.steps}, fixed {fixed_steps}), and no "
        f"carve-out explains it; plugin chunks {_chunks(mine, set(mine.chunks))}, stock "
        f"{_chunks(reference, set(reference.chunks))}; {where}"
    )


def hit_comparable(w: Workload, mine: Outcome) -> set[str]:
    """Requests whose hits depend on the cache alone: all of them where the plugin's chunks are
    stock's (no correction); else repeats submitted once their original finished, with a KV pool
    that evicts nothing (no `preempt`). Hits of a request submitted at a step depend on when
    the others ended their chunks, which a correction moves."""
    if not mine.corrections:
        return set(mine.hits)
    return set() if w.preempt else {r.request_id for r in w.requests if r.after}


def check_hits(
    w: Workload, mode: Mode, reference: Outcome, mine: Outcome, stock_bad: list[Any], where: str
) -> int | None:
    """Issue 36 item 4: no fewer prefix-hit tokens than stock where stock's chunks are right;
    under a block mismatch (cache_config.block_size below the cache's block), the hits of the
    same workload with the sizes agreeing. Returns the latter's hit tokens (None: no mismatch)."""
    if not stock_bad:
        fewer = {
            rid: (mine.hits.get(rid, 0), reference.hits[rid])
            for rid in hit_comparable(w, mine) & set(reference.hits)
            if mine.hits.get(rid, 0) < reference.hits[rid]
        }
        assert not fewer, f"fewer prefix-hit tokens than stock (plugin, stock): {fewer}; {where}"
    if w.scenario.configured_block_size is None:
        return None
    with registered():
        agreeing = drive(dataclasses.replace(w, scenario=w.scenario.pinned), mode)
    differ = {
        rid: (mine.hits.get(rid), agreeing.hits.get(rid))
        for rid in hit_comparable(w, mine) & set(agreeing.hits)
        if mine.hits.get(rid) != agreeing.hits.get(rid)
    }
    assert not differ, (
        f"under cache_config.block_size {w.scenario.configured_block_size} (cache block "
        f"{mine.block}) the plugin's hits differ from the sizes agreeing (mismatch, agreeing): "
        f"{differ}; {where}"
    )
    return sum(agreeing.hits.values())


def reached(w: Workload, mode: Mode, mine: Outcome) -> dict[str, int]:
    """The shapes issue 35 item 2 asks the generator to reach, counted per workload."""
    s, out = w.scenario, {}
    mm = [r for r in s.requests if r.has_mm]
    if len(mm) >= 2:
        sizes = sorted((n for r in mm for n in _input_costs(r)), reverse=True)
        items = s.encoder_cache // sizes[0] if sizes else 0
        for name, count in (("sent", len(mm)), ("running_at_once", mine.concurrent_mm)):
            if 1 <= items <= 3 and count >= 2:
                bucket = "2-4" if count <= 4 else "5-12" if count <= 12 else "13-48"
                out[f"reach_mm_requests_{name}_{bucket}_cache_{items}_items"] = 1
    if mode.speculative:
        b = s.block_size
        starts = [st for r in s.requests for st, _ in r.mm_spans if st >= b - 1]
        for name, off in (("on", 0), ("one_before", b - 1), ("one_after", 1)):
            if any(st % b == off for st in starts):
                out[f"reach_mtp_input_{name}_boundary"] = 1
    if 0 < s.threshold < s.budget:
        out["reach_threshold_below_budget"] = 1
    if mine.resumed_while_held:
        out["reach_resumed_while_another_holds_an_input"] = 1
    return out


def _input_costs(r: PropRequest) -> list[int]:
    return [n for _, n in r.images] + [v.num_embeds if v.is_embed else v.length for v in r.videos]


def _chunks(run: Outcome, rids: set[str]) -> dict[str, list[tuple[int, int]]]:
    return {rid: run.spans(rid)[:8] for rid in sorted(rids)}
