"""Section 1: cost of the wrappers on the scheduler's hot path (vLLM 0.27.1, in-process).

Three arms, side by side in one run (issue 11 item 3):

- ``stock``: both methods vLLM's own (``__wrapped__``);
- ``split``: the 0.1.0-equivalent plugin: only the split wrapper (the same wrapper object
  the plugin installs; its fast path is unchanged since 0.1.0), the encoder method stock;
- ``split+encoder``: the plugin as installed now: the split wrapper and the wrapper on
  ``_try_schedule_encoder_inputs`` (speculative-stall rule; the stall watchdog, on, looks
  once per step from ``update_from_output``).

``schedule()``: three identical schedulers (same requests, same warm-up) step in lockstep;
before each timed ``schedule()`` the class attributes are set to that arm's methods, and the
arms run in every order in turn (``common.arm_order``). All three see the same state at every
step; the chunks they schedule are compared, so a divergence would show.

Microbench: each method itself, wrapper against original, on the same request objects.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from benchmarks.common import arm_order, quantiles

METHOD = "_mamba_block_aligned_split"
ENCODER_METHOD = "_try_schedule_encoder_inputs"
# arm -> which wrapped methods it installs
ARMS: dict[str, tuple[str, ...]] = {
    "stock": (),
    "split": (METHOD,),
    "split+encoder": (METHOD, ENCODER_METHOD),
}

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


def methods(name: str = METHOD) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(wrapper, original) of ``name``. The plugin must be registered."""
    wrapper = _scheduler_class().__dict__[name]
    original = getattr(wrapper, "__wrapped__", None)
    if original is None:
        raise RuntimeError(f"the scheduler's {name} is not wrapped; register the plugin first")
    return wrapper, original


def arm_methods() -> dict[str, dict[str, Callable[..., Any]]]:
    """Per arm, the function to set on the class for each of the two methods."""
    pairs = {name: methods(name) for name in (METHOD, ENCODER_METHOD)}
    return {
        arm: {name: pairs[name][0 if name in wrapped else 1] for name in pairs}
        for arm, wrapped in ARMS.items()
    }


def _install(cls: type, functions: dict[str, Callable[..., Any]]) -> None:
    for name, fn in functions.items():
        setattr(cls, name, fn)


def watchdog_settings() -> dict[str, Any]:
    """What the installed wrappers were built with: the watchdog's seconds from the
    update_from_output wrapper (its carrier), the speculative-stall rule from the encoder's."""
    from vllm_mamba_fix.facts import targets

    cls = _scheduler_class()
    update = getattr(cls.__dict__.get(targets.UPDATE_METHOD), targets.MARKER, None)
    encoder = getattr(cls.__dict__.get(ENCODER_METHOD), targets.MARKER, None)
    return {
        "stall_seconds": getattr(update, "stall_seconds", None),
        "release_speculative_stalls": getattr(encoder, "release_speculative_stalls", False),
    }


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


def build_many(count: int) -> list[Any]:
    """``count`` identical harnesses, warmed up to 256 running requests."""
    from tools.sched_harness import Harness, HarnessConfig

    cfg = HarnessConfig(
        max_num_batched_tokens=8192,
        encoder_cache_tokens=65_536,
        long_prefill_token_threshold=2112,
        num_blocks=5_000,
        max_num_seqs=256,
        max_model_len=65_536,
    )
    built = []
    for _ in range(count):
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
        built.append(harness)
    return built


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


