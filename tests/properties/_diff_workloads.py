"""Workloads of the differential suite (issue 27 item 2), as hypothesis strategies.

What the generator must reach, and where each comes from:
- budget starvation behind long prefills: `starved` puts 1-2 long text prefills ahead of
  the multimodal requests, the budget a block multiple plus a sub-block remainder;
- budgets that are not a multiple of the block: `budgets` draws k * block + r, r in 1..B-1;
- budgets and long_prefill_token_threshold between the configured and the cache's block:
  `two_sizes` draws cache_config.block_size a half or a quarter of the cache's block, set
  before or after the scheduler is built, and the cap in (configured, cache];
- encoder-cache pressure, images and videos at every gap: `_support.request_bodies`
  (gaps 0, 1, 2 named, videos with and without is_embed), caches from the largest input up;
- preemption, aborts, churn, priority scheduling: `perturbed`;
- fine-grained prefix hits with internal checkpoints (0.32+): `fine_grained` (a longer
  request with the same tokens after its original finished; prefix_match_unit below the
  block, Mamba specs with a checkpoint block); on older releases the same layout is a
  block-granular hit;
- MTP and async: every test runs in every harness mode (`_differential.modes`).

Kept out, with the reason: layouts that hang stock outside the plugin's reach on this
release in this mode (images closer than `min_image_gap_for` under MTP on 0.19-0.23 and
0.33; budgets below the block vLLM validated against on the chunk-length families, where
text hangs on stock by design), and inputs larger than the encoder cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import strategies as st

from tests.properties._differential import Workload, has_internal_checkpoints
from tests.properties._support import (
    SUB_BLOCK_CAP_HANGS_TEXT,
    encoder_cost,
    min_image_gap_for,
    request_bodies,
)
from tools.prop_adapters import PropRequest, PropScenario
from tools.sched_harness import Mode, VideoSpec, vllm_version

BLOCKS = (64, 128, 256, 512, 1056)


@st.composite
def blocks(draw: st.DrawFn) -> int:
    """The cache's block: the sizes deployments report, or any multiple of 16 up to 2096."""
    return draw(st.one_of(st.sampled_from(BLOCKS), st.integers(2, 131).map(lambda k: 16 * k)))


@st.composite
def budgets(draw: st.DrawFn, block: int, floor: int) -> int:
    """A token budget: k blocks and a sub-block remainder, or any size, at least `floor`."""
    remainder = draw(st.integers(1, max(1, block - 1)))
    budget = draw(
        st.one_of(
            st.integers(1, 4).map(lambda k: k * block + remainder),
            st.integers(128, 4096),
            st.just(block + remainder),
        )
    )
    return max(budget, floor, 128)


def _cache(draw: st.DrawFn, requests: list[PropRequest]) -> int:
    sizes = sorted(
        [n for r in requests for _, n in r.images] + [encoder_cost(v) for r in requests
                                                      for v in r.videos],
        reverse=True,
    )  # fmt: skip
    if not sizes:
        return draw(st.integers(256, 8192))
    # One input (tight: two never fit together) up to all of them.
    return draw(st.one_of(st.just(sizes[0]), st.integers(sizes[0], max(sizes[0], sum(sizes)))))


@st.composite
def mm_requests(
    draw: st.DrawFn, block: int, budget: int, gap: int, prefix: str, n_max: int = 3
) -> list[PropRequest]:
    """1..n_max requests with 0-4 images or videos at every gap, or text."""
    out = []
    for i in range(draw(st.integers(1, n_max))):
        with_mm = draw(st.booleans()) or i == 0
        prompt, images, videos = draw(
            request_bodies(block, budget, with_mm, min_image_gap=gap, videos=draw(st.booleans()))
        )
        out.append(
            PropRequest(
                f"{prefix}{i}", prompt, images, content=f"{prefix}{i}",
                arrival=draw(st.integers(0, 4)), max_tokens=draw(st.integers(1, 3)),
                videos=videos,
            )
        )  # fmt: skip
    return out


