"""Thin adapters over tools/sched_harness.py for the property suite (tests/properties).

- Requests whose image hashes do not depend on the request id, so a repeated
  request (same tokens, same images) can hit the prefix cache.
- A scenario driver that submits requests at given steps (or when the request
  they repeat has finished) and records which requests the plugin corrected,
  in any harness mode (sync/async, with or without MTP: `drive(..., mode=)`).
- The plugin loaded the engine's way, forced where a release leaves it off.
- A runner for the suite on other releases through the release overlay:

      python -m tools.prop_adapters 0.19.1 0.25.1     # ci profile
      HYPOTHESIS_PROFILE=long python -m tools.prop_adapters 0.19.1 0.25.1 0.27.1
      # the differential suite only, 50 workloads per test and mode, shrunk when one fails
      VLLM_MAMBA_FIX_DIFFERENTIAL_EXAMPLES=50 VLLM_MAMBA_FIX_DIFFERENTIAL_SHRINK=1 \
          python -m tools.prop_adapters 0.28.0 -ktest_differential
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools import sched_harness as harness
from tools.sched_harness import (
    SYNC,
    HarnessConfig,
    Mode,
    MultimodalPlaceholders,
    RequestSpec,
    VideoSpec,
)

REPO = Path(__file__).resolve().parent.parent
PLUGIN_ENV = ("VLLM_MAMBA_FIX", "VLLM_MAMBA_FIX_SCOPE", "VLLM_PLUGINS")


@dataclass(frozen=True)
class PropRequest(MultimodalPlaceholders):
    """One request of a generated scenario.

    ``content`` names the prompt: two requests with the same content have the
    same token ids and the same image and video hashes (a repeat). ``videos``:
    Qwen3-VL video placeholders beside the images. ``arrival`` is the
    step at which it is submitted; ``after`` (a request id) submits it at the
    first step after that request finished instead.
    """

    request_id: str
    prompt_len: int
    images: tuple[tuple[int, int], ...] = ()
    content: str = ""
    arrival: int = 0
    after: str | None = None
    max_tokens: int = 1
    videos: tuple[VideoSpec, ...] = ()
    # Request.priority (lower runs first) under scheduling_policy="priority".
    priority: int = 0

    @property
    def key(self) -> str:
        return self.content or self.request_id


@dataclass(frozen=True)
class PropScenario:
    block_size: int
    budget: int
    encoder_cache: int
    threshold: int
    requests: tuple[PropRequest, ...]
    # cache_config.block_size below the cache's block (vLLM #54076); None: pinned to it.
    configured_block_size: int | None = None
    configured_after_build: bool = False

    def config(self, mode: Mode = SYNC) -> HarnessConfig:
        return mode.apply(
            HarnessConfig(
                block_size=self.block_size,
                max_num_batched_tokens=self.budget,
                encoder_cache_tokens=self.encoder_cache,
                long_prefill_token_threshold=self.threshold,
                max_model_len=max(
                    8192, max(r.prompt_len + r.max_tokens for r in self.requests) + 16
                ),
                configured_block_size=self.configured_block_size,
                configured_after_build=self.configured_after_build,
            )
        )

    @property
    def pinned(self) -> PropScenario:
        """The same scenario with cache_config.block_size pinned to the cache's block."""
        return dataclasses.replace(self, configured_block_size=None, configured_after_build=False)

    @property
    def block_rule_reference(self) -> PropScenario:
        """What the block-unit rule promises: stock with the block pinned to the cache's;
        where the cache's block exceeds the longest chunk (budget, threshold) and the
        configured one does not, stock as configured (its chunks cross no cache boundary
        wherever the configured block divides the cache's)."""
        longest = min(x for x in (self.budget, self.threshold) if x > 0)
        configured = self.configured_block_size
        if configured is not None and configured <= longest < self.block_size:
            return self
        return self.pinned

    @property
    def has_images(self) -> bool:
        """Whether any request has an image or a video."""
        return any(r.has_mm for r in self.requests)

    @property
    def has_videos(self) -> bool:
        return any(r.videos for r in self.requests)

    @property
    def min_image_gap(self) -> int | None:
        """Fewest text tokens between two consecutive placeholders (images or videos)."""
        gaps = [
            b[0] - (a[0] + a[1])
            for r in self.requests
            for a, b in zip(r.mm_spans, r.mm_spans[1:], strict=False)
        ]
        return min(gaps, default=None)


