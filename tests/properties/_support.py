"""Strategies, invariant checks, profiles and run figures of the property suite (issue 5).

Every scenario runs in one harness mode (issue 10: {sync, async} x {no
speculation, MTP K=2}); the invariants are the same in every mode, with the
step bound and the decode-chunk shape following the mode (see each check).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tools import prop_adapters as pa
from tools.prop_adapters import PropRequest, PropScenario, Trace
from tools.release_facts import facts_for
from tools.scenarios import (
    deferred_free_hang,
    deferred_free_hang_gap,
    plugin_ends_deferred_free_hang,
)
from tools.sched_harness import SYNC, Mode, VideoSpec, video_tokens

REPO = Path(__file__).resolve().parents[2]

# --------------------------------------------------------------------------
# Profiles. `ci` is the default; HYPOTHESIS_PROFILE=long selects the release-check
# profile. The release matrix sets VLLM_MAMBA_FIX_PROPERTY_EXAMPLES to shrink ci.

_CI_EXAMPLES = int(os.environ.get("VLLM_MAMBA_FIX_PROPERTY_EXAMPLES", "0")) or None
_COMMON: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                              HealthCheck.data_too_large],
    "print_blob": True,
}  # fmt: skip
settings.register_profile("ci", max_examples=30, derandomize=True, database=None, **_COMMON)
settings.register_profile("long", max_examples=400, derandomize=False, **_COMMON)
PROFILE_NAME = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE_NAME not in ("ci", "long"):
    PROFILE_NAME = "ci"


def profile(ci_examples: int) -> settings:
    """Settings for one test: the active profile, with the test's own ci size.

    The ci size is per harness mode: a test runs it once in each mode.
    """
    base = settings.get_profile(PROFILE_NAME)
    if PROFILE_NAME == "ci":
        return settings(base, max_examples=_CI_EXAMPLES or ci_examples)
    return base


# --------------------------------------------------------------------------
# Strategies

MAX_REQUESTS = 4


def _family() -> Any:
    from tools.sched_harness import vllm_version
    from vllm_mamba_fix.facts.versions import family_for

    return family_for(vllm_version())


FAMILY = _family()
CHUNK_LENGTH_FAMILY = facts_for(FAMILY).stock_stays_misaligned
# Before 0.27 (which added a guard for blocks wider than the prefill cap) stock
# floors every sub-block chunk of a text request to 0, so a budget or
# long-prefill threshold below one block hangs text on stock.
SUB_BLOCK_CAP_HANGS_TEXT = CHUNK_LENGTH_FAMILY or FAMILY.name == "0.26"


# Image gaps named explicitly: 0 (Gemma/LFM2-VL ranges include their markers),
# 1, and 2 (Qwen's <|vision_end|><|vision_start|>). Under EAGLE-type
# speculation gaps below 2 meet a separate vLLM hang (tools.scenarios.
# deferred_free_hang_gap); `min_image_gap` keeps them out there.
NAMED_IMAGE_GAPS = (0, 1, 2)


def min_image_gap_for(mode: Mode, version: str) -> int:
    """The smallest image gap the generator may draw in `mode` on `version`: every
    gap where the plugin ends the speculative stall (0.24-0.32) or there is none."""
    if not mode.speculative or plugin_ends_deferred_free_hang(version):
        return 0
    return deferred_free_hang_gap(version)


@st.composite
def video_shapes(draw: st.DrawFn, budget: int) -> tuple[int, int, bool]:
    """(temporal patches, pads per patch, is_embed on the pads) of one Qwen3-VL video,
    about as large as the generated images (16 .. 2 * max(budget, 256) tokens)."""
    frames = draw(st.integers(1, 4))
    per_frame = draw(st.integers(4, max(8, 2 * max(budget, 256) // frames)))
    return frames, per_frame, draw(st.booleans())


def encoder_cost(video: VideoSpec) -> int:
    """Encoder-cache slots a video takes: its pads with `is_embed`, else its whole range."""
    return video.num_embeds if video.is_embed else video.length


Body = tuple[int, tuple[tuple[int, int], ...], tuple[VideoSpec, ...]]


@st.composite
def request_bodies(
    draw: st.DrawFn,
    block: int,
    budget: int,
    with_images: bool,
    long: bool = False,
    min_image_gap: int = 0,
    videos: bool = False,
) -> Body:
    """A prompt: text runs before, between and after 0-4 images of varied sizes.

    With ``videos`` each placeholder is an image or a Qwen3-VL video (timestamp text,
    markers and pads per temporal patch; `is_embed` on the pads or off), so a prompt
    may hold images, videos or both. Between two placeholders the run is at least
    `min_image_gap` tokens, and gaps 0, 1 and 2 (those at or above the minimum) are
    drawn explicitly. Returns (prompt length, images, videos).
    """
    n_images = draw(st.integers(0, 4)) if with_images else 0
    # A long prompt runs several chunks, leaving block-aligned states to hit.
    first = draw(st.integers(block, 2 * block + 2 * budget)) if long else 0
    is_video = [videos and draw(st.booleans()) for _ in range(n_images)]
    shapes = [draw(video_shapes(budget)) if v else None for v in is_video]
    sizes = [
        len(video_tokens(shape[0], shape[1])[0])
        if shape
        else draw(st.integers(16, 2 * max(budget, 256)))
        for shape in shapes
    ]
    # Text runs around the blocks: short, about a block, or several blocks.
    text = st.one_of(
        st.integers(0, 64), st.integers(0, block + 32), st.integers(0, 3 * max(block, budget))
    )
    lo = min_image_gap
    named = [g for g in NAMED_IMAGE_GAPS if g >= lo]
    between = st.one_of(
        st.sampled_from(named) if named else st.nothing(),
        st.integers(lo, lo + 64), st.integers(lo, block + 32),
        st.integers(lo, 3 * max(block, budget)),
    )  # fmt: skip
    runs = [draw(text if i in (0, n_images) else between) for i in range(n_images + 1)]
    pos, images, video_specs = first + runs[0], [], []
    for size, shape, run in zip(sizes, shapes, runs[1:], strict=True):
        if shape:
            frames, per_frame, is_embed = shape
            video_specs.append(VideoSpec(pos, frames, per_frame, is_embed=is_embed))
        else:
            images.append((pos, size))
        pos += size + run
    return max(pos, 1), tuple(images), tuple(video_specs)


@st.composite
def scenarios(
    draw: st.DrawFn,
    *,
    text_only: bool = False,
    repeat: bool | None = None,
    min_image_gap: int = 0,
    videos: bool = False,
    two_units: bool = False,
) -> PropScenario:
    """Block 16..2096, budget, encoder cache from one image to all, threshold, requests.

    ``repeat``: True forces a repeated request, None lets hypothesis choose.
    ``min_image_gap``: fewest text tokens between two images of a request.
    ``videos``: placeholders may be Qwen3-VL videos too (request_bodies).
    ``two_units``: ``cache_config.block_size`` is set below the cache's block (a half or a
    quarter, before or after the scheduler is built), as vLLM #54076 reports.
    """
    block = draw(st.integers(1, 131)) * 16
    # Chunk-length families (0.15-0.25) floor every text chunk shorter than a
    # block to 0: a budget or threshold below the block hangs text requests on
    # stock, out of the plugin's default scope (regression example
    # test_regressions.test_sub_block_budget_hangs_text_on_stock). vLLM's own
    # config check rejects such budgets there; keep them >= one block.
    floor = block if SUB_BLOCK_CAP_HANGS_TEXT else 0
    # Budgets around the block size are where stock floors chunks to 0.
    budget = draw(
        st.one_of(
            st.integers(256, 4096),
            st.integers(block // 2, 3 * block),
            st.sampled_from([block, 2 * block]),
        )
    )
    budget = max(budget, 256, floor)
    threshold = draw(st.one_of(st.just(0), st.integers(max(64, floor), budget)))
    n = draw(st.integers(1, MAX_REQUESTS))
    requests: list[PropRequest] = []
    for i in range(n):
        with_images = not text_only and draw(st.booleans())
        long = bool(repeat) and i == 0
        prompt_len, images, video_specs = draw(
            request_bodies(block, budget, with_images, long, min_image_gap, videos)
        )
        requests.append(
            PropRequest(
                f"r{i}", prompt_len, images, content=f"c{i}",
                arrival=draw(st.integers(0, 6)), max_tokens=draw(st.integers(1, 3)),
                videos=video_specs,
            )
        )  # fmt: skip
    want_repeat = draw(st.booleans()) if repeat is None else repeat
    if want_repeat:
        original = requests[0 if repeat else draw(st.integers(0, len(requests) - 1))]
        after_finish = draw(st.booleans()) if repeat is None else True
        requests.append(
            PropRequest(
                f"r{len(requests)}-repeat-{original.request_id}", original.prompt_len,
                original.images, content=original.content,
                arrival=original.arrival + draw(st.integers(0, 4)),
                after=original.request_id if after_finish else None,
                max_tokens=draw(st.integers(1, 3)), videos=original.videos,
            )
        )  # fmt: skip
    # What each input takes in the encoder cache (a video with is_embed: its pads).
    image_sizes = sorted(
        [length for r in requests for _, length in r.images]
        + [encoder_cost(v) for r in requests for v in r.videos],
        reverse=True,
    )
    if image_sizes:
        # From one (the largest) image to all of a request's images, or all images.
        # Tight caches (one image) are where stock deadlocks.
        cache = draw(
            st.one_of(
                st.just(image_sizes[0]),
                st.integers(image_sizes[0], max(image_sizes[0], sum(image_sizes))),
            )
        )
    else:
        cache = draw(st.integers(256, 8192))
    configured, after = None, False
    if two_units:  # blocks are multiples of 16: a half or a quarter is a whole number
        configured = block // draw(st.sampled_from([2, 4]))
        after = draw(st.booleans())
    return PropScenario(block, budget, cache, threshold, tuple(requests), configured, after)


# --------------------------------------------------------------------------
# Invariants


def step_bound(scenario: PropScenario, mode: Mode = SYNC) -> int:
    """Invariant 1's bound on the number of steps until every request finished.

    Each prefill chunk of request r ends, strictly after the previous one, at a
    position where something stopped it:
      (a) a block boundary (the split, stock or re-aligned): <= ceil(P_r / B);
      (b) the start of an image (encoder budget or cache cut; the plugin's
          encoder stop and collapse prevention end there or at (a)): <= k_r;
      (c) the prompt end: 1;
      (d) a full per-request cap min(budget, long_prefill_threshold): <= ceil(P_r / cap);
      (e) the step's token budget running out: such a step schedules `budget`
          tokens, so there are <= ceil(sum_r (P_r + m_r) / budget) of them.
    A request then decodes m_r - 1 more single-token steps (the first token is
    sampled with the last prefill chunk). Every step in which a request is
    present schedules at least one chunk (else it is a stall, which this
    invariant forbids), and the chunk ends at a stop of kind (a)-(e) or is a
    decode step; each stop serves at most one step. Steps before the last
    arrival may be idle: + max arrival. Repeats submitted when the original
    finishes are submitted in that same step, adding no idle step.

    Modes: under EAGLE-type speculation the encoder cut sits one token before
    the image instead of at it, still one stop per image, and a decode step
    schedules 1 + K tokens. Async scheduling schedules step N+1 before step
    N's output is in: each request gets one more decode step (scheduled
    before its last token is known), and the last output lands one step
    later (+1), which also delays a repeat submitted after its original
    (+1 per such repeat). The speculative-stall rule (images < 2 tokens apart,
    0.24-0.32) acts on the second 0 at one position, at most twice per image
    (the cut without the shift, then the free), and its 1-token chunk is one
    more stop: + 5 per image under speculation.
    """
    b = scenario.block_size
    cap = min(scenario.budget, scenario.threshold or scenario.budget)
    lag = 1 if mode.async_scheduling else 0
    per_image = 6 if mode.speculative else 1
    per_request = sum(
        math.ceil(r.prompt_len / b) + per_image * len(r.mm_spans) + 1
        + math.ceil(r.prompt_len / cap)
        + r.max_tokens - 1 + lag + (lag if r.after else 0)
        for r in scenario.requests
    )  # fmt: skip
    decode_tokens = 1 + mode.speculative_tokens
    tokens = sum(r.prompt_len + (r.max_tokens + lag) * decode_tokens for r in scenario.requests)
    arrivals = max(r.arrival for r in scenario.requests)
    return arrivals + per_request + math.ceil(tokens / scenario.budget) + lag


def check_completes(scenario: PropScenario, trace: Trace, mode: Mode = SYNC) -> None:
    """Invariant 1: every request finished within step_bound()."""
    result = trace.result
    bound = step_bound(scenario, mode)
    assert result.completed, f"unfinished: {result.stall_at}; chunks {result.chunks}"
    assert result.steps <= bound, f"{result.steps} steps > bound {bound}"


def check_aligned(scenario: PropScenario, trace: Trace, mode: Mode = SYNC) -> None:
    """Invariant 2: no prefill chunk that starts mid-block ends past the next boundary.

    Every boundary a prefill chunk can cross is a full block whose Mamba state vLLM
    caches, also past `last_cache_position` under EAGLE-type speculation: the block a
    mid-block start leaves behind holds the state at that start, and a chunk that
    crosses the boundary gets it cached as the boundary's (vLLM #51113; stock 0.15-0.26
    do so under MTP, e.g. [1519, 1537) with block 1520 on 0.25.1, a text request).
    """
    bad = trace.result.violations(scenario.block_size)
    assert not bad, f"chunks crossing the next block boundary from mid-block: {bad}"


def check_each_token_once(scenario: PropScenario, trace: Trace, mode: Mode = SYNC) -> int:
    """Invariant 4: prompt tokens computed exactly once; returns the number of chunks checked.

    Prefill chunks are contiguous, without gap or overlap, and the last one ends
    at the prompt length. The first starts at 0 unless a prefix-cache hit skipped
    a cached prefix, which must be whole blocks (checked by invariant 5) of a
    request with the same content submitted earlier. Decode chunks follow, one
    token each, m - 1 of them.

    Other modes: the last prefill chunk may carry vLLM's K padding drafts (see
    below); decode chunks start at or past the prompt, each of 1 to 1 + K
    tokens (the harness's drafter proposes K and every real draft is
    accepted), at most m - 1 of them, plus one in async mode (scheduled before
    the last token is known).
    """
    result = trace.result
    by_id = {r.request_id: r for r in scenario.requests}
    checked = 0
    for rid, chunks in result.chunks.items():
        req = by_id[rid]
        prompt = req.prompt_len
        prefill = [(s, e) for _, s, e in chunks if s < prompt]
        decode = [(s, e) for _, s, e in chunks if s >= prompt]
        assert prefill, f"{rid}: no prefill chunk"
        first = prefill[0][0]
        if first:
            earlier = [
                r for r in scenario.requests
                if r.key == req.key and r.request_id != rid
                and trace.submitted.get(r.request_id, 1 << 30) <= trace.submitted[rid]
            ]  # fmt: skip
            assert earlier, f"{rid}: starts at {first} without an earlier identical request"
            assert first < prompt
        for (s0, e0), (s1, e1) in itertools.pairwise(prefill):
            assert e0 == s1, f"{rid}: gap or overlap between [{s0},{e0}) and [{s1},{e1})"
        assert all(s < e for s, e in prefill), f"{rid}: empty chunk {prefill}"
        # Under speculation vLLM pads a last prompt step of one token with K
        # placeholder drafts (`pad_spec_decode`), rejected afterwards.
        last, pad = prefill[-1][1], mode.speculative_tokens
        assert prompt <= last <= prompt + pad, f"{rid}: prefill ends at {last} != {prompt}"
        if mode == SYNC:
            expected = [(prompt + i, prompt + i + 1) for i in range(req.max_tokens - 1)]
            assert decode == expected, f"{rid}: decode chunks {decode}"
        else:
            lag = 1 if mode.async_scheduling else 0
            assert len(decode) <= req.max_tokens - 1 + lag, f"{rid}: decode chunks {decode}"
            assert all(1 <= e - s <= 1 + pad for s, e in decode), f"{rid}: decode {decode}"
        checked += len(chunks)
    return checked


def check_prefix_hits(scenario: PropScenario, trace: Trace, mode: Mode = SYNC) -> tuple[int, int]:
    """Invariant 5: hits end on a block boundary; a repeat of a finished request hits.

    A repeat submitted after its original finished must hit whenever the original
    left a cached Mamba state it can use: a prefill chunk of the original that
    ended on a block boundary before the last prompt token (vLLM recomputes at
    least the last token, and align mode caches the state at chunk ends on block
    boundaries). Returns (hits seen, repeats checked for a hit).

    Under EAGLE-type speculation vLLM drops the last matching block of a hit
    (the drafter recomputes it), so a state is usable only one block below the
    whole blocks of the first P - 1 tokens: e <= ((P - 1) // B - 1) * B.
    """
    b = scenario.block_size
    result = trace.result
    by_id = {r.request_id: r for r in scenario.requests}
    hits = must_hit = 0
    for rid, chunks in result.chunks.items():
        first = chunks[0][1] if chunks else 0
        if first:
            hits += 1
            assert first % b == 0, f"{rid}: prefix hit of {first} tokens, not whole blocks"
        if trace.repeat_of_finished.get(rid):
            req = by_id[rid]
            originals = [r.request_id for r in scenario.requests
                         if r.key == req.key and r.request_id != rid
                         and r.request_id in result.finished]  # fmt: skip
            limit = req.prompt_len - 1
            if mode.speculative:
                limit = ((req.prompt_len - 1) // b - 1) * b
            usable = [
                e for o in originals for _, _, e in result.chunks[o]
                if e % b == 0 and 0 < e <= limit
            ]  # fmt: skip
            if usable:
                must_hit += 1
                assert first > 0, f"{rid}: no prefix hit though {usable} were cached"
    return hits, must_hit


TEXT_ACTIONS = frozenset({"block-aligned", "realigned"})


def compare_with_stock(scenario: PropScenario, patched: Trace, stock: Trace) -> tuple[str, int]:
    """Invariant 3: out-of-scope requests get exactly stock's chunks, stock run with the
    block pinned to the cache's, or as configured where no chunk reaches the cache's block
    (the block-unit rule's oracle, ``PropScenario.block_rule_reference``).

    The plugin only changes the return value of `_mamba_block_aligned_split`,
    the scheduler is deterministic, and under the default scope it never
    corrects a text-only request (checked on every correction it records).
    Hence:
    - text-only scenario: no correction at all, and every chunk of every
      request is stock's;
    - scenario with images: every chunk of every request is stock's in every
      step before the first correction (and throughout when there is none).
      After it, text chunks may legitimately differ: a corrected image request
      consumes a different share of the step's token budget and of the KV
      blocks, and finishes at a different step, which changes what is left for
      the text requests behind it. What the plugin must not do is touch them,
      which the per-correction scope check covers.
    Returns (kind of comparison, number of chunks compared).
    """
    images = {r.request_id for r in scenario.requests if r.has_mm}
    # Text requests get only the block-unit rule: the cache's block, and a re-align.
    corrected = {rid for _, rid, a in patched.corrections if a not in TEXT_ACTIONS}
    assert corrected <= images, f"corrected out-of-scope requests: {corrected - images}"
    horizon = patched.first_correction_step
    if scenario.block_rule_reference is scenario:
        # The reference is stock as configured (no chunk reaches the cache's block): the
        # rule's stop at a cache boundary that stock crosses is a correction of stock's too.
        horizon = min((step for step, _, _ in patched.corrections), default=None)
    if horizon is None:
        assert stock.result.chunks == patched.result.chunks
        return ("identical-run", sum(len(c) for c in stock.result.chunks.values()))
    # A text request's first re-align (0.15-0.25 keep a mid-block start misaligned) also
    # ends the comparison.
    assert scenario.has_images or all(a == "realigned" for _, _, a in patched.corrections
                                      if a != "block-aligned")  # fmt: skip
    compared = 0
    for rid in patched.result.chunks:
        mine = [c for c in patched.result.chunks[rid] if c[0] < horizon]
        theirs = [c for c in stock.result.chunks.get(rid, []) if c[0] < horizon]
        assert mine == theirs, f"{rid}: differs from stock before step {horizon}"
        compared += len(mine)
    return ("identical-before-first-correction", compared)


# --------------------------------------------------------------------------
# Figures for docs/reliability.md and docs/compatibility.md, written to
# .cache/property-stats-<vLLM version>-<profile>.json


class Figures:
    """Counts per harness mode; `counts` sums the modes (the figures before issue 10)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_mode: dict[str, Counter[str]] = {}

    def add(self, mode: str, **values: int) -> None:
        with self.lock:
            self.by_mode.setdefault(mode, Counter()).update(values)

    @property
    def counts(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for counts in self.by_mode.values():
            total.update(counts)
        return total

    def dump(self, version: str, family: str) -> Path | None:
        if not self.by_mode:
            return None
        out = REPO / ".cache" / f"property-stats-{version}-{PROFILE_NAME}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "vllm": version, "family": family, "profile": PROFILE_NAME,
            "ci_examples_override": _CI_EXAMPLES, **dict(sorted(self.counts.items())),
            "by_mode": {m: dict(sorted(c.items())) for m, c in sorted(self.by_mode.items())},
        }  # fmt: skip
        out.write_text(json.dumps(data, indent=1) + "\n")
        return out


FIGURES = Figures()


# --------------------------------------------------------------------------
# One scenario, all invariants

STOCK_STALL_STEPS = 8  # stock only matters up to the first correction


def skip_reason(scenario: PropScenario, mode: Mode) -> str | None:
    """Why `scenario` is out of this mode's invariants on this release (None: it is in)."""
    from tools.sched_harness import vllm_version

    return deferred_free_hang(scenario.min_image_gap, mode, vllm_version(), with_plugin=True)


def check_scenario(scenario: PropScenario, sched_mode: Mode = SYNC) -> None:
    """Run stock and patched in `sched_mode`, and check the five invariants."""
    reason = skip_reason(scenario, sched_mode)
    assert reason is None, f"generated a layout outside {sched_mode}'s invariants: {reason}"
    bound = step_bound(scenario, sched_mode)
    with pa.stock():
        stock = pa.drive(
            scenario.block_rule_reference,
            max_steps=bound + 2,
            stall_steps=STOCK_STALL_STEPS,
            mode=sched_mode,
        )
    with pa.plugin_active() as mode:
        patched = pa.drive(scenario, max_steps=bound + 2, mode=sched_mode)
    check_completes(scenario, patched, sched_mode)  # 1
    check_aligned(scenario, patched, sched_mode)  # 2
    kind, compared = compare_with_stock(scenario, patched, stock)  # 3
    chunks = check_each_token_once(scenario, patched, sched_mode)  # 4
    hits, must_hit = check_prefix_hits(scenario, patched, sched_mode)  # 5
    FIGURES.add(
        sched_mode.name,
        scenarios=1,
        **{f"plugin_mode_{mode}": 1},
        requests=len(scenario.requests),
        image_requests=sum(r.has_mm for r in scenario.requests),
        images=sum(len(r.images) for r in scenario.requests),
        videos=sum(len(r.videos) for r in scenario.requests),
        image_and_video_requests=sum(bool(r.images and r.videos) for r in scenario.requests),
        steps_patched=patched.result.steps,
        stock_stalled=int(not stock.result.completed),
        invariant_checks=5,
        chunks_checked=chunks,
        **{f"stock_comparison_{kind}": 1},
        stock_chunks_compared=compared,
        prefix_hits=hits,
        repeats_required_to_hit=must_hit,
        corrections=len(patched.corrections),
        two_block_units=int(scenario.configured_block_size is not None),
    )
    FIGURES.add(sched_mode.name, **Counter(f"corrections_{a}" for _, _, a in patched.corrections))
