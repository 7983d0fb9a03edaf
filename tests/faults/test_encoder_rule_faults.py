"""The encoder-input wrapper and the code-evidence policy under faults (fake vLLM tree).

The speculative-stall rule lives on ``Scheduler._try_schedule_encoder_inputs``
(the watchdog on ``update_from_output``, which an odd encoder check leaves alone):
an unexpected shape leaves that method stock with one line, the wrapper never
raises into vLLM, and the code of the scheduler, not only its version, decides
what is patched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

import vllm_mamba_fix
from tests.active_line import parse_active
from tests.conftest import facts_of
from tests.faults.conftest import (
    BLOCK,
    FIXED_SCHEDULER,
    METHOD,
    STOCK_ENCODER_DEF,
    STOCK_SCHEDULER,
    FakeRequest,
    FakeVllm,
    LogCapture,
)
from tools import sched_harness as harness
from vllm_mamba_fix import register
from vllm_mamba_fix.decide.scope import ScopePolicy
from vllm_mamba_fix.facts import targets
from vllm_mamba_fix.install import patch
from vllm_mamba_fix.rules import encoder_wrapper, table

FakeFactory = Callable[..., FakeVllm]
ENCODER = targets.ENCODER_METHOD
BAD_ENCODER = STOCK_SCHEDULER.replace(
    STOCK_ENCODER_DEF,
    "    def _try_schedule_encoder_inputs(self, request, computed, n, budget, shift=0):",
)
assert BAD_ENCODER != STOCK_SCHEDULER


def _image_request(rid: str = "img") -> FakeRequest:
    request = FakeRequest(rid, num_computed_tokens=300)
    position = SimpleNamespace(offset=320, length=2000)
    request.mm_features = [SimpleNamespace(mm_position=position)]
    return request


def test_unexpected_encoder_signature_leaves_that_method_stock(
    logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    module = fake_vllm(scheduler=BAD_ENCODER).import_module()
    register()
    module.Scheduler(BLOCK)
    logs.assert_no_traceback()
    (warning,) = logs.warnings
    assert "not installing speculative-stall:" in warning and "stall-watchdog" not in warning
    assert "unexpected signature" in warning and "computed, n, budget, shift" in warning
    (active,) = [r for r in logs.at_least(logging.INFO) if " active: " in r.getMessage()]
    parsed = parse_active(active.getMessage())
    assert parsed is not None and parsed.rules[0] == "split", active.getMessage()
    wraps = facts_of(active)["wraps"]  # the methods wrapped: in the fields, not on the line
    assert any(w.endswith(f"Scheduler.{METHOD}") for w in wraps), wraps
    assert not any(ENCODER in w for w in wraps), wraps
    assert not patch.is_wrapped(module.Scheduler, ENCODER)
    assert patch.is_wrapped(module.Scheduler)


def test_encoder_wrapper_never_raises_and_keeps_vllms_result(
    monkeypatch: pytest.MonkeyPatch, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    monkeypatch.setenv("VLLM_MAMBA_FIX_STALL_SECONDS", "0")
    scheduler = fake_vllm().import_scheduler()
    register()
    assert patch.is_wrapped(scheduler, ENCODER)
    instance = scheduler()
    instance.encoder_blocked = True
    logs.clear()
    broken = FakeRequest()
    broken.mm_features = [object()]  # malformed (no mm_position): the wrapper's read fails
    for _ in range(3):
        assert instance._try_schedule_encoder_inputs(broken, 0, 64, 10) == ([], 0, 10, [])
    logs.assert_no_traceback()
    (warning,) = logs.warnings
    assert "the encoder-input check failed" in warning and "using vLLM's result" in warning


class VllmOwnError(RuntimeError):
    pass


def test_vllms_own_error_in_the_encoder_method_propagates(fake_vllm: FakeFactory) -> None:
    scheduler = fake_vllm().import_scheduler()
    register()
    instance = scheduler()
    error = VllmOwnError("vLLM-internal")

    def boom(*args: object, **kwargs: object) -> None:
        raise error

    original = scheduler.__dict__[ENCODER].__wrapped__
    instance.encoder_cache_manager = None  # unused: the original raises first
    patch.undo(scheduler)
    setattr(scheduler, ENCODER, boom)
    try:
        options = encoder_wrapper.EncoderOptions(
            ScopePolicy(vllm_mamba_fix.facts.config.Scope.MULTIMODAL), True
        )
        harness.wrap_encoder(scheduler, options)
        with pytest.raises(VllmOwnError) as excinfo:
            instance._try_schedule_encoder_inputs(_image_request(), 300, 64, 10)
        assert excinfo.value is error
    finally:
        patch.undo(scheduler)
        setattr(scheduler, ENCODER, original)


def _stopped_step(instance: Any, request: FakeRequest, scheduled: int = 0) -> Any:
    """What the fake's update_from_output is handed: a step that gave ``request`` ``scheduled``
    tokens and left the rest of the budget unused; the fake scheduler gets vLLM's fields."""
    request.is_finished = lambda: False  # type: ignore[attr-defined]
    instance.requests = {request.request_id: request}
    instance.running = [request]
    instance.waiting = []
    instance.max_num_running_reqs = 8
    instance.max_num_scheduled_tokens = 1024
    instance.scheduler_config = SimpleNamespace(
        max_num_batched_tokens=1024, long_prefill_token_threshold=0
    )
    tokens = {request.request_id: scheduled} if scheduled else {}
    return SimpleNamespace(num_scheduled_tokens=tokens, total_num_scheduled_tokens=scheduled)


