"""The engine core's log names vLLM #53912 where the built scheduler is in the combination:
EAGLE-type speculation (``use_eagle``), Mamba KV cache groups and prefix caching (issue 36
item 3). Once per scheduler class, like the active line; never without speculation.

On the real ``Scheduler``/``AsyncScheduler`` in every harness mode (prefix caching is on in
all of them), each built twice, as an engine core with two schedulers in one process would.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from tools import sched_harness as harness
from vllm_mamba_fix._log import FIELD_PREFIX
from vllm_mamba_fix.facts.blocks import BLOCK_ATTR, BlockUnit
from vllm_mamba_fix.observe import mtp_tokens


def _facts(record: logging.LogRecord) -> dict[str, Any]:
    return {
        name.removeprefix(FIELD_PREFIX): value
        for name, value in vars(record).items()
        if name.startswith(FIELD_PREFIX)
    }


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    found: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            found.append(record)

    logger = logging.getLogger("vllm.mamba_fix")
    handler, saved = _Keep(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


def test_the_combination_is_named_once_per_class(
    sched_mode: harness.Mode, load_plugin: Any, records: list[logging.LogRecord]
) -> None:
    load_plugin()
    cfg = sched_mode.apply(harness.HarnessConfig())
    first, second = harness.Harness(cfg).scheduler, harness.Harness(cfg).scheduler
    cls = f"{type(first).__module__}.{type(first).__qualname__}"
    assert type(second) is type(first)
    assert first.use_eagle is sched_mode.speculative  # the mode is what it says
    by_event: dict[str, list[logging.LogRecord]] = {}
    for record in records:
        by_event.setdefault(_facts(record).get("event"), []).append(record)
    # The plugin saw the construction: the class's active (or not-needed) line is there.
    said = by_event.get("active", []) + by_event.get("not-needed", [])
    assert [_facts(r)["scheduler_class"] for r in said] == [cls], [r.getMessage() for r in said]
    named = by_event.get(mtp_tokens.EVENT, [])
    if not sched_mode.speculative:
        assert named == [], [r.getMessage() for r in named]
        return
    (record,) = named  # two schedulers built, one line
    assert record.levelno == logging.WARNING
    assert _facts(record) == {
        "event": mtp_tokens.EVENT,
        "scheduler_class": cls,
        "block": getattr(first, BLOCK_ATTR),  # the Mamba block the plugin read
        "vllm_issue": "vLLM #53912",
    }
    assert getattr(first, BLOCK_ATTR) > 0
    message = record.getMessage()
    assert message.startswith(f"vllm-mamba-fix: {cls} runs EAGLE-type speculative decoding")
    for named_text in ("vLLM #53912", "#53919", "#53505", "serve without MTP", "prefix caching"):
        assert named_text in message, named_text


@pytest.mark.parametrize(
    ("use_eagle", "unit", "prefix_caching", "expected"),
    [
        (True, BlockUnit(1056, 1056), True, True),
        (False, BlockUnit(1056, 1056), True, False),
        (True, BlockUnit(None, 16, "no Mamba KV cache group"), True, False),
        (True, BlockUnit(1056, 1056), False, False),
        (None, BlockUnit(1056, 1056), True, False),  # unreadable: say nothing
    ],
)
def test_affected_needs_all_three(
    use_eagle: Any, unit: BlockUnit, prefix_caching: Any, expected: bool
) -> None:
    assert mtp_tokens.affected(use_eagle, unit, prefix_caching) is expected
