"""Section 1: cost of the wrapper on the scheduler's hot path (vLLM 0.27.1, in-process).

``schedule()``: two identical schedulers (same requests, same warm-up) step in lockstep; before
each timed ``schedule()`` the class attribute is set to the wrapper on one and to the original
(``__wrapped__``) on the other, and which one goes first alternates. Both therefore see the same
state at every step; the chunks they schedule are compared, so a divergence would show.

Microbench: the method itself, wrapper against original, on the same request objects.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import quantiles

METHOD = "_mamba_block_aligned_split"

# Workload: 256 running requests, text and image, prefill and decode. Running order (= admission
# order): image prefills, decodes, text prefills. long_prefill_token_threshold = 2 blocks, so
# several prefills share a step, as deployments with many concurrent prompts configure it. The
# image prefills come first so they always get whole 2-block chunks: then the plugin never changes
# a decision and both arms stay in the same state (checked: ``diverged_steps``). The text prefills
# behind them get the leftover budget, which stock floors to 0 (out of the plugin's scope).
N_IMAGE_PREFILL = 3
N_TEXT_DECODE = 150
N_IMAGE_DECODE = 42
N_TEXT_PREFILL = 61


def _scheduler_class() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def methods() -> tuple[Callable[..., int], Callable[..., int]]:
    """(wrapper, original). The plugin must be registered."""
    wrapper = _scheduler_class().__dict__[METHOD]
    original = getattr(wrapper, "__wrapped__", None)
    if original is None:
        raise RuntimeError("the scheduler's split is not wrapped; register the plugin first")
    return wrapper, original


def _specs() -> list[Any]:
    from tools.sched_harness import RequestSpec

    specs = []
    seed = 0

    def add(rid: str, prompt: int, images: tuple[tuple[int, int], ...], max_tokens: int) -> None:
        nonlocal seed
        seed += 1
        specs.append(RequestSpec(rid, prompt, images, max_tokens=max_tokens, seed=seed))

    for i in range(N_IMAGE_PREFILL):
        offset = 1_000 + i * 101
        images = tuple((offset + k * 15_000, 1_500) for k in range(4))
        add(f"ip{i}", 64_000, images, 16)
    for i in range(N_TEXT_DECODE):
        add(f"td{i}", 300 + (i * 37) % 600, (), 30_000)
    for i in range(N_IMAGE_DECODE):
        add(f"id{i}", 1_200, ((20 + i * 7, 576),), 30_000)
    for i in range(N_TEXT_PREFILL):
        add(f"tp{i}", 40_000 + i * 13, (), 16)
    return specs


def build_pair() -> tuple[Any, Any]:
    """Two identical harnesses, warmed up to 256 running requests."""
    from tools.sched_harness import Harness, HarnessConfig

    cfg = HarnessConfig(
        max_num_batched_tokens=8192,
        encoder_cache_tokens=65_536,
        long_prefill_token_threshold=2112,
        num_blocks=5_000,
        max_num_seqs=256,
        max_model_len=65_536,
    )
    pair = []
    for _ in range(2):
        harness = Harness(cfg)
        harness.add(*_specs())
        scheduler = harness.scheduler
        # Admit everyone in one warm-up step with a large budget, then the real budget.
        budget = scheduler.max_num_scheduled_tokens
        scheduler.max_num_scheduled_tokens = 1 << 22
        harness.step()
        scheduler.max_num_scheduled_tokens = budget
        for _ in range(3):
            harness.step()
        pair.append(harness)
    return pair[0], pair[1]


def _timed_schedule(scheduler: Any, sink: list[int]) -> None:
    """Shadow ``scheduler.schedule`` with a timing shim (same cost in both arms)."""
    bound = type(scheduler).schedule.__get__(scheduler)
    clock = time.perf_counter_ns

    def schedule(*args: Any, **kwargs: Any) -> Any:
        gc.disable()
        t0 = clock()
        try:
            return bound(*args, **kwargs)
        finally:
            sink.append(clock() - t0)
            gc.enable()

    scheduler.schedule = schedule


def _count_calls(harness: Any, cls: type, original: Callable[..., int]) -> tuple[int, int]:
    """Split calls in one ``schedule()``, and how many miss the wrapper's fast path."""
    from vllm_mamba_fix.decision import can_need_correction

    calls = slow = 0

    def counting(self: Any, request: Any, n: int, *args: Any, **kwargs: Any) -> int:
        nonlocal calls, slow
        calls += 1
        stock = original(self, request, n, *args, **kwargs)
        start = request.num_computed_tokens + sum(args) + sum(kwargs.values())
        slow += can_need_correction(stock, n, start, self.cache_config.block_size)
        return stock

    setattr(cls, METHOD, counting)
    try:
        # Class method, not the timing shim; the state is not reused afterwards.
        type(harness.scheduler).schedule(harness.scheduler)
    finally:
        setattr(cls, METHOD, original)
    return calls, slow