# --------------------------------------------------------------------------
# Plain JSON forms, field by field (the reference-release process of the differential
# suite, tests/properties/_reference.py, receives scenarios this way)


def request_to_json(req: PropRequest) -> dict[str, Any]:
    return {
        "request_id": req.request_id, "prompt_len": req.prompt_len,
        "images": [list(i) for i in req.images], "content": req.content,
        "arrival": req.arrival, "after": req.after, "max_tokens": req.max_tokens,
        "videos": [
            [v.offset, v.frames, v.tokens_per_frame, v.fps, v.is_embed] for v in req.videos
        ],
        "priority": req.priority,
    }  # fmt: skip


def request_from_json(d: dict[str, Any]) -> PropRequest:
    return PropRequest(
        request_id=str(d["request_id"]), prompt_len=int(d["prompt_len"]),
        images=tuple((int(s), int(n)) for s, n in d["images"]), content=str(d["content"]),
        arrival=int(d["arrival"]), after=d["after"], max_tokens=int(d["max_tokens"]),
        videos=tuple(VideoSpec(int(o), int(f), int(t), float(fps), bool(e))
                     for o, f, t, fps, e in d["videos"]),
        priority=int(d["priority"]),
    )  # fmt: skip


def scenario_to_json(s: PropScenario) -> dict[str, Any]:
    return {
        "block_size": s.block_size, "budget": s.budget, "encoder_cache": s.encoder_cache,
        "threshold": s.threshold, "requests": [request_to_json(r) for r in s.requests],
        "configured_block_size": s.configured_block_size,
        "configured_after_build": s.configured_after_build,
    }  # fmt: skip


def scenario_from_json(d: dict[str, Any]) -> PropScenario:
    return PropScenario(
        block_size=int(d["block_size"]), budget=int(d["budget"]),
        encoder_cache=int(d["encoder_cache"]), threshold=int(d["threshold"]),
        requests=tuple(request_from_json(r) for r in d["requests"]),
        configured_block_size=d["configured_block_size"],
        configured_after_build=bool(d["configured_after_build"]),
    )  # fmt: skip


