"""Offline ``vllm.LLM`` (engine core in its own process) on the tiny hybrid VL model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tools import json_logging
from tools.engine_demo import PLUGIN_LINE, Outcome

pytestmark = pytest.mark.e2e

ACTIVE = re.compile(r"vllm-mamba-fix \S+ active: .*\bpid (\d+)\)")
CORRECTION = re.compile(
    r"vllm-mamba-fix: (?P<action>[a-z-]+) for request (?P<rid>\S+) at token (?P<start>\d+): "
    r"scheduling (?P<tokens>\d+) tokens \(block size (?P<block>\d+)\); this process so far: "
)
F = "vllm_mamba_fix_"  # the prefix of the plugin's log fields


def _explain(outcome: Outcome) -> str:
    return f"status={outcome.status} evidence={outcome.evidence}\n{outcome.log_text[-6000:]}"


def test_stock_hangs_with_progress_evidence(offline_stock: Outcome, stock_hangs: None) -> None:
    outcome = offline_stock
    assert outcome.status == "hung", _explain(outcome)
    # The verdict names a request stuck at one position across many scheduler steps: the
    # encoder cache holds image 1 only, and the aligned split returns 0 at block 2's start.
    assert "stuck at computed position 256 of " in (outcome.evidence or "")
    assert outcome.results == []  # nothing came back
    assert "disabled by VLLM_MAMBA_FIX" in outcome.log_text
    assert not ACTIVE.search(outcome.log_text)
    # The hang cost the watchdog's budget, not a CI timeout.
    assert outcome.elapsed_s < 240


def test_default_completes(offline_patched: Outcome) -> None:
    assert offline_patched.status == "completed", _explain(offline_patched)
    first = offline_patched.result("patched", 0)
    assert len(first["token_ids"]) == 16
    assert first["prompt_tokens"] == 537  # 2 x 256 image tokens + markers + text


def test_patch_active_in_engine_core_process(offline_patched: Outcome) -> None:
    """Asserted from the engine-core process's own log line, not from this process."""
    assert offline_patched.status == "completed", _explain(offline_patched)
    lines = [ln for ln in offline_patched.log_text.splitlines() if ACTIVE.search(ln)]
    active_pids = {int(ACTIVE.search(ln).group(1)) for ln in lines}
    # vLLM prefixes engine-core output with "(EngineCore pid=N)".
    prefixed = {int(m) for ln in lines for m in re.findall(r"\(EngineCore pid=(\d+)\)", ln)}
    # One engine core per phase; the probe reports the pid of the process whose scheduler ran.
    assert len(offline_patched.engine_pids) == 3
    assert set(offline_patched.engine_pids) <= active_pids
    assert set(offline_patched.engine_pids) <= prefixed
    assert offline_patched.worker_pid not in active_pids


def test_outputs_unchanged(offline_patched: Outcome) -> None:
    """Greedy tokens: patched == warm (prefix hits over Mamba states) == reference == no cache."""
    assert offline_patched.status == "completed", _explain(offline_patched)
    patched = offline_patched.result("patched", 0)
    warm = offline_patched.result("patched", 1)
    reference = offline_patched.result("reference", 0)
    noprefix = offline_patched.result("noprefix", 0)
    assert warm["num_cached_tokens"] > 0, "the warm run must hit the prefix cache"
    assert patched["num_cached_tokens"] == 0
    assert patched["token_ids"] == warm["token_ids"]
    assert patched["token_ids"] == reference["token_ids"]
    assert patched["token_ids"] == noprefix["token_ids"]


def test_different_image_changes_output(offline_patched: Outcome) -> None:
    """The comparison above can fail: the model is sensitive to the second image's pixels."""
    assert offline_patched.status == "completed", _explain(offline_patched)
    same = offline_patched.result("patched", 0)
    other = offline_patched.result("patched", 2)
    assert other["images"] == [0, 2]
    assert other["token_ids"] != same["token_ids"]


def test_log_records_carry_their_facts_as_json_fields(
    offline_patched: Outcome, offline_json_log: Path
) -> None:
    """Under vLLM's logging config with a JSON formatter (examples/vllm_json_logging.json),
    the plugin's records carry their facts as keys, and the text lines stay as they were."""
    assert offline_patched.status == "completed", _explain(offline_patched)
    ours = [r for r in json_logging.records(offline_json_log) if r.get("name") == "vllm.mamba_fix"]
    # The same records, in vLLM's text format, in the same run's text log, word for word.
    lines = offline_patched.log_text.splitlines()
    texts = {m["msg"] for m in (PLUGIN_LINE.match(line.strip()) for line in lines) if m}
    assert ours and {r["message"] for r in ours} <= texts
    corrections = [r for r in ours if r.get(F + "event") == "correction"]
    # A request's first correction is logged at info (the two-image request is corrected).
    assert corrections, ours
    for record in corrections:
        text = CORRECTION.match(record["message"])
        assert text is not None, record["message"]
        facts = [record[F + k] for k in ("request_id", "action", "position", "tokens", "block")]
        assert facts == [text["rid"], text["action"], int(text["start"]), int(text["tokens"]), 256]
        assert int(text["block"]) == 256 and record[F + "rule"] == "split"
    active = {r["process"]: r for r in ours if r.get(F + "event") == "active"}
    assert set(offline_patched.engine_pids) <= set(active)
    first = active[corrections[0]["process"]]
    assert first[F + "scheduler_class"] == "vllm.v1.core.sched.scheduler.Scheduler"
    assert {"split", "block-unit"} <= set(first[F + "rules"])
    assert (first[F + "block"], first[F + "configured_block"]) == (256, 256)