def test_watchdog_names_a_stall_once_and_says_when_it_moves(
    monkeypatch: pytest.MonkeyPatch, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    from vllm_mamba_fix.rules import stall_watch

    monkeypatch.setenv("VLLM_MAMBA_FIX_STALL_SECONDS", "0")
    ticks = iter(range(0, 10_000, 2))  # 2 s per reading: the watchdog samples every step
    monkeypatch.setattr(stall_watch, "clock", lambda: float(next(ticks)))
    scheduler = fake_vllm(version="0.23.0").import_scheduler()
    register()
    instance = scheduler()
    request = _image_request()
    before = vllm_mamba_fix.stats()
    logs.clear()
    for _ in range(5):
        assert instance.update_from_output(_stopped_step(instance, request), None) == {}
    (warning,) = logs.warnings
    for needle in (
        "request img stalled at token 300 of 1000",
        "0 tokens on 3 consecutive steps",
        "waits for [320, 2320) (2000 encoder tokens)",
        "encoder cache 1000 tokens",
        "likely cause: the encoder input it waits for is larger than the encoder cache",
        "remedy: raise --max-num-batched-tokens",
    ):
        assert needle in warning, (needle, warning)
    request.num_computed_tokens += 20  # the step gave it 20 tokens
    instance.update_from_output(_stopped_step(instance, request, 20), None)
    assert any("request img moves again (was stalled at token 300)" in m for m in logs.visible)
    after = vllm_mamba_fix.stats()
    assert after["stalls_detected"] - before["stalls_detected"] == 1
    assert after["stalls_resolved"] - before["stalls_resolved"] == 1


def test_watchdog_off_says_nothing(
    monkeypatch: pytest.MonkeyPatch, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    monkeypatch.setenv("VLLM_MAMBA_FIX_STALL_SECONDS", "off")
    scheduler = fake_vllm(version="0.23.0").import_scheduler()
    register()
    # On 0.23 that method is wrapped only as the split rule's ear (which chunks it cut).
    assert table.carried_by(vars(scheduler)[ENCODER], ENCODER) == frozenset()
    logs.clear()
    assert not patch.is_wrapped(scheduler, targets.UPDATE_METHOD)  # no watchdog, no end
    instance = scheduler()
    instance.encoder_blocked = True
    request = _image_request()
    for _ in range(5):
        instance._try_schedule_encoder_inputs(request, 300, 64, 10)
        instance.update_from_output(_stopped_step(instance, request), None)
    assert logs.warnings == []


def test_code_evidence_patches_a_pre_fix_dev_build(
    logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    scheduler = fake_vllm(version="0.28.0.dev3", scheduler=STOCK_SCHEDULER).import_scheduler()
    register()
    assert patch.is_wrapped(scheduler)
    scheduler(BLOCK)
    (active,) = [r for r in logs.at_least(logging.INFO) if " active: " in r.getMessage()]
    assert "split" in parse_active(active.getMessage()).rules  # type: ignore[union-attr]
    # The reason: in the record's fields and the DEBUG line, no longer on the line itself.
    reason = facts_of(active)["reasons"]["split"]
    assert reason.startswith("code: Scheduler.schedule budgets encoder inputs before the split")
    assert "pre-fix build" in reason
    assert any(reason in r.getMessage() for r in logs.records if r.levelno == logging.DEBUG)


def test_code_evidence_leaves_a_backport_alone(
    logs: LogCapture, fake_vllm: FakeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The block-unit rule, needed on every release, is left out to see the split rule's verdict.
    monkeypatch.setenv("VLLM_MAMBA_FIX_BLOCK_RULE", "0")
    scheduler = fake_vllm(version="0.27.1", scheduler=FIXED_SCHEDULER).import_scheduler()
    register()
    assert not patch.is_wrapped(scheduler) and not patch.is_wrapped(scheduler, ENCODER)
    scheduler(BLOCK)
    logs.assert_no_traceback()
    (line,) = logs.visible
    assert "not needed for vllm.v1.core.sched.scheduler.Scheduler on vLLM 0.27.1" in line
    assert "leaving it stock" in line
    assert "splits before encoder budgeting" in line and "backport" in line
