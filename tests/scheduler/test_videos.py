"""Videos on the real scheduler (issue 15): Qwen3-VL's own placeholder layout, stock against
the plugin, in every harness mode.

The harness lays each video out with vLLM's `Qwen3VLMultiModalProcessor.get_video_repl`
(tools.sched_harness.video_tokens): per temporal patch, timestamp text, `<|vision_start|>`,
pads, `<|vision_end|>`; one placeholder range per video, `is_embed` on the pads or off.
Scenarios: tools.scenarios.VIDEOS (two videos 0 and 2 apart, an image and a video, a queue).
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tools import scenarios as sc
from tools import sched_harness as harness
from tools.release_facts import facts_for
from tools.sched_harness import Mode
from vllm_mamba_fix.facts.versions import Family, Verdict

VIDEOS = pytest.mark.parametrize("scenario", sc.VIDEOS, ids=lambda s: s.name)
TIMESTAMP = re.compile(rb"<\d+\.\d seconds>")


def _skip_if_out_of(scenario: sc.Scenario, mode: Mode, *, with_plugin: bool) -> None:
    reason = scenario.mode_skip_reason(mode, with_plugin=with_plugin)
    if reason:
        pytest.skip(reason)


def _num_embeds(position: Any) -> int:
    """PlaceholderRange.get_num_embeds: a method, a property before 0.2x."""
    value = position.get_num_embeds
    return int(value() if callable(value) else value)


def _split_frames(tokens: tuple[int, ...]) -> list[tuple[bytes, int]]:
    """(timestamp text, pads) per temporal patch; fails on anything but Qwen3-VL's layout."""
    frames, i = [], 0
    while i < len(tokens):
        start = tokens.index(harness.QWEN35_VISION_START_ID, i)
        text = bytes(tokens[i:start])
        end = tokens.index(harness.QWEN35_VISION_END_ID, start)
        pads = tokens[start + 1 : end]
        assert set(pads) == {harness.QWEN35_VIDEO_TOKEN_ID}, pads[:8]
        frames.append((text, len(pads)))
        i = end + 1
    return frames


@pytest.mark.parametrize("is_embed", [True, False], ids=["is_embed-pads", "is_embed-off"])
def test_video_features_have_qwen3vl_layout(is_embed: bool) -> None:
    spec = sc.video_request("layout", (7, 0, 5), frames=3, tokens_per_frame=16, is_embed=is_embed)
    built = harness.build_scheduler(sc.ISSUE_CONFIG)
    request = harness.make_request(built, spec)
    features = request.mm_features
    assert [f.modality for f in features] == ["video", "video"]
    prompt = list(request.prompt_token_ids)
    for video, feature in zip(spec.videos, features, strict=True):
        position = feature.mm_position
        assert (position.offset, position.length) == (video.offset, video.length)
        tokens = tuple(prompt[position.offset : position.offset + position.length])
        frames = _split_frames(tokens)
        # 3 temporal patches of 2 frames at 2 fps: 0.25 s, 1.25 s, 2.25 s, printed as vLLM does.
        assert [text for text, _ in frames] == [b"<0.2 seconds>", b"<1.2 seconds>",
                                                 b"<2.2 seconds>"]  # fmt: skip
        assert all(TIMESTAMP.fullmatch(text) for text, _ in frames)
        assert [pads for _, pads in frames] == [16, 16, 16]
        if is_embed:
            mask = position.is_embed.tolist()
            assert mask == [t == harness.QWEN35_VIDEO_TOKEN_ID for t in tokens]
            assert _num_embeds(position) == 48
        else:
            assert position.is_embed is None
            assert _num_embeds(position) == position.length
    # Back to back: the second range starts where the first ends.
    first, second = (f.mm_position for f in features)
    assert second.offset == first.offset + first.length


def test_gaps_of_the_two_processor_styles() -> None:
    assert sc.TWO_VIDEOS_GAP_0.min_image_gap == 0
    assert sc.TWO_VIDEOS_GAP_2.min_image_gap == 2
    assert sc.IMAGE_AND_VIDEO.min_image_gap == 2


@VIDEOS
def test_encoder_cache_holds_one_video_only(scenario: sc.Scenario) -> None:
    """The stall needs the second input not to fit beside the first."""
    cache = scenario.config.encoder_cache_tokens
    for spec in scenario.specs:
        sizes = [length for _, length in spec.images]
        sizes += [v.num_embeds if v.is_embed else v.length for v in spec.videos]
        if len(sizes) >= 2:
            assert max(sizes) <= cache < sizes[0] + sizes[1], (spec.request_id, sizes, cache)


@VIDEOS
def test_stock_stalls_on_videos(family: Family, scenario: sc.Scenario, sched_mode: Mode) -> None:
    _skip_if_out_of(scenario, sched_mode, with_plugin=False)
    result = scenario.run(sched_mode)
    if facts_for(family).image_deadlock:
        assert result.stalled and not result.completed, result.chunks
        assert all(at < result.prompt_len[rid] for rid, at in result.stall_at.items())
        # The split floored the encoder cut to a block boundary.
        assert all(at % result.block_size == 0 for at in result.stall_at.values())
    else:
        assert result.completed, result.stall_at


@VIDEOS
def test_plugin_completes_videos(
    family: Family, load_plugin: Any, scenario: sc.Scenario, sched_mode: Mode
) -> None:
    _skip_if_out_of(scenario, sched_mode, with_plugin=True)
    force = family.verdict is not Verdict.PATCH
    assert load_plugin(**({"VLLM_MAMBA_FIX": "force"} if force else {}))
    result = scenario.run(sched_mode)
    assert result.completed, f"still stalled with the plugin: {result.stall_at}"
    assert result.violations() == []
    assert result.finished == set(result.prompt_len)
    # Every video range was prefilled (the request did not skip past it).
    for spec in scenario.specs:
        assert result.prefill_done(spec.request_id)


def test_gap_0_videos_under_mtp_stall_stock_for_the_deferred_free(
    family: Family, sched_mode: Mode
) -> None:
    """Gap 0 under MTP: stock parks on its own hang where the deferred free exists
    (0.24-0.32); the plugin test above shows it completes there."""
    if not sched_mode.speculative:
        pytest.skip("only under EAGLE-type speculation")
    if sc.TWO_VIDEOS_GAP_0.mode_skip_reason(sched_mode) is None:
        pytest.skip(f"vLLM {harness.vllm_version()}: no deferred-free hang at gap 0")
    result = sc.TWO_VIDEOS_GAP_0.run(sched_mode)
    assert not result.completed, result.chunks
