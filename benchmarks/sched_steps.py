"""Sections 2 and 3: scheduling steps of the two-image request, and prefix reuse, per mode.

Arms (``benchmarks.worker`` runs them; the 0.27.1 ones share one process):

- ``plugin``: vLLM 0.27.1 with the plugin loaded the engine's way;
- ``upstream``: stock vLLM 0.28.0 (upstream's own fix) through the release overlay;
- ``nocache``: vLLM 0.27.1 with prefix caching off (the common workaround);
- ``stock``: vLLM 0.27.1 as shipped (context: where it stalls).

Modes (issue 10), each arm in each: ``sync``, ``async`` (the real ``AsyncScheduler``, driven
the engine's way), ``sync+mtp2`` and ``async+mtp2`` (a real ``SpeculativeConfig(method="mtp",
num_speculative_tokens=2)``; the block size under MTP comes from vLLM: 1072, not 1056).

Every sweep layout has at least 2 text tokens between its images (Qwen's template puts
``<|vision_end|><|vision_start|>`` there). Images 0-1 tokens apart under MTP meet a separate
vLLM hang (the deferred encoder-cache free, issue 11), measured on their own
(``stall_layouts``), not in the sweep.

Every arm runs the real ``Scheduler`` through ``tools.sched_harness``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tools.sched_harness import Mode

ARMS: dict[str, dict[str, str]] = {
    # arm -> release it runs on, and what it is
    "plugin": {"release": "0.27.1", "what": "plugin on 0.27.1"},
    "upstream": {"release": "0.28.0", "what": "stock 0.28.0 (upstream fix)"},
    "nocache": {"release": "0.27.1", "what": "0.27.1, prefix caching off"},
    "stock": {"release": "0.27.1", "what": "stock 0.27.1"},
}
ISSUE_IMAGE_TOKENS = 11_844
# Fewest text tokens between two images in the sweep: Qwen's template gap.
MIN_SWEEP_GAP = 2


def __getattr__(name: str) -> Any:
    """``MODES`` and ``MODE_NAMES``: the harness's modes (``tools.sched_harness.MODES``).

    Imported on first use, as everything of the harness here: importing it exports its shim
    directory through PYTHONPATH, which would reach the start-up benchmark's workers.
    """
    if name == "MODES":
        from tools.sched_harness import MODES

        return MODES
    if name == "MODE_NAMES":
        from tools.sched_harness import MODES

        return tuple(mode.name for mode in MODES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Layout:
    """A prompt: text ``before``, image, text ``between``, image, text ``after``."""

    before: int
    between: int
    after: int
    image_tokens: int = ISSUE_IMAGE_TOKENS
    name: str = ""
    # A text request of this many tokens queued ahead of the image request (shares the budget).
    text_ahead: int = 0

    @property
    def label(self) -> str:
        shape = f"{self.before}/{self.image_tokens}/{self.between}/{self.image_tokens}/{self.after}"
        if self.text_ahead:
            shape += f" behind {self.text_ahead}-token text"
        return f"{self.name} ({shape})" if self.name else shape


# vLLM issue #40707: block 1056, two 11,844-token images, budget 8192, encoder cache 16,384
# (tools/scenarios.py TWO_IMAGES).
ISSUE_LAYOUT = Layout(100, 50, 200, name="issue-40707")
# Issue 10: the Qwen chat template's 2 tokens between images (tools/scenarios.py ISSUE_10).
QWEN_TEMPLATE_LAYOUT = Layout(4, 2, 20, name="qwen-template")


def sweep(profile: str) -> list[Layout]:
    if profile == "smoke":
        layouts = [ISSUE_LAYOUT, QWEN_TEMPLATE_LAYOUT, Layout(16, 1056, 1),
                   Layout(5000, 8, 3000, 8_500),
                   Layout(100, 50, 200, text_ahead=3_000)]  # fmt: skip
    else:
        layouts = [ISSUE_LAYOUT, QWEN_TEMPLATE_LAYOUT]
        # 8,500 to 16,000-token images: only one fits the 16,384-token encoder cache at a time
        # (the deadlock's precondition); 3,000: both fit (control).
        for image in (3_000, 8_500, ISSUE_IMAGE_TOKENS, 16_000):
            for before in (16, 1_000, 5_000):
                for between in (8, 1_056, 4_000):
                    for after in (1, 200, 3_000):
                        layouts.append(Layout(before, between, after, image))
        # Behind a text request that takes part of each step's budget.
        for ahead in (3_000, 30_000):
            for before, between, after, image in (
                (100, 50, 200, ISSUE_IMAGE_TOKENS),
                (16, 1_056, 1, 8_500),
                (1_000, 4_000, 200, 3_000),
            ):
                layouts.append(Layout(before, between, after, image, text_ahead=ahead))
    assert all(x.between >= MIN_SWEEP_GAP for x in layouts)
    return layouts


def stall_layouts(profile: str) -> list[Layout]:
    """Images 0-1 tokens apart: under MTP, vLLM's deferred encoder-cache free parks the request
    one token short of image 1's end on 0.25-0.32 (issue 11; the plugin's speculative-stall
    rule ends it). Run in the MTP modes only."""
    layouts = [Layout(100, 0, 200, name="gap-0"), Layout(100, 1, 200, name="gap-1")]
    if profile == "full":
        layouts += [Layout(16, 0, 1, 8_500, name="gap-0"), Layout(1_000, 1, 3_000, 16_000,
                                                                   name="gap-1")]  # fmt: skip
    return layouts


def prefix_layouts(profile: str) -> list[Layout]:
    if profile == "smoke":
        return [ISSUE_LAYOUT]
    return [ISSUE_LAYOUT, QWEN_TEMPLATE_LAYOUT, Layout(16, 1056, 1), Layout(1000, 4000, 200, 8_500),
            Layout(5000, 8, 3000, 16_000)]  # fmt: skip


# --------------------------------------------------------------------------- worker side


@contextlib.contextmanager
def _prefix_caching_off() -> Iterator[None]:
    """Adapter: build the harness scheduler with prefix caching off (mamba_cache_mode none).

    ``tools.sched_harness.build_scheduler`` insists on align mode; the engine config is
    switched to the workaround's settings just before the KV cache specs and the
    ``Scheduler`` are built from it. (Owner request: a ``HarnessConfig`` field for this.)
    """
    from tools import sched_harness

    original = sched_harness._kv_cache_specs

    def specs(vllm_config: Any, model_cls: type) -> dict[str, Any]:
        cache_config = vllm_config.cache_config
        cache_config.enable_prefix_caching = False
        cache_config.mamba_cache_mode = "none"
        cache_config.mamba_block_size = vllm_config.model_config.max_model_len
        return original(vllm_config, model_cls)

    sched_harness._kv_cache_specs = specs
    try:
        yield
    finally:
        sched_harness._kv_cache_specs = original


@contextlib.contextmanager
def _content_keyed_images(key: str) -> Iterator[None]:
    """Adapter: image hashes from ``key`` instead of the request id, so two requests with the
    same seed are the same content (the harness derives hashes from the request id)."""
    from tools import sched_harness

    original = sched_harness._mm_features

    def features(spec: Any) -> Any:
        return original(dataclasses.replace(spec, request_id=key))

    sched_harness._mm_features = features
    try:
        yield
    finally:
        sched_harness._mm_features = original


def _spec(layout: Layout, request_id: str, seed: int) -> Any:
    from tools.scenarios import image_request

    spec = image_request(
        request_id, (layout.before, layout.between, layout.after), layout.image_tokens
    )
    return dataclasses.replace(spec, seed=seed)


def _harness(arm: str, mode: Mode) -> Any:
    from tools.scenarios import ISSUE_CONFIG
    from tools.sched_harness import Harness

    cfg = mode.apply(ISSUE_CONFIG)
    if arm == "nocache":
        with _prefix_caching_off():
            return Harness(cfg)
    return Harness(cfg)


def _prefill_steps(result: Any, request_id: str, first_step: int) -> int | None:
    """Steps from ``first_step`` until the request's last prefill chunk, or None (stalled)."""
    prompt = result.prompt_len[request_id]
    for step, _start, end in result.chunks.get(request_id, []):
        if end >= prompt:
            return step - first_step + 1
    return None


