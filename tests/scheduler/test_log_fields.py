"""The plugin's records on the real scheduler carry their facts as fields: the active line,
the corrections, and a stall named, ended and moving again (issue 37 item 6).

Each field is checked against the record's own text, so a field that says another thing
than the line fails. Time is a clock the test advances 5 s per engine step.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from tests.active_line import parse_active
from tests.conftest import facts_of
from tests.stall_end_helpers import install_clock, stall_end_installed, update_wrapped
from tools import scenarios as sc
from tools import sched_harness as harness
from tools.release_facts import facts_for
from tools.scenarios import ISSUE_CONFIG, image_request, text_request
from vllm_mamba_fix._log import EVENTS, FIELD_PREFIX, FIELDS
from vllm_mamba_fix.decide.stalls import StallCause
from vllm_mamba_fix.facts.versions import Family

SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
NAMED = re.compile(r"request (?P<rid>\S+) stalled at token (?P<pos>\d+) of (?P<prompt>\d+)")
ENDED = re.compile(r"ended request (?P<rid>\S+): 0 tokens at token (?P<pos>\d+) of .*; cause: ")
MOVED = re.compile(r"request (?P<rid>\S+) moves again \(was stalled at token (?P<pos>\d+)\)")


@pytest.fixture(autouse=True)
def affected_release(family: Family) -> None:
    if not facts_for(family).image_deadlock:
        pytest.skip(f"family {family.name}: the split rule does not run by default")


def _events(records: list[logging.LogRecord], event: str) -> list[logging.LogRecord]:
    return [r for r in records if facts_of(r).get("event") == event]


def _every_record_is_named(records: list[logging.LogRecord]) -> None:
    for record in records:
        facts = facts_of(record)
        assert facts.get("event") in EVENTS, record.getMessage()
        assert set(facts) <= set(FIELDS), (set(facts) - set(FIELDS), record.getMessage())


def test_active_line_and_corrections(load_plugin: Any, records: list[logging.LogRecord]) -> None:
    assert load_plugin()
    assert sc.QUEUE.run().completed
    _every_record_is_named(records)
    (active,) = _events(records, "active")
    text = parse_active(active.getMessage())
    assert text is not None and len(active.getMessage()) <= 300, active.getMessage()
    facts = facts_of(active)
    assert (facts["scheduler_class"], facts["block"]) == (text.scheduler_class, text.block)
    assert (facts["scheduler_class"], facts["block"]) == (SCHEDULER, 1056)
    assert {"split", "block-unit", "stall-watchdog"} <= set(facts["rules"])
    assert list(text.rules) == facts["rules"] and text.settings == facts["settings"] == {}
    # The reasons are off the line, in the fields: one per rule the plan weighed.
    assert set(facts["reasons"]) >= set(facts["rules"]), facts["reasons"]
    assert all(": " in reason for reason in facts["reasons"].values()), facts["reasons"]
    assert facts["vllm_version"] == harness.vllm_version()
    corrections = _events(records, "correction")
    assert {facts_of(r)["request_id"] for r in corrections} == {"running-image", "waiting-image"}
    for record in corrections:
        # The line's own arguments: action, request id, start, tokens, block size.
        action, rid, start, tokens, block = record.args[:5]  # type: ignore[index]
        facts = facts_of(record)
        assert [facts[k] for k in ("action", "request_id", "position", "tokens", "block")] == [
            action, rid, start, tokens, block,
        ]  # fmt: skip
        assert facts["rule"] == "split" and block == 1056


def test_a_stall_named_ended_and_moving_again(
    load_plugin: Any, records: list[logging.LogRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The split rule off: the running image request stalls on stock's split and is ended;
    the image request its image keeps waiting is named, then moves again."""
    clock = install_clock(monkeypatch)
    load_plugin(
        VLLM_MAMBA_FIX_STALL_SECONDS="30",
        VLLM_MAMBA_FIX_END_STALLS_AFTER="30",
        VLLM_MAMBA_FIX_SPLIT_RULE="0",
    )
    if not harness.split_is_wrapped():
        pytest.skip("the split is not wrapped with its rule off: no split 0 reaches the watchdog")
    if not stall_end_installed():
        pytest.skip("the plugin installs no stall end with the split rule off on this release")
    h = harness.Harness(ISSUE_CONFIG)
    with update_wrapped(30.0):
        h.add(image_request("running-image", (100, 50, 200)))
        h.step()
        clock.advance(5.0)
        h.add(image_request("one-image", (40, 60)), text_request("queued-text", 3000))
        while len(h.finished) < len(h.requests) and h.step_index < 200:
            h.advance()
            clock.advance(5.0)
    _every_record_is_named(records)
    named = _events(records, "stall-named")
    ended = _events(records, "stall-ended")
    moved = _events(records, "stall-moved")
    assert named and ended and moved, [r.getMessage() for r in records]
    for record, pattern in [*((r, NAMED) for r in named), *((r, ENDED) for r in ended)]:
        text = pattern.search(record.getMessage())
        assert text is not None, record.getMessage()
        facts = facts_of(record)
        assert (facts["request_id"], facts["position"]) == (text["rid"], int(text["pos"]))
        assert StallCause(facts["cause"])  # a cause's stable name
    for record in named:
        facts = facts_of(record)
        assert facts["prompt_tokens"] == int(NAMED.search(record.getMessage())["prompt"])
        assert facts["seconds"] >= 30 and facts["steps"] >= 3
    (end,) = ended
    assert facts_of(end)["request_id"] == "running-image"
    assert f"; cause: {facts_of(end)['cause']}; remedy: " in end.getMessage()
    assert facts_of(end)["cause"] == StallCause.SPLIT_FLOOR.value
    for record in moved:
        text = MOVED.search(record.getMessage())
        assert text is not None
        assert (facts_of(record)["request_id"], facts_of(record)["position"]) == (
            text["rid"],
            int(text["pos"]),
        )
    assert {facts_of(r)["request_id"] for r in moved} <= {facts_of(r)["request_id"] for r in named}
    assert all(FIELD_PREFIX + "event" in vars(r) for r in records)
