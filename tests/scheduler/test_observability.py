"""Counters, correction logs and the scope hook, on the real scheduler of each release."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any

import pytest

from tests.conftest import InstallScopeRule
from tools import scenarios as sc
from tools import sched_harness as harness
from tools.release_facts import facts_for
from tools.sched_harness import HarnessConfig, RequestSpec
from vllm_mamba_fix import records, stats
from vllm_mamba_fix.facts.versions import Family
from vllm_mamba_fix.observe import counters

COUNTER_OF_ACTION = {
    "collapse-prevented": "collapses_prevented",
    "realigned": "chunks_realigned",
    "stopped-at-encoder-input": "chunks_stopped_at_encoder_input",
}


@pytest.fixture(autouse=True)
def affected_release(family: Family) -> None:
    if not facts_for(family).image_deadlock:
        pytest.skip(f"family {family.name}: the plugin does not correct anything by default")


def _corrections(records: list[logging.LogRecord]) -> list[tuple[int, str, str]]:
    """(level, action, request id) of each correction line."""
    found = []
    for record in records:
        if record.name != "vllm.mamba_fix":
            continue  # older releases let vLLM's own records reach caplog too
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) >= 2 and args[0] in COUNTER_OF_ACTION:
            found.append((record.levelno, str(args[0]), str(args[1])))
    return found


def test_corrections_are_counted_and_logged_once_per_request_at_info(
    load_plugin: Any, plugin_log: pytest.LogCaptureFixture
) -> None:
    assert load_plugin()
    result = sc.QUEUE.run()
    assert result.completed

    counts = stats()
    assert "block_size" not in counts  # counters only: facts are in the record
    (built,) = [r for r in records() if r.block is not None]
    assert built.block.mamba == 1056  # the Mamba KV group's block the scheduler has
    lines = _corrections(plugin_log.records)
    per_action = Counter(COUNTER_OF_ACTION[action] for _, action, _ in lines)
    assert sum(counts.values()) > 0
    assert {name: per_action[name] for name in counts} == counts

    info_ids = [request_id for level, _, request_id in lines if level == logging.INFO]
    assert sorted(info_ids) == sorted(set(info_ids)), "a request was logged at info twice"
    assert set(info_ids) == {"running-image", "waiting-image"}  # text is never corrected
    assert all(level in (logging.INFO, logging.DEBUG) for level, _, _ in lines)
    messages = [
        r.getMessage()
        for r in plugin_log.records
        if r.name == "vllm.mamba_fix" and "scheduling" in r.getMessage()
    ]
    assert len(messages) == len(lines)
    assert all("(block size 1056)" in m for m in messages)
    info = [r.getMessage() for r in plugin_log.records if r.levelno == logging.INFO]
    totals = [m for m in info if "scheduling" in m and "this process so far: " in m]
    assert len(totals) == len(info_ids)  # the running totals ride on each first line


class _Sent:
    """Where counters sends its counts (metrics.py's place): what reached it."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def count(self, key: str, amount: int = 1) -> None:
        self.counts[key] += amount

    def stalls(self, standing: int, oldest_start: float) -> None:
        pass

    def block_sizes(self, mamba: int | None, split: int | None) -> None:
        pass


def test_steps_send_their_corrections_without_a_timer_thread(
    load_plugin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step's corrections are sent at its end by the update_from_output wrapper; a
    process whose steps send starts no timer thread (0.5.0 started one a second)."""
    assert load_plugin()
    timers: list[str] = []
    start = threading.Thread.start

    def starting(thread: threading.Thread) -> None:
        if isinstance(thread, threading.Timer):
            timers.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", starting)
    sent, before = _Sent(), counters.metrics
    counters.report_to(sent)
    try:
        result = sc.QUEUE.run()
    finally:
        counters.report_to(before)
    assert result.completed
    corrected = {key: n for key, n in stats().items() if key in counters.ACTION_KEYS.values()}
    assert sum(corrected.values()) > 0
    assert {key: sent.counts[key] for key in corrected} == corrected  # all sent, none left
    assert timers == []


# Two text prompts long enough that the block-unit rule (cache blocks of 256, the configured
# 128) counts many quiet chunks before either finishes, and one image prompt whose first
# chunk the split rule corrects (a logged count).
ENGAGED = HarnessConfig(
    block_size=256, configured_block_size=128, max_num_batched_tokens=384,
    encoder_cache_tokens=256, max_model_len=2048,
)  # fmt: skip
ENGAGED_TEXT = (
    RequestSpec("text-1", 1500, max_tokens=2),
    RequestSpec("text-2", 1300, max_tokens=2),
)
LOGGED = {key for action, key in counters.ACTION_KEYS.items() if action not in counters.QUIET}


def _step_sends(clock_step: float, specs: tuple[RequestSpec, ...], monkeypatch: Any) -> list[Any]:
    """Run ``specs`` on the engaged scheduler under a clock that moves ``clock_step`` seconds
    at each read; per step, (running, counted, sent) of the corrections."""
    now = [100.0]

    def clock() -> float:
        now[0] += clock_step
        return now[0]

    monkeypatch.setattr(counters, "clock", clock)
    sent, before = _Sent(), counters.metrics
    counters.report_to(sent)
    run, seen = harness.Harness(ENGAGED), []
    run.add(*specs)
    try:
        while len(run.finished) < len(specs) and run.step_index < 200:
            run.step()
            counted = {k: n for k, n in stats().items() if k in counters.ACTION_KEYS.values() and n}
            seen.append((bool(run.scheduler.running), counted, dict(sent.counts)))
    finally:
        counters.report_to(before)
    assert len(run.finished) == len(specs)
    return seen


def test_quiet_counts_wait_for_a_second_or_no_running_request(
    load_plugin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A count no log line states (the block-unit rule's) is sent at most once a second while
    requests run (a send each step cost an engaged step 1-3%), and all of it once none runs."""
    assert load_plugin()
    seen = _step_sends(0.0, ENGAGED_TEXT, monkeypatch)  # a clock that never moves
    assert all(counted.keys() <= {"block_rule_chunks"} for _, counted, _ in seen)
    held = [counted != sent for running, counted, sent in seen if running]
    assert sum(held) >= 3, seen  # counted, not yet sent, while the clock stands
    assert seen[-1][1] == seen[-1][2] and seen[-1][1]  # none runs: everything sent
    sends = {tuple(sent.items()) for _, _, sent in seen}
    assert len(sends) == 2, seen  # the first count (no send before it), then the last step's


def test_quiet_counts_are_sent_once_their_second_passed(
    load_plugin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a clock where each read is past the bound, every step sends what it counted."""
    assert load_plugin()
    seen = _step_sends(2 * counters.SEND_SECONDS, ENGAGED_TEXT, monkeypatch)
    assert [counted for _, counted, _ in seen] == [sent for _, _, sent in seen]
    assert seen[-1][1].get("block_rule_chunks", 0) >= 3


def test_a_logged_correction_is_sent_at_its_steps_end(
    load_plugin: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a log line states is at /metrics before its step's outputs, the clock standing."""
    assert load_plugin()
    image = RequestSpec("image", 537, ((1, 256), (259, 256)), max_tokens=2)
    seen = _step_sends(0.0, (*ENGAGED_TEXT, image), monkeypatch)
    logged = [{k: n for k, n in counted.items() if k in LOGGED} for _, counted, _ in seen]
    assert any(logged), seen
    for counts, (_, _, sent) in zip(logged, seen, strict=True):
        assert {k: sent.get(k, 0) for k in counts} == counts


def test_third_party_scope_rule_is_honoured(
    load_plugin: Any, install_scope_rule: InstallScopeRule
) -> None:
    install_scope_rule(
        "exclude_two_images",
        """
        from vllm_mamba_fix.hookspecs import hookimpl

        @hookimpl
        def mamba_fix_in_scope(request, scope):
            return False if request.request_id == "two-images" else None
        """,
    )
    assert load_plugin()
    result = sc.TWO_IMAGES.run()
    assert result.stalled, "the rule excluded the request, so it must hang as on stock"
    counts = stats()
    (built,) = [r for r in records() if r.block is not None]
    assert built.block.mamba == result.block_size  # built, but nothing corrected
    assert sum(counts.values()) == 0
