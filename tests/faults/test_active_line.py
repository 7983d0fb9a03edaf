"""Issue 45 item 3: the start-up line an operator reads is one line of at most 300 characters,
naming the version, the scheduler class, the rules, the block and the settings changed.

Real lines: the plugin registered on a fake vLLM tree (see conftest) and a scheduler built, in
configurations that run every rule, leave some out, meet bad settings and change every one.
The reasons are off the line, at DEBUG and in the record's fields.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from tests.active_line import parse_active
from tests.conftest import facts_of
from tests.faults.conftest import BLOCK, FIXED_SCHEDULER, STOCK_SCHEDULER, FakeVllm, LogCapture
from vllm_mamba_fix import __version__, register
from vllm_mamba_fix.install.active_line import ACTIVE_LINE_LIMIT

FakeFactory = Callable[..., FakeVllm]
SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
EVERY_SETTING = {
    "VLLM_MAMBA_FIX": "force",
    "VLLM_MAMBA_FIX_SCOPE": "all",
    "VLLM_MAMBA_FIX_STALL_SECONDS": "7.5",
    "VLLM_MAMBA_FIX_END_STALLS_AFTER": "off",
    "VLLM_MAMBA_FIX_SPLIT_RULE": "0",
    "VLLM_MAMBA_FIX_BLOCK_RULE": "0",
}
# (vLLM version, scheduler source, environment, the rules, the settings shown)
CASES = {
    "every rule": ("0.27.1", STOCK_SCHEDULER, {}, None, {}),
    "upstream fixed: block-unit only": ("0.28.0", FIXED_SCHEDULER, {}, ("block-unit",), {}),
    "split rule off": (
        "0.27.1", STOCK_SCHEDULER, {"VLLM_MAMBA_FIX_SPLIT_RULE": "off"}, None,
        {"split_rule": "off"},
    ),
    "bad settings: problems, defaults apply": (
        "0.27.1", STOCK_SCHEDULER,
        {"VLLM_MAMBA_FIX_SCOPE": "everything", "VLLM_MAMBA_FIX_STALL_SECONDS": "-3"}, None, {},
    ),
    "every setting changed": (
        "0.27.2.dev12+gabc1234", STOCK_SCHEDULER, EVERY_SETTING, None,
        {"mode": "force", "scope": "all", "stall_seconds": "7.5", "end_stalls_after": "off",
         "split_rule": "off", "block_rule": "off"},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_the_active_line_is_short_and_says_what_runs(
    case: str, logs: LogCapture, fake_vllm: FakeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    version, source, env, rules, settings = CASES[case]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    scheduler = fake_vllm(version=version, scheduler=source).import_scheduler()
    register()
    scheduler(BLOCK)
    logs.assert_no_traceback()
    (active,) = [r for r in logs.at_least(logging.INFO) if " active: " in r.getMessage()]
    line = active.getMessage()
    assert len(line) <= ACTIVE_LINE_LIMIT == 300, (len(line), line)
    assert "\n" not in line
    parsed = parse_active(line)
    assert parsed is not None, line
    facts = facts_of(active)
    assert (parsed.version, parsed.scheduler_class) == (__version__, SCHEDULER)
    assert list(parsed.rules) == facts["rules"] and facts["rules"], line
    if rules is not None:
        assert parsed.rules == rules, line
    assert parsed.block == facts["block"] == BLOCK, line
    assert parsed.settings == settings == facts["settings"], line
    assert parsed.vllm == version.strip()
    # The reasons: in the fields and at DEBUG, not on the line.
    assert set(facts["reasons"]) >= set(parsed.rules)
    debug = [r.getMessage() for r in logs.records if r.levelno == logging.DEBUG]
    for rule in parsed.rules:
        reason = facts["reasons"][rule]
        assert reason not in line and any(reason in m for m in debug), (rule, reason)
