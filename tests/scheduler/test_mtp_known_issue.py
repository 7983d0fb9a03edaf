"""The engine core's log names vLLM #53912 where the built scheduler is in the combination:
EAGLE-type speculation (``use_eagle``), Mamba KV cache groups and prefix caching (issue 36
item 3). Once per scheduler class, like the active line; never without speculation.

On the real ``Scheduler``/``AsyncScheduler`` in every harness mode (prefix caching is on in
all of them), each built twice, as an engine core with two schedulers in one process would.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.conftest import facts_of
from tools import sched_harness as harness
from vllm_mamba_fix.facts.blocks import BLOCK_ATTR, BlockUnit
from vllm_mamba_fix.observe import mtp_tokens


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
        by_event.setdefault(facts_of(record).get("event"), []).append(record)
    # The plugin saw the construction: the class's active (or not-needed) line is there.
    said = by_event.get("active", []) + by_event.get("not-needed", [])
    assert [facts_of(r)["scheduler_class"] for r in said] == [cls], [r.getMessage() for r in said]
    named = by_event.get(mtp_tokens.EVENT, [])
    if not sched_mode.speculative:
        assert named == [], [r.getMessage() for r in named]
        return
    (record,) = named  # two schedulers built, one line
    assert record.levelno == logging.WARNING
    assert facts_of(record) == {
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