def _count_calls(harness: Any, cls: type, stock: dict[str, Callable[..., Any]]) -> dict[str, int]:
    """Calls of both methods in one ``schedule()``: split calls and how many miss the split
    wrapper's fast path; encoder calls and how many returned 0 (all the speculative-stall rule
    looks at)."""
    from vllm_mamba_fix.decide.decision import can_need_correction

    split, encoder = stock[METHOD], stock[ENCODER_METHOD]
    n = {"split": 0, "split_slow": 0, "encoder": 0, "encoder_zero": 0}

    def counting_split(self: Any, request: Any, new: int, *args: Any, **kwargs: Any) -> int:
        n["split"] += 1
        result = split(self, request, new, *args, **kwargs)
        start = request.num_computed_tokens + sum(args) + sum(kwargs.values())
        n["split_slow"] += can_need_correction(result, new, start, self.cache_config.block_size)
        return result

    def counting_encoder(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        n["encoder"] += 1
        result = encoder(self, request, *args, **kwargs)
        n["encoder_zero"] += not result[1]
        return result

    _install(cls, {METHOD: counting_split, ENCODER_METHOD: counting_encoder})
    try:
        # Class method, not the timing shim; the state is not reused afterwards.
        type(harness.scheduler).schedule(harness.scheduler)
    finally:
        _install(cls, stock)
    return n


def _per_call(diffs_ns: list[float], calls: float) -> dict[str, float]:
    """Paired per-step differences (ns) as us per call: median and IQR."""
    return quantiles([d / 1e3 / calls for d in diffs_ns]) if calls else quantiles([])


def schedule_bench(rounds: int, steps: int) -> dict[str, Any]:
    cls = _scheduler_class()
    arms = arm_methods()
    names = list(arms)
    times: dict[str, list[int]] = {name: [] for name in names}
    diverged = 0
    running: list[int] = []
    counts: list[dict[str, int]] = []
    try:
        for r in range(rounds):
            _install(cls, arms["stock"])
            harnesses = build_many(len(names))
            # Rotate the objects' roles every round: no arm owns one scheduler.
            owner = {name: harnesses[(i + r) % len(names)] for i, name in enumerate(names)}
            sinks: dict[str, list[int]] = {name: [] for name in names}
            for name in names:
                _timed_schedule(owner[name].scheduler, sinks[name])
            running.append(len(harnesses[0].scheduler.running))
            for s in range(steps):
                gc.collect()
                chunks = {}
                for name in arm_order(names, r * steps + s):
                    _install(cls, arms[name])
                    chunks[name] = owner[name].step()
                if any(chunks[name] != chunks["stock"] for name in names):
                    diverged += 1
            _install(cls, arms["stock"])
            counts.append(_count_calls(owner["stock"], cls, arms["stock"]))
            for name in names:
                times[name] += sinks[name]
    finally:
        _install(cls, arms["split+encoder"])  # the plugin as registered
    per_step = {k: sum(c[k] for c in counts) / len(counts) for k in counts[0]}

    def ratio(a: str, b: str) -> dict[str, float]:
        return quantiles([x / y for x, y in zip(times[a], times[b], strict=True)])

    def diff(a: str, b: str) -> list[float]:
        return [x - y for x, y in zip(times[a], times[b], strict=True)]

    return {
        "arms": names,
        "us_per_step": {name: quantiles([t / 1e3 for t in times[name]]) for name in names},
        "ratio": {
            "split/stock": ratio("split", "stock"),
            "split+encoder/stock": ratio("split+encoder", "stock"),
            "split+encoder/split": ratio("split+encoder", "split"),
        },
        # Paired per-step differences, per call of the wrapper that differs between the arms.
        "added_us_per_split_call": _per_call(diff("split", "stock"), per_step["split"]),
        "added_us_per_encoder_call": _per_call(diff("split+encoder", "split"), per_step["encoder"]),
        "running_requests": min(running),
        "calls_per_step": per_step,
        "watchdog": watchdog_settings(),
        "diverged_steps": diverged,
        "steps": len(times["stock"]),
    }


# --------------------------------------------------------------------------- microbench


@dataclass(frozen=True)
class MicroCase:
    method: str  # METHOD or ENCODER_METHOD
    args: tuple[Any, ...]  # after self
    # "fast": the wrapper's common path (target applies); else how often the path runs
    kind: str


def _micro_cases(harness: Any) -> dict[str, MicroCase]:
    """Per path of each wrapper, its arguments on real ``Request`` objects."""
    from tools.sched_harness import RequestSpec, make_request

    b = harness.block_size
    budget = harness.scheduler.max_num_encoder_input_tokens

    def request(rid: str, prompt: int, computed: int, images: tuple = ()) -> Any:
        req = make_request(harness.built, RequestSpec(rid, prompt, images, seed=len(rid)))
        req.num_computed_tokens = computed
        return req

    def split(req: Any, n: int, kind: str) -> MicroCase:
        return MicroCase(METHOD, (req, n), kind)

    def encoder(req: Any, computed: int, n: int, budget: int, kind: str) -> MicroCase:
        return MicroCase(ENCODER_METHOD, (req, computed, n, budget, 0), kind)

    image = ((3 * b + 100, 2_000),)
    decode = request("decode", 2_000, 2_000)
    decode.append_output_token_ids(7)
    image_decode = request("image-decode", 2_000, 2_000, ((100, 576),))
    image_decode.append_output_token_ids(7)
    return {
        # decode step: stock returns n at once (start past the prompt)
        "decode": split(decode, 1, "fast"),
        # prefill chunk from a boundary ending on one: fast path
        "prefill aligned": split(request("aligned", 20 * b, 2 * b), 4 * b, "fast"),
        # prefill chunk from mid-block up to the next boundary: fast path
        "prefill mid-block": split(request("inside", 20 * b, 2 * b + 10), b - 10, "fast"),
        # stock floors a chunk to a boundary: slow path, no correction
        "slow path, no change": split(
            request("slow", 20 * b, 2 * b), 3 * b + 500, "(rare: once per chunk/image)"
        ),
        # text prefill behind others, left a sub-block budget: stock floors it to 0, the wrapper
        # asks the scope hook (pluggy) and keeps 0 (every step, for every such request)
        "slow path, text prefill starved": split(
            request("starved", 20 * b, 2 * b), 500, "(every step, per budget-starved prefill)"
        ),
        # chunk cut at an image start, not a boundary: slow path, second call to the original,
        # correction recorded (rare: once per image per request)
        "slow path, encoder stop": split(
            request("enc", 20 * b, 2 * b, image), b + 100, "(rare: once per chunk/image)"
        ),
        # encoder wrapper: an image request's decode step (nothing in the window)
        "encoder: image request decode": encoder(image_decode, 2_000, 1, budget, "fast"),
        # encoder wrapper: a prefill chunk that schedules an image
        "encoder: prefill chunk schedules an image": encoder(
            request("enc-prefill", 20 * b, 2 * b, image), 2 * b, 4 * b, budget, "fast"
        ),
        # encoder wrapper: 0 tokens (no encoder budget left, past the image start): the only
        # result the speculative-stall rule looks at (the watchdog looks once per step)
        "encoder: returned 0 (speculative-stall rule looks)": encoder(
            request("enc-zero", 20 * b, 3 * b + 110, image),
            3 * b + 110,
            2 * b,
            0,
            "(only a call that returned 0)",
        ),
    }


def _loop(fn: Callable[..., Any], args: tuple[Any, ...], loops: int) -> int:
    """``loops`` calls of ``fn(*args)``, unpacked outside the loop; returns ns."""
    clock = time.perf_counter_ns
    rng = range(loops)
    if len(args) == 2:
        a, b = args
        t0 = clock()
        for _ in rng:
            fn(a, b)
        return clock() - t0
    a, b, c, d, e = args
    t0 = clock()
    for _ in rng:
        fn(a, b, c, d, e)
    return clock() - t0


def _calibrate(scheduler: Any, case: MicroCase, target_ns: int) -> int:
    """Loop count that makes one timed block last about ``target_ns``."""
    per_call = max(_loop(getattr(scheduler, case.method), case.args, 100) / 100, 1.0)
    return max(100, int(target_ns / per_call))


def prototypes(original: Callable[..., int], wrapper: Callable[..., int]) -> dict[str, Any]:
    """Split wrappers that bound what any wrapper can cost (not the plugin's code; not shipped).

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


def encoder_prototypes(original: Callable[..., Any]) -> dict[str, Any]:
    """``bare``: an encoder wrapper that only calls the original (same parameters as the
    plugin's): the floor; the plugin's wrapper minus this is what its checks cost."""

    def bare(self: Any, request: Any, computed: int, new: int, budget: int, shift: int = 0) -> Any:
        return original(self, request, computed, new, budget, shift)

    return {"bare": bare}


def micro_bench(repeats: int, target_ns: int) -> dict[str, Any]:
    """Per-call time through the bound method, each arm against the original, interleaved."""
    from tools.scenarios import ISSUE_CONFIG
    from tools.sched_harness import Harness
    from vllm_mamba_fix.changes import installation
    from vllm_mamba_fix.observe import counters

    cls = _scheduler_class()
    installed = {name: methods(name) for name in (METHOD, ENCODER_METHOD)}
    harness = Harness(ISSUE_CONFIG)
    scheduler = harness.scheduler
    out: dict[str, Any] = {}
    try:
        for name, case in _micro_cases(harness).items():
            wrapper, original = installed[case.method]
            setattr(cls, case.method, original)
            stock_result = getattr(scheduler, case.method)(*case.args)
            setattr(cls, case.method, wrapper)
            patched_result = getattr(scheduler, case.method)(*case.args)
            loops = _calibrate(scheduler, case, target_ns)
            arms: dict[str, Callable[..., Any]] = {"original": original, "wrapper": wrapper}
            if case.kind == "fast":
                arms.update(
                    prototypes(original, wrapper)
                    if case.method == METHOD
                    else encoder_prototypes(original)
                )
            times: dict[str, list[float]] = {arm: [] for arm in arms}
            added: dict[str, list[float]] = {arm: [] for arm in arms if arm != "original"}
            over_bare: list[float] = []
            order = list(arms.items())
            for i in range(repeats):
                sample = {}
                for arm, method in arm_order(order, i):
                    setattr(cls, case.method, method)
                    bound = getattr(scheduler, case.method)
                    gc.disable()
                    elapsed = _loop(bound, case.args, loops)
                    gc.enable()
                    sample[arm] = elapsed / loops / 1e3
                    times[arm].append(sample[arm])
                for arm in added:
                    added[arm].append(sample[arm] - sample["original"])
                if "bare" in sample:
                    over_bare.append(sample["wrapper"] - sample["bare"])
            out[name] = {
                "method": case.method,
                "kind": case.kind,
                "stock_result": _result(stock_result),
                "patched_result": _result(patched_result),
                "original_us": quantiles(times["original"])["median"],
                "wrapper_us": quantiles(times["wrapper"])["median"],
                "added_us": quantiles(added["wrapper"]),
                "prototype_added_us": {
                    arm: quantiles(v)["median"] for arm, v in added.items() if arm != "wrapper"
                },
                "over_bare_us": quantiles(over_bare) if over_bare else None,
                "loops": loops,
            }
            setattr(cls, case.method, wrapper)
    finally:
        for wrapper, _original in installed.values():
            setattr(cls, wrapper.__name__, wrapper)
        installation.memory.pop(counters.Tally, None)  # the counts it made
    return out


def _result(value: Any) -> Any:
    """Tokens a call returned (the encoder method returns a tuple; its [1] is the tokens)."""
    return value[1] if isinstance(value, tuple) else value


def scope_load() -> dict[str, Any]:
    """What the plugin runs: ``ScopePolicy.load()`` once when it patches the scheduler (reads
    the installed entry points; builds pluggy's manager only where a scope rule is installed),
    then scope checks inside schedule() steps.

    Timed on a policy of the installed wrapper's scope, loaded the way the plugin loads it;
    ``installed_loaded`` says whether the plugin's own policy was loaded by the patch."""
    from tools.scenarios import ISSUE_CONFIG
    from tools.sched_harness import Harness
    from vllm_mamba_fix.decide.scope import ScopePolicy
    from vllm_mamba_fix.facts import targets

    installed = getattr(_scheduler_class().__dict__[METHOD], targets.MARKER).scope
    loaded_by_patch = bool(installed._loaded)
    harness = Harness(ISSUE_CONFIG)
    req = _micro_cases(harness)["slow path, text prefill starved"].args[0]
    policy = ScopePolicy(installed.scope)
    t0 = time.perf_counter_ns()
    policy.load()  # at patch time, not in a step
    load_us = (time.perf_counter_ns() - t0) / 1e3
    times = []
    for _ in range(3):
        t0 = time.perf_counter_ns()
        policy.in_scope(req)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return {"load_us": load_us, "first_us": times[0], "later_us": min(times[1:]),
            "installed_loaded": loaded_by_patch}  # fmt: skip


# --------------------------------------------------------------------------- text-only step

# Issue 22 item 6: text only, the engine's step (schedule() + update_from_output()), the
# plugin as registered against stock, side by side. 192 decodes and 64 prefills behind them.
N_TEXT_ONLY_DECODE = 192
N_TEXT_ONLY_PREFILL = 64


def plugin_step_methods() -> dict[str, tuple[Callable[..., Any], Callable[..., Any]]]:
    """Every method the plugin wrapped on the class that a step can call (``__init__`` is
    not one): name -> (wrapper, original)."""
    from vllm_mamba_fix.facts import targets

    cls = _scheduler_class()
    return {
        name: (fn, fn.__wrapped__)
        for name, fn in vars(cls).items()
        if hasattr(fn, targets.MARKER) and name != "__init__"
    }


def _text_specs() -> list[Any]:
    from tools.sched_harness import RequestSpec

    specs = [
        RequestSpec(f"d{i}", 300 + (i * 37) % 900, (), max_tokens=30_000, seed=i + 1)
        for i in range(N_TEXT_ONLY_DECODE)
    ]
    specs += [
        RequestSpec(f"p{i}", 30_000 + i * 17, (), max_tokens=16, seed=1_000 + i)
        for i in range(N_TEXT_ONLY_PREFILL)
    ]
    return specs


def _build_text(count: int) -> list[Any]:
    """``count`` identical harnesses, built with the plugin installed (as the engine builds
    its scheduler), warmed up to 256 running text requests."""
    from tools.sched_harness import Harness, HarnessConfig

    cfg = HarnessConfig(
        max_num_batched_tokens=8192,
        encoder_cache_tokens=16_384,
        long_prefill_token_threshold=2112,
        num_blocks=5_000,
        max_num_seqs=256,
        max_model_len=65_536,
    )
    built = []
    for _ in range(count):
        harness = Harness(cfg)
        harness.add(*_text_specs())
        scheduler = harness.scheduler
        budget = scheduler.max_num_scheduled_tokens
        scheduler.max_num_scheduled_tokens = 1 << 22  # admit everyone in one warm-up step
        harness.step()
        scheduler.max_num_scheduled_tokens = budget
        for _ in range(3):
            harness.step()
        built.append(harness)
    return built


def shadow_step(scheduler: Any, around: Callable[..., Any]) -> None:
    """Shadow ``schedule`` and ``update_from_output`` on ``scheduler``: each call runs
    ``around(name, method, args, kwargs)`` with the class's method looked up at that call, so
    the arm installed for the step runs (one bound here would keep this moment's for every arm)."""
    cls = type(scheduler)
    for name in ("schedule", "update_from_output"):

        def shadowed(*args: Any, _name: str = name, **kwargs: Any) -> Any:
            return around(_name, getattr(cls, _name).__get__(scheduler), args, kwargs)

        setattr(scheduler, name, shadowed)


def _timed_step(scheduler: Any, sink: list[int]) -> None:
    """Each step's sink entry is the time of ``schedule()`` + ``update_from_output()`` (the
    harness's fake model runner between them is not timed)."""
    clock = time.perf_counter_ns

    def timed(name: str, method: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        gc.disable()
        t0 = clock()
        try:
            return method(*args, **kwargs)
        finally:
            elapsed = clock() - t0
            gc.enable()
            if name == "schedule":
                sink.append(elapsed)
            else:
                sink[-1] += elapsed

    shadow_step(scheduler, timed)


# The watchdog's clock in the step benches: this many seconds a step, the stock step's time
# here (about 5 ms), as an engine stepping back to back reads its clock.
ENGINE_STEP_SECONDS = 0.005


@contextlib.contextmanager
def engine_time() -> Iterator[None]:
    """The watchdog samples once a second of its clock; an engine steps back to back, so on
    this machine that is one step in about 200. The benches spend far more untimed time
    between a scheduler's steps (a ``gc.collect()`` a step, the other arms' steps, the fake
    runner), which on the wall clock would put a sample in every fifth step or so. Its clock
    here advances one engine step per look (the look reads it once a step); a sample's own
    cost is timed apart (:func:`sample_cost`). The same holds for the send of quiet counts
    (once a second): their clock advances one engine step per read (at most two a step)."""
    from vllm_mamba_fix.observe import counters
    from vllm_mamba_fix.rules import stall_watch

    real, real_sends = stall_watch.clock, counters.clock
    stall_watch.clock = itertools.count(0.0, ENGINE_STEP_SECONDS).__next__
    counters.clock = itertools.count(0.0, ENGINE_STEP_SECONDS).__next__
    try:
        yield
    finally:
        stall_watch.clock, counters.clock = real, real_sends


def sample_cost(harness: Any, pairs: int) -> dict[str, Any]:
    """What one of the watchdog's samples adds to a step: ``pairs`` steps of the plugin as
    installed whose look samples (its clock a second on), each before one that does not."""
    from vllm_mamba_fix.rules import stall_watch

    sinks: dict[bool, list[int]] = {True: [], False: []}
    real, now = stall_watch.clock, 1e6
    try:
        for sampled in [True, False] * pairs:
            now += 1.0 if sampled else 0.0
            stall_watch.clock = itertools.repeat(now).__next__
            _timed_step(harness.scheduler, sinks[sampled])
            gc.collect()
            harness.step()
    finally:
        stall_watch.clock = real
    return quantiles([(y - x) / 1e3 for x, y in zip(sinks[False], sinks[True], strict=True)])


@engine_time()
def text_step_bench(rounds: int, steps: int) -> dict[str, Any]:
    """Stock against the plugin as registered, text only, schedule() + update_from_output()."""
    cls = _scheduler_class()
    wrapped = plugin_step_methods()
    arms = {
        "stock": {name: pair[1] for name, pair in wrapped.items()},
        "plugin": {name: pair[0] for name, pair in wrapped.items()},
    }
    names = list(arms)
    times: dict[str, list[int]] = {name: [] for name in names}
    diverged = 0
    running: list[int] = []
    try:
        for r in range(rounds):
            _install(cls, arms["plugin"])
            harnesses = _build_text(len(names))
            owner = {name: harnesses[(i + r) % len(names)] for i, name in enumerate(names)}
            sinks: dict[str, list[int]] = {name: [] for name in names}
            for name in names:
                _timed_step(owner[name].scheduler, sinks[name])
            running.append(len(harnesses[0].scheduler.running))
            for s in range(steps):
                gc.collect()
                chunks = {}
                for name in arm_order(names, r * steps + s):
                    _install(cls, arms[name])
                    chunks[name] = owner[name].step()
                diverged += chunks["plugin"] != chunks["stock"]
            for name in names:
                times[name] += sinks[name]
    finally:
        _install(cls, arms["plugin"])  # the plugin as registered
    return {
        "arms": names,
        "wrapped": sorted(wrapped),
        "us_per_step": {name: quantiles([t / 1e3 for t in times[name]]) for name in names},
        "ratio": quantiles([x / y for x, y in zip(times["plugin"], times["stock"], strict=True)]),
        "running_requests": min(running),
        "diverged_steps": diverged,
        "steps": len(times["stock"]),
    }


def run(profile: str) -> dict[str, Any]:
    """The hot path's measures (the ``hotpath`` task; the ``engaged`` task, built on this module's
    helpers, is benchmarks/engaged.py's: benchmarks/worker.py)."""
    smoke = profile == "smoke"
    return {
        "schedule": schedule_bench(rounds=1, steps=16) if smoke else schedule_bench(8, 25),
        "micro": micro_bench(9, 2_000_000) if smoke else micro_bench(41, 10_000_000),
        "text_step": text_step_bench(rounds=1, steps=16) if smoke else text_step_bench(12, 40),
        "scope_load": scope_load(),
    }
