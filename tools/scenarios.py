"""Named scheduler scenarios, shared by tests/scheduler and the release matrix.

Each scenario is a harness configuration plus requests. Token counts follow
issue 2: Qwen3.5-35B-A3B (block 1056), 11,844-token images, a 8192-token step
budget and a 16,384-token encoder cache, so only one image fits at a time.

Every scenario runs in any harness mode (`scenario.run(mode)`); the block size
comes from vLLM in each mode (1056, or 1072 under MTP K=2, whose GDN conv state
holds K more tokens). Layouts with fewer than 2 text tokens between two images
are kept out of the EAGLE/MTP modes where vLLM's deferred encoder-cache free
hangs on its own (`mode_skip_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tools.sched_harness import (
    SYNC,
    HarnessConfig,
    Mode,
    RequestSpec,
    RunResult,
    run_requests,
    video_layout,
    vllm_version,
)
from vllm_mamba_fix.facts.versions import family_for

IMAGE_TOKENS = 11_844
# A Qwen3-VL video of about one image's size: 8 temporal patches of 1,480 pads (11,840
# encoder-cache slots), each after its timestamp text and inside its vision markers.
VIDEO_FRAMES = 8
VIDEO_TOKENS_PER_FRAME = 1_480


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    config: HarnessConfig
    requests: tuple[RequestSpec, ...]
    # Groups added one step apart after `requests` (a request already running).
    staged: tuple[tuple[RequestSpec, ...], ...] = ()
    max_steps: int = 300
    stall_steps: int = 25
    tags: frozenset[str] = field(default_factory=frozenset)

    def run(self, mode: Mode = SYNC) -> RunResult:
        return run_requests(
            self.requests,
            mode.apply(self.config),
            max_steps=self.max_steps,
            stall_steps=self.stall_steps,
            staged=self.staged,
        )

    @property
    def specs(self) -> tuple[RequestSpec, ...]:
        return (*self.requests, *(s for group in self.staged for s in group))

    @property
    def min_image_gap(self) -> int | None:
        """Fewest text tokens between two consecutive images of one request."""
        return min_image_gap(self.specs)

    def mode_skip_reason(
        self, mode: Mode, version: str | None = None, *, with_plugin: bool = False
    ) -> str | None:
        """Why this scenario is left out of `mode` on this release (None: it runs)."""
        return deferred_free_hang(
            self.min_image_gap, mode, version or vllm_version(), with_plugin=with_plugin
        )


def image_request(
    request_id: str,
    texts: tuple[int, ...],
    image_tokens: int = IMAGE_TOKENS,
    *,
    max_tokens: int = 1,
) -> RequestSpec:
    """A prompt of text runs `texts[0]`, image, `texts[1]`, image, ..., `texts[-1]`."""
    images: list[tuple[int, int]] = []
    pos = texts[0]
    for text in texts[1:]:
        images.append((pos, image_tokens))
        pos += image_tokens + text
    return RequestSpec(request_id, pos, tuple(images), max_tokens=max_tokens)


def text_request(request_id: str, tokens: int, *, max_tokens: int = 1) -> RequestSpec:
    return RequestSpec(request_id, tokens, (), max_tokens=max_tokens)


def video_request(
    request_id: str,
    texts: tuple[int, ...],
    frames: int = VIDEO_FRAMES,
    tokens_per_frame: int = VIDEO_TOKENS_PER_FRAME,
    *,
    is_embed: bool = True,
    max_tokens: int = 1,
) -> RequestSpec:
    """Text runs `texts[0]`, video, `texts[1]`, video, ..., `texts[-1]`, each video in
    Qwen3-VL's own layout (tools.sched_harness.video_tokens)."""
    prompt_len, videos = video_layout(texts[0], texts[1:], frames, tokens_per_frame,
                                      is_embed=is_embed)  # fmt: skip
    return RequestSpec(request_id, prompt_len, videos=videos, max_tokens=max_tokens)


def image_then_video_request(
    request_id: str, texts: tuple[int, int, int], image_tokens: int = IMAGE_TOKENS
) -> RequestSpec:
    """Text, an image, text, a video (Qwen3-VL layout), text."""
    start = texts[0] + image_tokens + texts[1]
    prompt_len, videos = video_layout(start, texts[2:], VIDEO_FRAMES, VIDEO_TOKENS_PER_FRAME)
    return RequestSpec(request_id, prompt_len, ((texts[0], image_tokens),), videos=videos)