def _spans(result: Any, request_id: str) -> list[list[int]]:
    prompt = result.prompt_len[request_id]
    return [[s, min(e, prompt)] for _, s, e in result.chunks.get(request_id, []) if s < prompt]


def measure_steps(arm: str, layout: Layout, mode: Mode) -> dict[str, Any]:
    from tools.scenarios import text_request

    harness = _harness(arm, mode)
    if layout.text_ahead:
        harness.add(dataclasses.replace(text_request("ahead", layout.text_ahead), seed=99))
    harness.add(_spec(layout, "img", seed=1))
    result = harness.run(max_steps=200, stall_steps=25)
    return {
        "layout": layout.label,
        "steps": _prefill_steps(result, "img", 0),
        "chunks": _spans(result, "img"),
        "violations": len(result.violations()),
        "completed": result.completed,
        "stall_at": result.stall_at.get("img"),
        "block_size": result.block_size,
    }


def measure_prefix(arm: str, layout: Layout, mode: Mode) -> dict[str, Any]:
    """The same two-image request twice, one after the other; cached tokens of the second."""
    harness = _harness(arm, mode)
    with _content_keyed_images("same-content"):
        harness.add(_spec(layout, "first", seed=7))
        first = harness.run(max_steps=200, stall_steps=25)
        out: dict[str, Any] = {"layout": layout.label, "prompt_tokens": first.prompt_len["first"]}
        if not first.completed:
            out.update(first_completed=False, cached=None, second_steps=None)
            return out
        begin = harness.step_index
        harness.add(_spec(layout, "second", seed=7))
        second = harness.run(max_steps=400, stall_steps=25)
    request = harness.requests["second"]
    chunks = _spans(second, "second")
    out.update(
        first_completed=True,
        # Prefix-cache hit: where the second request's first chunk starts.
        cached=chunks[0][0] if chunks else None,
        num_cached_tokens=int(getattr(request, "num_cached_tokens", -1)),
        second_steps=_prefill_steps(second, "second", begin),
        second_chunks=chunks,
    )
    return out