def schedule_bench(rounds: int, steps: int) -> dict[str, Any]:
    cls = _scheduler_class()
    wrapper, original = methods()
    ratios: list[float] = []
    patched_ns: list[int] = []
    stock_ns: list[int] = []
    diverged = 0
    running: list[int] = []
    calls_per_step: list[int] = []
    slow_per_step: list[int] = []
    try:
        for r in range(rounds):
            setattr(cls, METHOD, original)
            a, b = build_pair()  # a: patched arm, b: stock arm
            if r % 2:  # swap the objects' roles every round: no arm owns one scheduler
                a, b = b, a
            sink_a: list[int] = []
            sink_b: list[int] = []
            _timed_schedule(a.scheduler, sink_a)
            _timed_schedule(b.scheduler, sink_b)
            running.append(len(a.scheduler.running))
            for s in range(steps):
                gc.collect()
                order = ((a, wrapper), (b, original))
                if (r + s) % 2:
                    order = order[::-1]
                chunks = {}
                for harness, method in order:
                    setattr(cls, METHOD, method)
                    chunks[id(harness)] = harness.step()
                if chunks[id(a)] != chunks[id(b)]:
                    diverged += 1
            setattr(cls, METHOD, original)
            calls, slow = _count_calls(b, cls, original)
            calls_per_step.append(calls)
            slow_per_step.append(slow)
            for ta, tb in zip(sink_a, sink_b, strict=True):
                ratios.append(ta / tb)
            patched_ns += sink_a
            stock_ns += sink_b
    finally:
        setattr(cls, METHOD, wrapper)
    p = quantiles([t / 1e3 for t in patched_ns])
    s = quantiles([t / 1e3 for t in stock_ns])
    calls = sum(calls_per_step) / len(calls_per_step)
    return {
        "ratio": quantiles(ratios),
        "patched_us": p,
        "stock_us": s,
        "running_requests": min(running),
        "split_calls_per_step": calls,
        "slow_path_calls_per_step": sum(slow_per_step) / len(slow_per_step),
        "added_us_per_call_from_schedule": (p["median"] - s["median"]) / calls,
        "diverged_steps": diverged,
        "steps": len(ratios),
    }


# --------------------------------------------------------------------------- microbench


def _micro_cases(harness: Any) -> dict[str, tuple[Any, int]]:
    """(request, num_new_tokens) per path of the wrapper, on real ``Request`` objects."""
    from tools.sched_harness import RequestSpec, make_request

    b = harness.block_size

    def request(rid: str, prompt: int, computed: int, images: tuple = ()) -> Any:
        req = make_request(harness.built, RequestSpec(rid, prompt, images, seed=len(rid)))
        req.num_computed_tokens = computed
        return req

    image = ((3 * b + 100, 2_000),)
    decode = request("decode", 2_000, 2_000)
    decode.append_output_token_ids(7)
    return {
        # decode step: stock returns n at once (start past the prompt)
        "decode": (decode, 1),
        # prefill chunk from a boundary ending on one: fast path
        "prefill aligned": (request("aligned", 20 * b, 2 * b), 4 * b),
        # prefill chunk from mid-block up to the next boundary: fast path
        "prefill mid-block": (request("inside", 20 * b, 2 * b + 10), b - 10),
        # stock floors a chunk to a boundary: slow path, no correction
        "slow path, no change": (request("slow", 20 * b, 2 * b), 3 * b + 500),
        # text prefill behind others, left a sub-block budget: stock floors it to 0, the wrapper
        # asks the scope hook (pluggy) and keeps 0 (every step, for every such request)
        "slow path, text prefill starved": (request("starved", 20 * b, 2 * b), 500),
        # chunk cut at an image start, not a boundary: slow path, second call to the original,
        # correction recorded (rare: once per image per request)
        "slow path, encoder stop": (request("enc", 20 * b, 2 * b, image), b + 100),
    }


def _calibrate(scheduler: Any, req: Any, n: int, target_ns: int) -> int:
    """Loop count that makes one timed block last about ``target_ns``."""
    t0 = time.perf_counter_ns()
    for _ in range(100):
        scheduler._mamba_block_aligned_split(req, n)
    per_call = max((time.perf_counter_ns() - t0) / 100, 1.0)
    return max(100, int(target_ns / per_call))


