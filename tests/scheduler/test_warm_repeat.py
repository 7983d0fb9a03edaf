"""Issue 15, item 4 on the real scheduler: the warm gap-0 repeat under MTP K=2.

Images [1, 257) and [257, 513) back to back, block 256, an encoder cache that
holds one image (384 slots). The cold request completes with the plugin (its
speculative-stall rule ends the cold gap-0 stall) and leaves image 2 in the
encoder cache. The repeat gets a prefix hit at 256, on image 1's last token;
image 1 has been evicted and must be encoded again, and vLLM's shifted encoder
window (0.15-0.32) also reaches image 2, which the cache cannot hold beside it:
0 tokens on every step, with nothing held. The plugin cuts without the shift,
as 0.33 does.

The exact repeat hits 256 where vLLM backs the last cacheable position off a
block under MTP (0.27.1, 0.28.0, 0.32.0). Where it does not (0.25.1) it hits 512,
past both images, and a second request with the same first image and another
second one ("other") hits 256 instead. Each test skips the variant whose hit
is elsewhere.

Stock vLLM parks the cold request already, so "without the plugin" here means
stock vLLM's scheduler from the repeat on (the cold request ran with the
plugin, which leaves the same caches behind as any completed request).
"""

from __future__ import annotations

from typing import Any

import pytest

from tools import sched_harness as harness
from tools.sched_harness import HarnessConfig, Mode, RequestSpec, RunResult
from vllm_mamba_fix.facts.versions import Family, release_of

BLOCK = 256
PROMPT = RequestSpec("cold", 600, ((1, 256), (257, 256)), max_tokens=2, seed=5)
CONFIG = HarnessConfig(
    block_size=BLOCK, max_num_batched_tokens=1024, encoder_cache_tokens=384, max_model_len=4096
)


def _speculative(mode: Mode, family: Family) -> Mode:
    if not mode.speculative:
        pytest.skip(f"{mode}: no speculative decoding, no shifted encoder window")
    if not family.drafter_fallback:
        pytest.skip(
            f"family {family.name}: the cold gap-0 request parks already and no rule may end it "
            "(the runner asserts on any encoder-cache miss); test_speculative_stall.py's "
            "watchdog test names that stall"
        )
    return mode


def _shifted_window() -> bool:
    """0.33 dropped the shift from the encoder cut."""
    return (release_of(harness.vllm_version()) or (0, 0, 0)) < (0, 33, 0)


def _second_request(h: harness.Harness, second: str) -> Any:
    """The same prompt under a new request id: the same images (a warm repeat), or the same
    first image and another second one (only the first block is a prefix hit)."""
    import dataclasses

    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    features = harness._mm_features(PROMPT)
    assert features is not None
    if second == "other":
        other = f"{PROMPT.request_id}-other-image"
        changed = {"identifier": other}
        if hasattr(features[1], "mm_hash"):
            changed["mm_hash"] = other
        features[1] = dataclasses.replace(features[1], **changed)
    return harness._call_with_supported(
        Request,
        request_id="warm",
        prompt_token_ids=harness._prompt(PROMPT),
        sampling_params=SamplingParams(max_tokens=PROMPT.max_tokens, ignore_eos=True),
        pooling_params=None,
        eos_token_id=None,
        mm_features=features,
        block_hasher=h.built.block_hasher,
    )


def _cold_then(mode: Mode, second: str, between: Any = None) -> tuple[RunResult, RunResult]:
    """Run the cold request, call ``between()``, then the second; returns both results."""
    h = harness.Harness(mode.apply(CONFIG))
    h.add(PROMPT)
    cold = h.run(max_steps=80, stall_steps=10)
    if between is not None:
        between()
    request = _second_request(h, second)
    hit = h.scheduler.kv_cache_manager.get_computed_blocks(request)[1]  # (blocks, tokens, ...)
    if hit != BLOCK:
        pytest.skip(
            f"vLLM {harness.vllm_version()}: the {second} request's prefix hit is {hit}, not "
            f"image 1's last token {BLOCK}. The repeat hits there where vLLM backs the last "
            "cacheable position off a block under MTP (measured: 0.27.1, 0.28.0, 0.32.0), the "
            "other second image where it does not (measured: 0.25.1)"
        )
    h.requests["warm"] = request
    h.chunks["warm"] = []
    h.scheduler.add_request(request)
    return cold, h.run(max_steps=160, stall_steps=10)


SECOND = pytest.mark.parametrize("second", ["repeat", "other"])


@SECOND
def test_plugin_completes_the_warm_repeat(
    family: Family, sched_mode: Mode, load_plugin: Any, second: str
) -> None:
    mode = _speculative(sched_mode, family)
    load_plugin()
    cold, warm = _cold_then(mode, second)
    assert cold.completed, (cold.stall_at, cold.chunks)
    assert warm.completed, (warm.stall_at, warm.spans("warm"))
    spans = warm.spans("warm")
    assert spans[0][0] == BLOCK, spans
    if _shifted_window():
        assert spans[0] == (BLOCK, BLOCK + 1), spans  # the rest of image 1, as 0.33 cuts
    assert warm.violations() == []


@SECOND
def test_stock_parks_the_warm_repeat(
    family: Family, sched_mode: Mode, load_plugin: Any, second: str
) -> None:
    mode = _speculative(sched_mode, family)
    load_plugin()
    cold, warm = _cold_then(mode, second, between=harness.unload_plugin)
    assert cold.completed, (cold.stall_at, cold.chunks)
    assert not harness.split_is_wrapped()
    if _shifted_window():
        assert not warm.completed
        assert warm.spans("warm") == []  # never scheduled past its prefix hit
    else:
        assert warm.completed, (warm.stall_at, warm.spans("warm"))


@SECOND
def test_watchdog_names_it_where_no_rule_ends_it(
    family: Family, sched_mode: Mode, load_plugin: Any, vllm_log: list[str], second: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The plugin as 0.19-0.23 run it (speculative-stall rule off, watchdog on). The
    watchdog's clock moves 2 s per reading: it samples every step (once a second)."""
    from tests.stall_end_helpers import install_clock

    mode = _speculative(sched_mode, family)
    if not _shifted_window():
        pytest.skip("0.33+: no shifted encoder window, no stall")
    install_clock(monkeypatch, per_call=2.0)
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_mamba_fix.install import patch
    from vllm_mamba_fix.rules.stall_end import EndOptions

    def rule_off() -> None:
        harness.unload_plugin()
        harness.wrap_update(Scheduler, EndOptions(0.0))  # the watchdog alone, at 0 s

    load_plugin()
    try:
        cold, warm = _cold_then(mode, second, between=rule_off)
    finally:
        patch.undo(Scheduler)
    assert cold.completed, (cold.stall_at, cold.chunks)
    assert not warm.completed
    warnings = [m for m in vllm_log if "request warm stalled at token" in m]
    assert len(warnings) == 1, warnings
    (warning,) = warnings
    for needle in (
        "request warm stalled at token 256 of 600",
        "holds encoder inputs none",
        "waits for [1, 257) (256 encoder tokens)",
        "encoder cache 384 tokens",
        "likely cause: EAGLE-type speculative decoding",
        "remedy: upgrade to vLLM 0.33+, or put two or more tokens between images",
    ):
        assert needle in warning, (needle, warning)