def min_image_gap(specs: tuple[RequestSpec, ...] | list[RequestSpec]) -> int | None:
    """Fewest text tokens between two consecutive placeholders (images or videos)."""
    gaps = [
        b[0] - (a[0] + a[1])
        for spec in specs
        for a, b in zip(spec.mm_spans, spec.mm_spans[1:], strict=False)
    ]
    return min(gaps, default=None)


def _release(version: str) -> tuple[int, int]:
    major, minor = (int(x) for x in version.split(".")[:2])
    return major, minor


def deferred_free_hang_gap(version: str) -> int:
    """Image gaps below this hang stock vLLM under EAGLE-type speculation, split or no split.

    From 0.24 (#46315; read in each release's `_free_encoder_inputs`) an
    image's encoder-cache entry is freed only once the computed tokens pass
    its end plus the drafter's look-ahead; before, it is freed at its end but
    the next chunk is still cut one token early (the shift is in the code from
    0.15). With the next image that close and the two not fitting in the cache
    together, the request parks one token short of image 1's end for good,
    with prefix caching off too: 0.24-0.32 at gaps 0-1, before 0.24 at gap 0;
    0.33 dropped both. Qwen's template puts 2 tokens
    (<|vision_end|><|vision_start|>) between images.
    """
    release = _release(version)
    if release >= (0, 33):
        return 0
    return 2 if release >= (0, 24) else 1


def plugin_ends_deferred_free_hang(version: str) -> bool:
    """Whether the plugin's speculative-stall rule ends that hang on this release
    (0.24-0.32: the deferred free and the model runner's drafter fallback)."""
    family = family_for(version)
    return family.deferred_encoder_free and family.drafter_fallback


def deferred_free_hang(
    gap: int | None, mode: Mode, version: str, *, with_plugin: bool = False
) -> str | None:
    """Why a layout with this smallest image gap hangs in `mode` (None: it does not).

    ``with_plugin``: the question is whether it hangs with the plugin loaded.
    """
    if not mode.speculative or gap is None:
        return None
    limit = deferred_free_hang_gap(version)
    if gap >= limit or (with_plugin and plugin_ends_deferred_free_hang(version)):
        return None
    where = "; the plugin only names it before 0.24" if with_plugin else ""
    return (
        f"images {gap} token(s) apart under EAGLE-type speculation: vLLM {version} parks the "
        f"request one token short of the first image's end (a separate vLLM hang below a gap "
        f"of {limit}, not the split's; issue 11{where})"
    )


ISSUE_CONFIG = HarnessConfig(max_num_batched_tokens=8192, encoder_cache_tokens=16_384)

# Issue 2: one request, two 11,844-token images with text before, between, after.
TWO_IMAGES = Scenario(
    name="two-images",
    description="two 11,844-token images, budget 8192, encoder cache 16,384",
    config=ISSUE_CONFIG,
    requests=(image_request("two-images", (100, 50, 200)),),
    tags=frozenset({"stall", "image"}),
)

# A smaller stall: 1,500-token images, budget 2048, encoder cache 2048.
# Step 1 stops at block 1056 (image 2 does not fit beside image 1); step 2 may
# only run to image 2's start, 764 tokens, which stock floors to 0 while image
# 1 still holds the encoder cache: nothing ever frees it.
SMALL_TWO_IMAGES = Scenario(
    name="small-two-images",
    description="two 1,500-token images, budget 2048, encoder cache 2048",
    config=HarnessConfig(max_num_batched_tokens=2048, encoder_cache_tokens=2048),
    requests=(image_request("small", (300, 20, 100), image_tokens=1500),),
    tags=frozenset({"stall", "image"}),
)

# Issue 2's queue: an image request runs; a second two-image request waits
# (the encoder cache still holds the first one's image), a text request waits
# behind it. Stock: the waiting loop gets 0 for the image request and breaks,
# so the text request never starts.
QUEUE = Scenario(
    name="queue",
    description="image request running; two-image request and text request waiting",
    config=ISSUE_CONFIG,
    requests=(image_request("running-image", (100, 50, 200)),),
    staged=((image_request("waiting-image", (40, 10, 60)), text_request("waiting-text", 3000)),),
    tags=frozenset({"stall", "image", "queue"}),
)

# Text-only requests (long, chunked) beside nothing else: the plugin's default
# scope leaves them alone, so their chunks must equal stock's.
TEXT_ONLY = Scenario(
    name="text-only",
    description="text-only requests of 30,000 and 5,000 tokens",
    config=ISSUE_CONFIG,
    requests=(text_request("text-long", 30_000), text_request("text-short", 5_000)),
    tags=frozenset({"text"}),
)