def prototypes(original: Callable[..., int], wrapper: Callable[..., int]) -> dict[str, Any]:
    """Wrappers that bound what any wrapper can cost (not the plugin's code; not shipped).

    - ``bare``: calls the original and returns its result: the floor of any Python wrapper;
    - ``inlined``: the plugin's fast-path test written inline (no helper call, decode answered
      from ``num_new_tokens == 1`` alone, since a 1-token chunk never crosses a boundary); other
      cases go to the plugin's wrapper (so only the fast-path cases are timed with it).
    """

    def bare(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> int:
        return original(self, request, num_new_tokens, *args, **kwargs)

    def inlined(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> int:
        stock = original(self, request, num_new_tokens, *args, **kwargs)
        if stock == num_new_tokens and not args and not kwargs:
            if stock == 1:
                return stock
            block_size = self.cache_config.block_size
            offset = request.num_computed_tokens % block_size
            if offset == 0 or offset + stock <= block_size:
                return stock
        return wrapper(self, request, num_new_tokens, *args, **kwargs)

    return {"bare": bare, "inlined": inlined}


FAST_PATH_CASES = ("decode", "prefill aligned", "prefill mid-block")


def micro_bench(repeats: int, target_ns: int) -> dict[str, Any]:
    """Per-call time through the bound method, each arm against the original, interleaved."""
    from tools.scenarios import ISSUE_CONFIG
    from tools.sched_harness import Harness
    from vllm_mamba_fix import counters

    cls = _scheduler_class()
    wrapper, original = methods()
    harness = Harness(ISSUE_CONFIG)
    scheduler = harness.scheduler
    clock = time.perf_counter_ns
    out: dict[str, Any] = {}
    try:
        for name, (req, n) in _micro_cases(harness).items():
            setattr(cls, METHOD, original)
            stock_result = scheduler._mamba_block_aligned_split(req, n)
            setattr(cls, METHOD, wrapper)
            patched_result = scheduler._mamba_block_aligned_split(req, n)
            loops = _calibrate(scheduler, req, n, target_ns)
            arms: dict[str, Callable[..., int]] = {"original": original, "wrapper": wrapper}
            if name in FAST_PATH_CASES:
                arms.update(prototypes(original, wrapper))
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            added: dict[str, list[float]] = {arm: [] for arm in arms if arm != "original"}
            rng = range(loops)
            order = list(arms.items())
            for i in range(repeats):
                sample = {}
                # rotate the order so no arm always runs first
                shift = i % len(order)
                for arm, method in order[shift:] + order[:shift]:
                    setattr(cls, METHOD, method)
                    split = scheduler._mamba_block_aligned_split
                    gc.disable()
                    t0 = clock()
                    for _ in rng:
                        split(req, n)
                    elapsed = clock() - t0
                    gc.enable()
                    sample[arm] = elapsed / loops / 1e3
                    times[arm].append(sample[arm])
                for arm in added:
                    added[arm].append(sample[arm] - sample["original"])
            out[name] = {
                "stock_result": stock_result,
                "patched_result": patched_result,
                "original_us": quantiles(times["original"])["median"],
                "wrapper_us": quantiles(times["wrapper"])["median"],
                "added_us": quantiles(added["wrapper"]),
                "prototype_added_us": {
                    arm: quantiles(v)["median"] for arm, v in added.items() if arm != "wrapper"
                },
                "loops": loops,
            }
    finally:
        setattr(cls, METHOD, wrapper)
        counters.reset()
    return out


def first_scope_call() -> dict[str, float]:
    """One-off: the first scope question builds the pluggy manager (scans entry points)."""
    from tools.scenarios import ISSUE_CONFIG
    from tools.sched_harness import Harness
    from vllm_mamba_fix.config import Scope
    from vllm_mamba_fix.scope import ScopePolicy

    harness = Harness(ISSUE_CONFIG)
    req, _ = _micro_cases(harness)["slow path, text prefill starved"]
    policy = ScopePolicy(Scope.MULTIMODAL)
    times = []
    for _ in range(3):
        t0 = time.perf_counter_ns()
        policy.in_scope(req)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return {"first_us": times[0], "later_us": min(times[1:])}


def run(profile: str) -> dict[str, Any]:
    if profile == "smoke":
        return {"schedule": schedule_bench(rounds=1, steps=16), "micro": micro_bench(9, 2_000_000),
                "scope_first_call": first_scope_call()}  # fmt: skip
    return {"schedule": schedule_bench(rounds=8, steps=25), "micro": micro_bench(41, 10_000_000),
            "scope_first_call": first_scope_call()}  # fmt: skip
