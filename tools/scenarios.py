"""Named scheduler scenarios, shared by tests/scheduler and the release matrix.

Each scenario is a harness configuration plus requests. Token counts follow
issue 2: Qwen3.5-35B-A3B (block 1056), 11,844-token images, a 8192-token step
budget and a 16,384-token encoder cache, so only one image fits at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tools.sched_harness import HarnessConfig, RequestSpec, RunResult, run_requests

IMAGE_TOKENS = 11_844


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

    def run(self) -> RunResult:
        return run_requests(
            self.requests,
            self.config,
            max_steps=self.max_steps,
            stall_steps=self.stall_steps,
            staged=self.staged,
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

ALL: tuple[Scenario, ...] = (TWO_IMAGES, SMALL_TWO_IMAGES, QUEUE, TEXT_ONLY, MIXED)
STALLING: tuple[Scenario, ...] = tuple(s for s in ALL if "stall" in s.tags)
BY_NAME: dict[str, Scenario] = {s.name: s for s in ALL}
