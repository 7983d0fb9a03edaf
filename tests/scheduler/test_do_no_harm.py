"""Never worse than stock (issue 27): workloads stock vLLM of the same release completes
with the right chunks, the plugin completes the same way.

Each case was a harm of 0.4.0, found with stock as the reference:

- on 0.28+ the split runs before encoder budgeting, so a split 0 is a wait for token
  budget; 0.4.0's watchdog read it as an encoder stall and ended a healthy two-image
  request waiting behind a long prefill;
- up to 0.25 vLLM's split has no sub-block exemption; where the cache's block exceeds
  the budget (or ``long_prefill_token_threshold``) but the configured block does not,
  0.4.0's block-unit rule floored every chunk but a prompt's last to 0 and hung the queue.

The watchdog's clock runs far ahead on every reading, so every wait is longer than both
bounds and the watchdog and the end act as early as they ever could.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.stall_end_helpers import install_clock
from tools import sched_harness as harness
from tools.sched_harness import HarnessConfig, RequestSpec
from vllm_mamba_fix import stats
from vllm_mamba_fix.facts.versions import Family, Verdict

CACHED, CONFIGURED = 256, 128
# Far more than the watchdog's 30 s and the end's 60 s on every clock reading.
SECONDS_PER_READING = 1000.0


def _chunks(result: harness.RunResult) -> dict[str, list[tuple[int, int]]]:
    return {rid: result.spans(rid) for rid in result.chunks}


# -- a split 0 where the split runs first is a budget wait ------------------------------------

STARVED = HarnessConfig(
    block_size=CACHED,
    max_num_batched_tokens=1000,
    encoder_cache_tokens=200,
    max_model_len=32768,
)
LONG_TEXT = RequestSpec("long-text", 24_000, max_tokens=1, seed=5)
# Both images meet the request's first block and never fit the encoder cache together.
TWO_IMAGES = RequestSpec("two-images", 700, ((10, 200), (230, 200)), max_tokens=2, seed=6)


def test_a_budget_wait_is_never_ended(
    family: Family, sched_mode: harness.Mode, load_plugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = sched_mode.apply(STARVED)
    stock = harness.run_requests([LONG_TEXT, TWO_IMAGES], cfg, max_steps=200)
    install_clock(monkeypatch, per_call=SECONDS_PER_READING)
    if not load_plugin() and not stock.completed:
        pytest.skip(f"stock {family.name} stalls here and the release carries no split rule")
    ended_before = stats()["stalls_ended"]  # the process's count: other tests' ends too
    patched = harness.run_requests([LONG_TEXT, TWO_IMAGES], cfg, max_steps=200)
    assert patched.completed, patched.stall_at
    assert stats()["stalls_ended"] == ended_before
    assert patched.finished == {"long-text", "two-images"}
    assert patched.violations(CACHED) == [], _chunks(patched)
    if stock.completed:  # a healthy workload: the plugin changes nothing
        assert stock.violations(CACHED) == [] and _chunks(patched) == _chunks(stock)
        assert patched.steps <= stock.steps


# -- the block-unit rule never returns 0 where vLLM's configured split returns more ---------

BETWEEN = HarnessConfig(
    block_size=CACHED,
    configured_block_size=CONFIGURED,
    max_num_batched_tokens=192,
    encoder_cache_tokens=256,
    max_model_len=2048,
)
QUEUE = (
    RequestSpec("text-600", 600, max_tokens=2, seed=1),
    RequestSpec("short-text", 100, max_tokens=2, seed=2),
    RequestSpec("one-image", 500, ((100, 256),), max_tokens=2, seed=3),
)


@pytest.mark.parametrize("after", [False, True], ids=["set-before-build", "set-after-build"])
@pytest.mark.parametrize(
    "limits",
    [{"max_num_batched_tokens": 192}, {"max_num_batched_tokens": 2048,
                                        "long_prefill_token_threshold": 192}],
    ids=["budget-192", "threshold-192"],
)  # fmt: skip
def test_a_budget_between_the_two_blocks_is_served(
    after: bool,
    limits: dict[str, int],
    family: Family,
    sched_mode: harness.Mode,
    load_plugin,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = sched_mode.apply(dataclasses.replace(BETWEEN, configured_after_build=after, **limits))
    try:
        stock = harness.run_requests(QUEUE, cfg)
    # A release that checks the cache's block against the budget (0.17 also asserts the
    # threshold is at least the block: a ValueError, which the harness reports as the mode's
    # ModeUnsupported under speculation or async scheduling).
    except (ValueError, harness.ModeUnsupported) as exc:
        pytest.skip(f"vLLM {family.name} rejects this configuration: {exc}")
    if not stock.completed:
        pytest.skip(f"stock {family.name} does not complete this workload: {stock.stall_at}")
    install_clock(monkeypatch, per_call=SECONDS_PER_READING)
    load_plugin()
    ended_before = stats()["stalls_ended"]  # the process's count: other tests' ends too
    patched = harness.run_requests(QUEUE, cfg)
    assert patched.completed, patched.stall_at
    assert stats()["stalls_ended"] == ended_before
    assert patched.violations(CACHED) == [], _chunks(patched)
    if stock.violations(CACHED) == []:  # stock is right here: the plugin changes nothing
        assert _chunks(patched) == _chunks(stock)
        assert patched.steps <= stock.steps


def test_block_rule_chunks_counts_the_chunks_the_rule_changed(
    family: Family, sched_mode: harness.Mode, load_plugin
) -> None:
    """One count per scheduled chunk the rule changed, not per split call: a request the
    rule holds at 0 for many steps adds nothing (0.4.0 counted every such call)."""
    if family.verdict is Verdict.ABSENT:
        pytest.skip("no split")
    cfg = sched_mode.apply(BETWEEN)
    alone = [QUEUE[0]]  # no budget shared: each chunk's change shows against stock's
    stock = harness.run_requests(alone, cfg)
    load_plugin()
    before = stats()["block_rule_chunks"]
    patched = harness.run_requests(alone, cfg)
    counted = stats()["block_rule_chunks"] - before
    assert patched.completed and patched.violations(CACHED) == []
    stock_ends = {(rid, s): e for rid in stock.chunks for s, e in stock.spans(rid)}
    changed = [
        (rid, s, e)
        for rid in patched.chunks
        for s, e in patched.spans(rid)
        if stock_ends.get((rid, s), e) != e
    ]
    assert counted == len(changed), (changed, _chunks(stock), _chunks(patched))
