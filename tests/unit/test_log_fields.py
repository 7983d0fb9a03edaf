"""The plugin's log records carry their facts as fields (``extra=``), under stable, documented
names, and their text stays as it was; the fields are built only for a record that is emitted.

The real engine under vLLM's JSON logging config: tests/e2e/test_offline.py; the stall and
active records on the real scheduler: tests/scheduler/test_log_fields.py.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import facts_of
from vllm_mamba_fix import _log
from vllm_mamba_fix._log import EVENTS, FIELD_PREFIX, FIELDS
from vllm_mamba_fix.changes import Changes
from vllm_mamba_fix.decide.decision import Action
from vllm_mamba_fix.observe import counters

REPO = Path(__file__).resolve().parents[2]
DEPLOYMENT = REPO / "docs" / "deployment.md"
EXAMPLE = REPO / "examples" / "vllm_json_logging.json"


@pytest.fixture
def fresh_counters(session: Changes) -> Changes:
    return session


def test_a_correction_carries_its_facts_and_keeps_its_text(
    plugin_log: pytest.LogCaptureFixture, fresh_counters: None
) -> None:
    counters.record(Action.COLLAPSE_PREVENTED, "req-1", 11616, 378, 1056)
    counters.record(Action.REALIGNED, "req-1", 11994, 678, 1056)  # its second: debug
    counters.record(Action.SPECULATIVE_STALL_RELEASED, "req-2", 11848, 1, 1056)
    first, second, third = plugin_log.records
    assert first.getMessage() == (
        "vllm-mamba-fix: collapse-prevented for request req-1 at token 11616: scheduling 378 "
        "tokens (block size 1056); this process so far: 1 collapses prevented, 0 re-aligned, 0 "
        "stopped at an encoder input, 0 speculative stalls released, 0 block-rule chunks, 0 "
        "stalls named, 0 ended"
    )
    assert second.getMessage() == (
        "vllm-mamba-fix: realigned for request req-1 at token 11994: scheduling 678 tokens "
        "(block size 1056)"
    )
    assert (first.levelno, second.levelno, third.levelno) == (
        logging.INFO, logging.DEBUG, logging.INFO,
    )  # fmt: skip
    assert facts_of(first) == {
        "event": "correction", "request_id": "req-1", "rule": "split",
        "action": "collapse-prevented", "position": 11616, "tokens": 378, "block": 1056,
    }  # fmt: skip
    assert facts_of(second)["action"] == "realigned" and facts_of(second)["position"] == 11994
    assert (facts_of(third)["rule"], facts_of(third)["action"]) == (
        "speculative-stall",
        "speculative-stall-released",
    )


def test_fields_are_built_only_for_a_record_that_is_emitted(
    monkeypatch: pytest.MonkeyPatch, fresh_counters: None
) -> None:
    built: list[str] = []
    real = counters.fields

    def counting(event: str, **facts: Any) -> dict[str, Any]:
        built.append(event)
        return real(event, **facts)

    monkeypatch.setattr(counters, "fields", counting)
    logger = logging.getLogger("vllm.mamba_fix")
    saved = logger.level
    logger.setLevel(logging.INFO)  # vLLM's default level
    try:
        counters.record(Action.REALIGNED, "req-1", 0, 256, 256)  # first: info, emitted
        for start in range(256, 256 * 50, 256):  # later ones: debug, not emitted
            counters.record(Action.REALIGNED, "req-1", start, 256, 256)
        counters.record(Action.BLOCK_ALIGNED, "req-2", 0, 256, 256)  # always debug
    finally:
        logger.setLevel(saved)
    assert built == ["correction"]
    assert counters.stats()["chunks_realigned"] == 50  # every correction still counts


def test_the_summary_carries_the_counts(
    plugin_log: pytest.LogCaptureFixture, fresh_counters: None
) -> None:
    counters.record(Action.STOPPED_AT_ENCODER_INPUT, "req-1", 0, 259, 256)
    counters.log_summary()
    summary = plugin_log.records[-1]
    assert summary.getMessage().startswith("vllm-mamba-fix: this process prevented 0 collapses")
    assert facts_of(summary) == {"event": "summary", "counts": counters.stats()}


def test_a_failing_wrapper_says_so_in_fields(plugin_log: pytest.LogCaptureFixture) -> None:
    fall_back = _log.failure_reporter("the encoder-input check")
    assert fall_back(KeyError("x"), "stock") == "stock"
    (record,) = plugin_log.records
    assert facts_of(record) == {
        "event": "fallback",
        "problem": "the encoder-input check failed (KeyError: 'x')",
    }


def test_field_names_clear_logrecord_attributes() -> None:
    reserved = set(vars(logging.LogRecord("n", logging.INFO, "p", 1, "m", (), None)))
    reserved |= {"message", "asctime", "taskName"}
    names = {FIELD_PREFIX + name for name in FIELDS}
    assert not names & reserved
    assert set(_log.fields("active", rule="split")) == {
        "vllm_mamba_fix_event",
        "vllm_mamba_fix_rule",
    }


def _doc_table(heading: str) -> dict[str, str]:
    """The first table under ``heading`` in docs/deployment.md: first column -> second."""
    text = DEPLOYMENT.read_text()
    start = text.index(heading)
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.fullmatch(r"`([^`]+)`", cells[0]) if len(cells) >= 2 else None
        if name:
            rows[name.group(1)] = cells[1]
        elif rows and not line.startswith("|"):
            break
    return rows


def test_the_fields_and_events_are_documented() -> None:
    fields = _doc_table("### Log fields")
    assert set(fields) == {FIELD_PREFIX + name for name in FIELDS}
    events = _doc_table("The events (`vllm_mamba_fix_event`)")
    assert set(events) == set(EVENTS)


def test_the_example_logging_config_emits_the_fields_as_json_keys(
    fresh_counters: None,
) -> None:
    """The formatter of examples/vllm_json_logging.json, built as dictConfig builds it (without
    dictConfig's reset of every handler in this process)."""
    import io
    import logging.config

    config = json.loads(EXAMPLE.read_text())
    formatter = logging.config.DictConfigurator(config).configure_formatter(
        dict(config["formatters"]["json"])
    )
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    plugin = logging.getLogger("vllm.mamba_fix")
    saved = plugin.level
    plugin.addHandler(handler)
    plugin.setLevel(logging.INFO)
    try:
        counters.record(Action.COLLAPSE_PREVENTED, "req-9", 256, 3, 256)
    finally:
        plugin.removeHandler(handler)
        plugin.setLevel(saved)
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert record["message"].startswith("vllm-mamba-fix: collapse-prevented for request req-9")
    assert {k: v for k, v in record.items() if k.startswith(FIELD_PREFIX)} == {
        "vllm_mamba_fix_event": "correction", "vllm_mamba_fix_request_id": "req-9",
        "vllm_mamba_fix_rule": "split", "vllm_mamba_fix_action": "collapse-prevented",
        "vllm_mamba_fix_position": 256, "vllm_mamba_fix_tokens": 3, "vllm_mamba_fix_block": 256,
    }  # fmt: skip