def run_mode(arm: str, mode: Mode, profile: str) -> dict[str, Any]:
    """Every layout in ``mode``, or why this release cannot build the mode."""
    from tools import sched_harness

    unsupported = getattr(sched_harness, "ModeUnsupported", ())
    try:
        block_size = _harness(arm, mode).block_size
    except unsupported as exc:
        return {"unsupported": str(exc)}
    return {
        "block_size": block_size,
        "steps": [measure_steps(arm, layout, mode) for layout in sweep(profile)],
        "stall": (
            [measure_steps(arm, layout, mode) for layout in stall_layouts(profile)]
            if mode.speculative
            else []
        ),
        "prefix": [measure_prefix(arm, layout, mode) for layout in prefix_layouts(profile)],
    }


def _wrapped(name: str) -> bool:
    from vllm.v1.core.sched.scheduler import Scheduler

    return getattr(Scheduler.__dict__.get(name), "__wrapped__", None) is not None


def run_arm_here(arm: str, profile: str) -> dict[str, Any]:
    """Run one arm, every mode, in this process (its release must be the imported vLLM)."""
    from tools import sched_harness

    expected = ARMS[arm]["release"]
    version = sched_harness.vllm_version()
    if version != expected:
        raise SystemExit(f"arm {arm} expected vLLM {expected}, imported {version}")
    sched_harness.unload_plugin()
    methods = ("_mamba_block_aligned_split", "_try_schedule_encoder_inputs")
    if arm == "plugin":
        os.environ.pop("VLLM_MAMBA_FIX", None)
        sched_harness.load_plugins()
        if not all(_wrapped(m) for m in methods):
            raise SystemExit(f"the plugin did not patch both {methods}")
    elif any(_wrapped(m) for m in methods):
        raise SystemExit(f"arm {arm} must run stock vLLM, but the scheduler is wrapped")
    return {
        "arm": arm,
        "vllm": version,
        "modes": {mode.name: run_mode(arm, mode, profile) for mode in sched_harness.MODES},
    }


__all__ = [
    "ARMS", "ISSUE_LAYOUT", "Layout", "prefix_layouts", "run_arm_here",
    "stall_layouts", "sweep",
]  # fmt: skip