# A text request sharing steps with an image request: its chunks must not
# change either, whatever the plugin does to the image request.
MIXED = Scenario(
    name="mixed",
    description="text request scheduled beside a two-image request",
    config=ISSUE_CONFIG,
    requests=(text_request("mixed-text", 20_000), image_request("mixed-image", (100, 50, 200))),
    tags=frozenset({"image", "text"}),
)

# Issue 10: Qwen's chat template puts <|vision_end|><|vision_start|> between
# image placeholder ranges, so consecutive images are 2 text tokens apart:
# images at [4, 11848) and [11850, 23694). Under MTP stock cuts the chunk one
# token before image 2 (11849), the EAGLE shift.
ISSUE_10 = Scenario(
    name="issue-10",
    description="two 11,844-token images 2 tokens apart (Qwen template), budget 8192",
    config=ISSUE_CONFIG,
    requests=(image_request("issue-10", (4, 2, 20)),),
    tags=frozenset({"stall", "image"}),
)

# Back-to-back images (gap 0: Gemma-3/4 and LFM2-VL ranges include their
# markers). Runs in sync and async; under MTP it meets the deferred-free hang
# on 0.19-0.32 and is skipped there (`mode_skip_reason`).
ADJACENT_IMAGES = Scenario(
    name="adjacent-images",
    description="two 11,844-token images back to back (gap 0), budget 8192",
    config=ISSUE_CONFIG,
    requests=(image_request("adjacent", (100, 0, 200)),),
    tags=frozenset({"stall", "image", "gap<2"}),
)

ALL: tuple[Scenario, ...] = (
    TWO_IMAGES, SMALL_TWO_IMAGES, QUEUE, TEXT_ONLY, MIXED, ISSUE_10, ADJACENT_IMAGES,
)  # fmt: skip
STALLING: tuple[Scenario, ...] = tuple(s for s in ALL if "stall" in s.tags)

# Issue 15: two Qwen3-VL videos (8 x 1,480 pads, ~11,960 tokens each with timestamps and
# markers) in one request, with the issue-2 budget and a cache that holds one video's
# 11,840 embeddings. Back to back (gap 0) is what old-style processors produce (they replace
# the whole <|vision_start|><|video_pad|><|vision_end|>); transformers >= 5.10 keeps the
# outer markers outside the range, which puts two videos 2 apart. `is_embed` marks the pads
# (vLLM's select_token_id), or nothing (EVS-style: every position a candidate).
TWO_VIDEOS_GAP_2 = Scenario(
    name="two-videos-gap-2",
    description="two Qwen3-VL videos 2 apart (transformers >= 5.10), is_embed on the pads",
    config=ISSUE_CONFIG,
    requests=(video_request("videos-gap-2", (100, 2, 200)),),
    tags=frozenset({"stall", "video"}),
)
TWO_VIDEOS_GAP_0 = Scenario(
    name="two-videos-gap-0",
    description="two Qwen3-VL videos back to back (old-style processors), is_embed on the pads",
    config=ISSUE_CONFIG,
    requests=(video_request("videos-gap-0", (100, 0, 200)),),
    tags=frozenset({"stall", "video", "gap<2"}),
)
TWO_VIDEOS_NO_MASK = Scenario(
    name="two-videos-no-mask",
    description="two Qwen3-VL videos 2 apart, is_embed off (every position a candidate)",
    config=ISSUE_CONFIG,
    requests=(video_request("videos-no-mask", (100, 2, 200), is_embed=False),),
    tags=frozenset({"stall", "video"}),
)
IMAGE_AND_VIDEO = Scenario(
    name="image-and-video",
    description="an 11,844-token image, then a Qwen3-VL video 2 apart, budget 8192",
    config=ISSUE_CONFIG,
    requests=(image_then_video_request("image-video", (100, 2, 200)),),
    tags=frozenset({"stall", "image", "video"}),
)
VIDEO_QUEUE = Scenario(
    name="video-queue",
    description="two-video request running; a video request and a text request waiting",
    config=ISSUE_CONFIG,
    requests=(video_request("running-videos", (100, 2, 200)),),
    staged=(
        (video_request("waiting-videos", (40, 2, 60)), text_request("video-queue-text", 3000)),
    ),
    tags=frozenset({"stall", "video", "queue"}),
)
VIDEOS: tuple[Scenario, ...] = (
    TWO_VIDEOS_GAP_2, TWO_VIDEOS_GAP_0, TWO_VIDEOS_NO_MASK, IMAGE_AND_VIDEO, VIDEO_QUEUE,
)  # fmt: skip
BY_NAME: dict[str, Scenario] = {s.name: s for s in (*ALL, *VIDEOS)}