def _scenario(
    draw: st.DrawFn, block: int, budget: int, threshold: int, requests: list[PropRequest],
    configured: int | None = None, after: bool = False,
) -> PropScenario:  # fmt: skip
    return PropScenario(
        block, budget, _cache(draw, requests), threshold, tuple(requests), configured, after
    )


def _floor(block: int) -> int:
    """The smallest cap vLLM accepts on families whose split floors every sub-block chunk
    to 0 (their config check rejects a smaller one): one block; else none."""
    return block if SUB_BLOCK_CAP_HANGS_TEXT else 0


@st.composite
def clustered(draw: st.DrawFn, block: int, gap: int) -> PropRequest:
    """Two or three small images inside one block, at every gap from `gap` up: with a cache
    for one of them they never fit together, whatever the budget (the window the stall end's
    proof reads; issue 27 harm 1)."""
    pos = draw(st.integers(0, max(0, block // 4)))
    images = []
    for _ in range(draw(st.integers(2, 3))):
        size = draw(st.integers(16, max(16, block // 4)))
        images.append((pos, size))
        pos += size + draw(st.one_of(st.sampled_from([g for g in (0, 1, 2) if g >= gap] or [gap]),
                                     st.integers(gap, gap + 32)))  # fmt: skip
    prompt = pos + draw(st.integers(1, 2 * block))
    return PropRequest("clustered", prompt, tuple(images), content="clustered",
                       arrival=draw(st.integers(0, 3)))  # fmt: skip


@st.composite
def starved(draw: st.DrawFn, mode: Mode) -> Workload:
    """Long text prefills ahead of image and video requests: the budget left in a step after
    the prefill's whole blocks is below one block, step after step, long enough for the
    watchdog to name the wait and the end to act (5+ steps)."""
    block = draw(blocks())
    remainder = draw(st.integers(1, max(1, block - 1)))
    budget = max(draw(st.integers(1, 4)) * block + remainder, _floor(block), 128)
    gap = min_image_gap_for(mode, vllm_version())
    ahead = [
        PropRequest(f"long{i}", draw(st.integers(6 * budget, 14 * budget)), content=f"long{i}",
                    arrival=draw(st.integers(0, 1)))
        for i in range(draw(st.integers(1, 2)))
    ]  # fmt: skip
    behind = draw(mm_requests(block, budget, gap, "mm", n_max=2))
    threshold = draw(st.one_of(st.just(0), st.integers(max(64, _floor(block)), budget)))
    if draw(st.integers(0, 3)) == 0:
        return Workload(_scenario(draw, block, budget, threshold, ahead + behind))
    # Small images inside one block, a cache for the largest alone; the other requests keep
    # only inputs that fit it (a larger one would hang stock on its own).
    cluster = draw(clustered(block, gap))
    cache = max(n for _, n in cluster.images)
    fits = [r for r in behind if all(n <= cache for _, n in r.images)
            and all(encoder_cost(v) <= cache for v in r.videos)]  # fmt: skip
    requests = [*ahead, cluster, *fits]
    return Workload(PropScenario(block, budget, cache, threshold, tuple(requests)))


@st.composite
def two_sizes(draw: st.DrawFn, mode: Mode) -> Workload:
    """cache_config.block_size below the cache's block (vLLM #54076), set before or after
    the scheduler is built; budget and threshold often between the two."""
    block = draw(st.sampled_from([128, 256, 512, 1056, 2048])) if draw(st.booleans()) else (
        draw(st.integers(4, 131).map(lambda k: 16 * k)))  # fmt: skip
    configured = block // draw(st.sampled_from([2, 4]))
    floor = _floor(configured)  # vLLM validated against the configured block
    between = st.integers(max(configured + 1, floor, 128), max(block, floor, 128))
    budget = draw(st.one_of(between, budgets(block, floor)))
    threshold = draw(st.one_of(st.just(0), between, st.integers(max(64, floor), budget)))
    threshold = min(threshold, budget) if threshold else 0
    gap = min_image_gap_for(mode, vllm_version())
    requests = []
    if draw(st.booleans()):  # a long text prompt first, as #54076's report
        requests.append(PropRequest("text0", draw(st.integers(block + 1, 6 * block)),
                                    content="text0"))  # fmt: skip
    requests += draw(mm_requests(block, budget, gap, "r"))
    return Workload(
        _scenario(draw, block, budget, threshold, requests, configured, draw(st.booleans()))
    )


@st.composite
def perturbed(draw: st.DrawFn, mode: Mode) -> Workload:
    """Preemption (a KV pool of about one request), aborts of text requests at drawn steps,
    churn (text arriving mid-run), the priority policy, a saturated encoder budget."""
    block = draw(blocks())
    budget = draw(budgets(block, _floor(block)))
    gap = min_image_gap_for(mode, vllm_version())
    requests = draw(mm_requests(block, budget, gap, "r", n_max=4))
    requests += [
        PropRequest(f"churn{i}", draw(st.integers(16, 6000)), content=f"churn{i}",
                    arrival=draw(st.integers(0, 8)), max_tokens=draw(st.integers(1, 4)))
        for i in range(draw(st.integers(0, 3)))
    ]  # fmt: skip
    priority = draw(st.booleans())
    if priority:
        requests = [dataclasses.replace(r, priority=draw(st.integers(-1, 1))) for r in requests]
    texts = [r.request_id for r in requests if not r.has_mm]
    aborts = draw(
        st.lists(st.tuples(st.integers(1, 8), st.sampled_from(texts)), min_size=1, max_size=2)
        if texts
        else st.just([])
    )
    threshold = draw(st.one_of(st.just(0), st.integers(max(64, _floor(block)), budget)))
    return Workload(
        _scenario(draw, block, budget, threshold, requests),
        preempt=draw(st.booleans()),
        aborts=tuple(sorted(aborts)),
        priority=priority,
        saturated_encoder=draw(st.booleans()),
    )


@st.composite
def fine_grained(draw: st.DrawFn, mode: Mode) -> Workload:
    """A request, then after it finished a longer one with the same tokens (and images):
    its prefix hit lands mid-block on prefix_match_unit where 0.32+ has fine-grained hits,
    and its next chunk starts there. Internal checkpoints on or off."""
    block = draw(st.sampled_from([64, 128, 256, 512]))
    unit = block // draw(st.sampled_from([2, 4]))
    # Often one chunk for a whole prompt: the longer request's tail after its hit is one
    # chunk that crosses a boundary, checkpointed inside (harm 4's shape).
    budget = draw(st.one_of(budgets(block, _floor(block)), st.just(8 * block + unit // 2)))
    gap = min_image_gap_for(mode, vllm_version())
    first = draw(mm_requests(block, budget, gap, "r", n_max=2))
    if draw(st.integers(0, 3)) > 0:  # a text original whose last unit ends mid-block
        first[0] = PropRequest("r0", draw(st.integers(2 * block, 6 * block)), content="r0")
    original = first[0]
    longer = dataclasses.replace(
        original, request_id="longer", prompt_len=original.prompt_len + draw(
            st.integers(block + 1, 3 * block)), after=original.request_id, arrival=0,
    )  # fmt: skip
    requests = [*first, longer]
    if draw(st.booleans()):  # the same prompt again too: an exact repeat
        requests.append(dataclasses.replace(original, request_id="again", after="longer"))
    threshold = draw(st.one_of(st.just(0), st.integers(max(64, _floor(block)), budget)))
    fine = has_internal_checkpoints()  # with prefix_match_unit (0.32+)
    alignment = draw(st.sampled_from([unit, unit, unit, 64 if unit % 64 == 0 else unit]))
    checkpoints = fine and draw(st.integers(0, 3)) > 0
    return Workload(
        _scenario(draw, block, budget, threshold, requests),
        prefix_match_unit=unit if fine else None,
        checkpoint_alignment=alignment if checkpoints else None,
    )


def _input(draw: st.DrawFn, offset: int, size: int, video: bool) -> tuple[int, Any]:
    """An image of `size` tokens at `offset`, or a Qwen3-VL video about that large;
    returns (its length, ("image", (offset, size)) or ("video", VideoSpec))."""
    if not video:
        return size, ("image", (offset, size))
    frames = draw(st.integers(1, 3))
    spec = VideoSpec(offset, frames, max(4, size // frames), is_embed=draw(st.booleans()))
    return spec.length, ("video", spec)


def _request(rid: str, content: str, text: list[int], inputs: list[tuple[int, bool]],
             draw: st.DrawFn, **kw: Any) -> PropRequest:  # fmt: skip
    """text[0], input 0, text[1], input 1, ..., text[-1]."""
    pos, images, videos = text[0], [], []
    for (size, video), run in zip(inputs, text[1:], strict=True):
        length, (kind, item) = _input(draw, pos, size, video)
        (videos if kind == "video" else images).append(item)
        pos += length + run
    return PropRequest(rid, max(pos, 1), tuple(images), content=content, videos=tuple(videos),
                       **kw)  # fmt: skip


def _with_repeats(draw: st.DrawFn, requests: list[PropRequest]) -> list[PropRequest]:
    """Some requests again: a concurrent copy (the same inputs held twice) or a repeat once
    the original finished (prefix hits, issue 36 item 4)."""
    out = list(requests)
    for r in requests[: draw(st.integers(0, min(3, len(requests))))]:
        after = draw(st.booleans())
        out.append(dataclasses.replace(
            r, request_id=f"{r.request_id}-again", after=r.request_id if after else None,
            arrival=0 if after else r.arrival + draw(st.integers(0, 2)),
        ))  # fmt: skip
    return out


@st.composite
def crowd(draw: st.DrawFn, mode: Mode) -> Workload:
    """2 to 48 image and video requests sent together (within a few steps), sharing an encoder
    cache sized for 1 to 3 of their inputs; thresholds below the budget; often a KV pool that
    preempts (a request resumed while another holds an input). Issue 35's mutual hold is one
    point: block 64, budget 256, threshold 128, cache 1000, `text 10, image 400, text 2,
    image 400, text 20` twice."""
    gap = min_image_gap_for(mode, vllm_version())
    block = draw(st.sampled_from([16, 32, 64, 128, 256]))
    budget = max(draw(st.integers(2, 8)) * block + draw(st.sampled_from([0, block // 2, 1])),
                 _floor(block), 128)  # fmt: skip
    threshold = draw(st.one_of(st.just(0), st.integers(max(64, _floor(block)), budget)))
    n = draw(st.one_of(st.integers(2, 4), st.integers(5, 12), st.integers(13, 48)))
    size = draw(st.integers(32, 480))  # inputs of about one size, so the cache holds 1-3
    video = draw(st.booleans())
    requests = []
    for i in range(n):
        k = draw(st.integers(1, 3))
        inputs = [(draw(st.integers(max(16, size * 3 // 4), size)), video and draw(st.booleans()))
                  for _ in range(k)]  # fmt: skip
        runs = [draw(st.integers(0, 64))] + [
            draw(st.one_of(st.sampled_from([g for g in (0, 1, 2) if g >= gap] or [gap]),
                           st.integers(gap, gap + 2 * block))) for _ in range(k - 1)
        ] + [draw(st.integers(1, 64))]  # fmt: skip
        requests.append(_request(f"m{i}", f"m{i}", runs, inputs, draw,
                                 arrival=draw(st.sampled_from([0, 0, 0, 1, 2])),
                                 max_tokens=draw(st.integers(1, 3))))  # fmt: skip
    requests = _with_repeats(draw, requests)
    largest = max(n for r in requests for n in _costs(r))
    items = draw(st.integers(1, 3))
    cache = items * largest + draw(st.integers(0, largest - 1))
    s = PropScenario(block, budget, cache, threshold, tuple(requests))
    return Workload(s, preempt=draw(st.booleans()), saturated_encoder=draw(st.integers(0, 3)) == 0)


@st.composite
def boundary(draw: st.DrawFn, mode: Mode) -> Workload:
    """Inputs starting on a block boundary, one token before and one after it (the encoder
    cut under MTP sits one token before an input: B-1 tokens that floor to 0), an encoder
    cache for 1 to 3 inputs, 1 to 3 requests, a threshold often below the budget."""
    gap = min_image_gap_for(mode, vllm_version())
    block = draw(st.sampled_from([16, 32, 64, 128, 256, 512]))
    budget = max(draw(st.integers(1, 6)) * block + draw(st.sampled_from([0, 1, block // 2])),
                 _floor(block), 128)  # fmt: skip
    threshold = draw(st.one_of(st.just(0), st.integers(max(64, _floor(block)), budget)))
    requests = []
    for i in range(draw(st.integers(1, 3))):
        pos, images, videos = 0, [], []
        for j in range(draw(st.integers(1, 3))):
            start = (pos // block + draw(st.integers(1 if j else 0, 2))) * block + draw(
                st.sampled_from([-1, 0, 1]))  # fmt: skip
            start = max(start, pos + gap, 1)
            length, (kind, item) = _input(draw, start, draw(st.integers(16, 2 * block + 16)),
                                          draw(st.integers(0, 3)) == 0)  # fmt: skip
            (videos if kind == "video" else images).append(item)
            pos = start + length
        requests.append(PropRequest(
            f"b{i}", pos + draw(st.integers(1, 2 * block)), tuple(images), content=f"b{i}",
            videos=tuple(videos), arrival=draw(st.integers(0, 2)),
            max_tokens=draw(st.integers(1, 3)),
        ))  # fmt: skip
    requests = _with_repeats(draw, requests)
    costs = sorted((n for r in requests for n in _costs(r)), reverse=True)
    items = draw(st.integers(1, 3))
    cache = max(costs[0], sum(costs[:items]))
    return Workload(PropScenario(block, budget, cache, threshold, tuple(requests)))


def _costs(r: PropRequest) -> list[int]:
    return [n for _, n in r.images] + [encoder_cost(v) for v in r.videos]


@st.composite
def tight(draw: st.DrawFn, mode: Mode) -> Workload:
    """Issue 44 item 4: small blocks (16-64) against images and budgets of about their size
    (27-70 tokens, often k blocks and one token, so that one token is left over), an encoder
    cache for one or two images, 2-6 requests at once, a KV pool that preempts, and repeats
    once their original finished (the prefix hits after a correction). Where a whole block
    and an encoder stop are both answers, and a chunk cut at an image may end mid-block."""
    gap = min_image_gap_for(mode, vllm_version())
    block = draw(st.sampled_from([16, 16, 32, 48, 64]))
    budget = draw(st.one_of(
        st.integers(27, 70),
        st.sampled_from([k * block + 1 for k in (1, 2, 3, 4) if 27 <= k * block + 1 <= 70]
                        or [block + 1]),
    ))  # fmt: skip
    budget = max(budget, _floor(block))
    size = draw(st.integers(12, 48))  # images of about one size, so the cache holds 1 or 2
    requests = []
    for i in range(draw(st.integers(2, 6))):
        k = draw(st.integers(1, 3))
        inputs = [(draw(st.integers(max(8, size * 2 // 3), size)), False) for _ in range(k)]
        runs = [draw(st.integers(0, 40))] + [
            draw(st.one_of(st.sampled_from([g for g in (0, 1, 2) if g >= gap] or [gap]),
                           st.integers(gap, gap + 2 * block))) for _ in range(k - 1)
        ] + [draw(st.integers(1, 40))]  # fmt: skip
        requests.append(_request(f"t{i}", f"t{i}", runs, inputs, draw,
                                 arrival=draw(st.sampled_from([0, 0, 1, 2, 3])),
                                 max_tokens=draw(st.integers(1, 3))))  # fmt: skip
    requests = _with_repeats(draw, requests)
    largest = max(n for r in requests for n in _costs(r))
    cache = draw(st.integers(1, 2)) * largest + draw(st.integers(0, max(0, largest // 2)))
    s = PropScenario(block, budget, cache, 0, tuple(requests))
    preempt = draw(st.integers(0, 2)) == 0
    return Workload(s, preempt=preempt, small_pool=preempt,
                    saturated_encoder=draw(st.integers(0, 3)) == 0)  # fmt: skip
