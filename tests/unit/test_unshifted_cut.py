"""The unshifted-cut rule (issue 15, item 4) against a model of vLLM's encoder cut.

`_vllm_cut` restates the cut of vLLM 0.27.1's `Scheduler._try_schedule_encoder_inputs`
for whole-image placeholders (no EC connector, chunked encoder input allowed):
the window reaches `shift` tokens past the chunk, held inputs are skipped, the
others are summed until one does not fit, and the chunk is cut `shift` tokens
before that one (0 once the cut point is behind the computed tokens).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vllm_mamba_fix.decide.decision import speculative_stall_release, unshifted_cut_needed

Layout = dict[int, tuple[int, int]]


def _vllm_cut(
    computed: int, num_new: int, shift: int, inputs: Layout, held: set[int], room: int
) -> int:
    """Tokens vLLM schedules; ``room``: encoder-cache slots free to this request."""
    window_end = computed + num_new + shift
    to_schedule = 0
    for input_id, (offset, length) in sorted(inputs.items(), key=lambda item: item[1]):
        if offset + length <= computed or offset >= window_end or input_id in held:
            continue
        if to_schedule + length > room:
            return offset - (computed + shift) if computed + shift < offset else 0
        to_schedule += length
    return num_new


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, Layout]:
    """Up to four non-overlapping inputs; returns (prompt length, layout)."""
    pos, inputs = draw(st.integers(0, 40)), {}
    for input_id in range(draw(st.integers(1, 4))):
        length = draw(st.integers(1, 300))
        inputs[input_id] = (pos, length)
        pos += length + draw(st.integers(0, 4))
    return pos + 1, inputs


def test_the_warm_gap_0_repeat() -> None:
    # Images [1, 257) and [257, 513); a prefix hit at 256 with image 1 evicted.
    images = {0: (1, 256), 1: (257, 256)}
    assert _vllm_cut(256, 344, 1, images, set(), room=384) == 0
    assert unshifted_cut_needed(256, 1, images, set())
    # 0.33's cut: the one token left of image 1.
    assert _vllm_cut(256, 344, 0, images, set(), room=384) == 1
    # The existing release does not see it: the request holds nothing.
    assert not speculative_stall_release(256, 1, {}).stalled


def test_not_without_shift_nor_with_the_inputs_cached_or_apart() -> None:
    images = {0: (1, 256), 1: (257, 256)}
    assert not unshifted_cut_needed(256, 0, images, set())
    # Image 1 still cached: nothing to re-encode (the deferred-free case, if any).
    assert not unshifted_cut_needed(256, 1, images, {0})
    # Image 2 cached: vLLM skips it, the window cuts nowhere.
    assert not unshifted_cut_needed(256, 1, images, {1})
    # Gap 1: the shifted cut is 1 token, no stall.
    assert not unshifted_cut_needed(256, 1, {0: (1, 256), 1: (258, 256)}, set())
    assert _vllm_cut(256, 344, 1, {0: (1, 256), 1: (258, 256)}, set(), room=384) == 1
    # Between the images (no input under the next token): a wait for room, not a stall.
    assert not unshifted_cut_needed(257, 1, {0: (1, 256), 1: (258, 256)}, set())


def test_two_inputs_start_within_the_shift_after_text() -> None:
    # Text at 10, inputs [11, 12) and [12, 200), shift 2: the same 0 with no input
    # under the next token; without the shift vLLM schedules [10, 12).
    inputs = {0: (11, 1), 1: (12, 188)}
    assert _vllm_cut(10, 100, 2, inputs, set(), room=188) == 0
    assert unshifted_cut_needed(10, 2, inputs, set())
    assert _vllm_cut(10, 100, 0, inputs, set(), room=188) == 2
    assert not unshifted_cut_needed(10, 1, inputs, set())


Case = tuple[int, int, int, Layout, set[int], int]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """The request alone, in an encoder cache that holds any one of its inputs."""
    prompt_len, inputs = draw(layouts())
    shift = draw(st.integers(1, 3))
    computed = draw(st.integers(0, prompt_len - 1))
    num_new = draw(st.integers(1, prompt_len - computed))
    held = draw(st.sets(st.sampled_from(sorted(inputs))))
    largest = max(length for _, length in inputs.values())
    room = draw(st.integers(largest, 3 * largest))
    return computed, num_new, shift, inputs, held, room


def _reached(computed: int, shift: int, inputs: Layout, held: set[int]) -> list[int]:
    """Lengths of the uncached inputs over positions [computed, computed + shift]."""
    return [
        length
        for input_id, (offset, length) in inputs.items()
        if input_id not in held and offset <= computed + shift and offset + length > computed
    ]


@given(case=cases())
def test_every_shifted_zero_the_unshifted_cut_would_end_is_seen(case: Case) -> None:
    computed, num_new, shift, inputs, held, room = case
    shifted = _vllm_cut(computed, num_new, shift, inputs, held, room)
    unshifted = _vllm_cut(computed, num_new, 0, inputs, held, room)
    if shifted == 0 and unshifted > 0:
        assert unshifted_cut_needed(computed, shift, inputs, held)


@given(case=cases())
def test_when_it_fires_and_the_inputs_do_not_fit_together_vllm_returns_zero(
    case: Case,
) -> None:
    computed, num_new, shift, inputs, held, room = case
    if unshifted_cut_needed(computed, shift, inputs, held) and room < sum(
        _reached(computed, shift, inputs, held)
    ):
        assert _vllm_cut(computed, num_new, shift, inputs, held, room) == 0


@given(case=cases())
def test_the_retry_moves_and_stops_before_what_it_cannot_encode(case: Case) -> None:
    """The unshifted cut of a request alone always schedules a token, and its chunk
    covers only inputs that fit together (the rest of it waits for the next step)."""
    computed, num_new, _, inputs, held, room = case
    unshifted = _vllm_cut(computed, num_new, 0, inputs, held, room)
    assert unshifted >= 1
    covered = [
        length
        for input_id, (offset, length) in inputs.items()
        if input_id not in held and offset < computed + unshifted and offset + length > computed
    ]
    assert sum(covered) <= room


@given(
    computed=st.integers(0, 5000),
    inputs=st.dictionaries(
        st.integers(0, 5), st.tuples(st.integers(0, 5000), st.integers(1, 3000)), max_size=4
    ),
    held=st.sets(st.integers(0, 5)),
)
def test_never_without_a_shift(computed: int, inputs: Layout, held: set[int]) -> None:
    assert not unshifted_cut_needed(computed, 0, inputs, held)