def make_request(built: Any, req: PropRequest) -> Any:
    """A vLLM Request whose tokens and image hashes depend on ``req.key``, not its id."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    seed = sum(ord(c) * 31**i for i, c in enumerate(req.key)) % 1_000_003
    spec = RequestSpec(req.key, req.prompt_len, req.images, req.max_tokens, seed, req.videos)
    return harness._call_with_supported(
        Request,
        request_id=req.request_id,
        prompt_token_ids=harness._prompt(spec),
        sampling_params=SamplingParams(max_tokens=req.max_tokens, ignore_eos=True),
        pooling_params=None,
        eos_token_id=None,
        mm_features=harness._mm_features(spec),  # identifiers "<key>-image<j>", "<key>-video<j>"
        block_hasher=built.block_hasher,
        priority=req.priority,
    )


def add(h: harness.Harness, req: PropRequest) -> None:
    request = make_request(h.built, req)
    h.requests[req.request_id] = request
    h.chunks[req.request_id] = []
    h.scheduler.add_request(request)


@dataclass
class Trace:
    result: harness.RunResult
    # request id -> step at which it was submitted
    submitted: dict[str, int]
    # request id -> whether the request it repeats had finished when it was submitted
    repeat_of_finished: dict[str, bool]
    # (step, request id, action) for every correction the plugin made
    corrections: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def first_correction_step(self) -> int | None:
        """The first step where a chunk differs from vLLM's with the cache's block pinned
        (the block-unit rule's own chunks are exactly those)."""
        return min((s for s, _, a in self.corrections if a != BLOCK_ALIGNED), default=None)


BLOCK_ALIGNED = "block-aligned"  # decision.Action.BLOCK_ALIGNED.value


def drive(
    scenario: PropScenario, *, max_steps: int, stall_steps: int = 30, mode: Mode = SYNC
) -> Trace:
    """Submit the requests at their steps and step until all finished or stalled."""
    from vllm_mamba_fix.observe import counters

    h = harness.Harness(scenario.config(mode))
    corrections: list[tuple[int, str, str]] = []
    original_record = counters.record

    def record(action: Any, request_id: str, *args: Any) -> None:
        corrections.append((h.step_index, request_id, action.value))
        original_record(action, request_id, *args)

    submitted: dict[str, int] = {}
    repeat_of_finished: dict[str, bool] = {}
    pending = list(scenario.requests)
    idle, stalled = 0, False
    counters.record = record  # type: ignore[assignment]
    try:
        while h.step_index < max_steps:
            for req in list(pending):
                ready = (
                    req.after in h.finished
                    if req.after is not None
                    else h.step_index >= req.arrival
                )
                if ready:
                    originals = [
                        r.request_id
                        for r in scenario.requests
                        if r.key == req.key and r.request_id in submitted
                    ]
                    if originals:
                        repeat_of_finished[req.request_id] = any(o in h.finished for o in originals)
                    add(h, req)
                    submitted[req.request_id] = h.step_index
                    pending.remove(req)
            if not pending and len(h.finished) == len(h.requests):
                break
            idle = 0 if h.advance() else idle + 1
            if idle >= stall_steps and not pending:
                stalled = True
                break
    finally:
        counters.record = original_record  # type: ignore[assignment]
    result = h.result(stalled)
    for req in pending:  # never submitted: counts as unfinished
        result.stall_at[req.request_id] = -1
    return Trace(result, submitted, repeat_of_finished, corrections)


# --------------------------------------------------------------------------
# Plugin state


@contextlib.contextmanager
def clean_env() -> Iterator[None]:
    saved = {name: os.environ.pop(name, None) for name in PLUGIN_ENV}
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


@contextlib.contextmanager
def plugin_active() -> Iterator[str]:
    """The plugin loaded through vLLM's load_general_plugins(); forced if off by default.

    Yields "default" or "force".
    """
    with clean_env():
        harness.unload_plugin()
        harness.load_plugins()
        mode = "default"
        if not harness.split_rule_installed():
            os.environ["VLLM_MAMBA_FIX"] = "force"
            harness.unload_plugin()
            harness.load_plugins()
            mode = "force"
        assert harness.split_rule_installed(), "the plugin did not patch the scheduler"
        try:
            yield mode
        finally:
            harness.unload_plugin()


@contextlib.contextmanager
def stock() -> Iterator[None]:
    with clean_env():
        harness.unload_plugin()
        assert not harness.split_is_wrapped()
        yield


@contextlib.contextmanager
def wrapped_without_realign() -> Iterator[None]:
    """The plugin's wrapper with only the re-align rule switched off."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_mamba_fix.decide.scope import ScopePolicy
    from vllm_mamba_fix.facts.config import Scope
    from vllm_mamba_fix.facts.versions import family_for
    from vllm_mamba_fix.install import patch
    from vllm_mamba_fix.rules import split_rule

    family = family_for(harness.vllm_version())
    assert family.prefill_gate is not None
    with stock():
        options = split_rule.WrapOptions(
            family.prefill_gate, ScopePolicy(Scope.MULTIMODAL), realign=False
        )
        harness.wrap_split(Scheduler, options)
        try:
            yield
        finally:
            patch.undo(Scheduler)


def replace(scenario: PropScenario, **changes: Any) -> PropScenario:
    return dataclasses.replace(scenario, **changes)


# --------------------------------------------------------------------------
# Runner on other releases


def run_release(release: str, pytest_args: list[str]) -> tuple[int, float]:
    from tools import releases

    env = dict(os.environ)
    env["PYTHONPATH"] = releases.pythonpath_for(release, base=str(REPO))
    for name in PLUGIN_ENV:
        env.pop(name, None)
    start = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "tests/properties", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run([*cmd, *pytest_args], cwd=REPO, env=env)
    return proc.returncode, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    releases_ = [a for a in args if not a.startswith("-")] or ["0.19.1", "0.25.1", "0.27.1"]
    extra = [a for a in args if a.startswith("-")]
    status = 0
    for release in releases_:
        code, seconds = run_release(release, extra)
        print(f"{release}: pytest exit {code} in {seconds:.0f} s", flush=True)
        status = status or code
    return status


if __name__ == "__main__":
    raise SystemExit(main())
