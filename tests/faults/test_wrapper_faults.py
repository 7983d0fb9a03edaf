"""The wrapped method under faults: vLLM's errors pass through untouched, ours never escape."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import InstallScopeRule
from tests.faults.conftest import (
    BLOCK,
    FakeRequest,
    FakeVllm,
    LogCapture,
    scheduler_method,
)
from vllm_mamba_fix import register, unregister
from vllm_mamba_fix.facts import targets
from vllm_mamba_fix.rules import encoder_cut

FakeFactory = Callable[..., FakeVllm]


class VllmOwnError(ValueError):
    pass


RAISING_SCHEDULER = """
from types import SimpleNamespace


class MambaSpec:
    def __init__(self, block_size):
        self.block_size = block_size


class Scheduler:
    def __init__(self, block_size=128):
        self.cache_config = SimpleNamespace(block_size=block_size)
        group = SimpleNamespace(kv_cache_spec=MambaSpec(block_size))
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[group])
        self.to_raise = None
        self.max_num_encoder_input_tokens = 512  # below FakeRequest's image
        self.encoder_cache_manager = SimpleNamespace(
            cache_size=1000, num_free_slots=1000, get_cached_input_ids=lambda request: set()
        )

    def _mamba_block_aligned_split(
        self, request, num_new_tokens, num_new_local_computed_tokens=0,
        num_external_computed_tokens=0,
    ):
        if self.to_raise is not None:
            raise self.to_raise
        block_size = self.cache_config.block_size
        return num_new_tokens // block_size * block_size
"""


@pytest.fixture
def patched(fake_vllm: FakeFactory, logs: LogCapture) -> Iterator[type]:
    """The fake 0.27 scheduler, patched through register(); logs cleared after."""
    scheduler = fake_vllm(scheduler=RAISING_SCHEDULER).import_scheduler()
    register()
    assert hasattr(scheduler_method(scheduler), targets.MARKER)
    scheduler(BLOCK)  # its class's active line
    logs.clear()
    yield scheduler


@pytest.mark.parametrize(
    ("request_kwargs", "args", "kwargs"),
    [
        ({}, (), {}),  # in scope, would be corrected
        ({"has_encoder_inputs": False}, (), {}),  # out of scope
        ({"num_computed_tokens": 64}, (32, 0), {}),  # waiting-loop call with extra arguments
        ({}, (), {"num_external_computed_tokens": 16}),
        ({}, (0, 0, 7), {}),  # a fifth argument this release does not take: its TypeError
    ],
)
def test_original_raising_propagates_unchanged(
    patched: type,
    logs: LogCapture,
    request_kwargs: dict[str, Any],
    args: tuple[int, ...],
    kwargs: dict[str, int],
) -> None:
    scheduler = patched(BLOCK)
    error: Exception = VllmOwnError("vLLM's own assertion")
    scheduler.to_raise = error
    if len(args) > 2:
        scheduler.to_raise = None
        with pytest.raises(TypeError, match="positional arguments") as type_error:
            scheduler._mamba_block_aligned_split(FakeRequest(**request_kwargs), 100, *args)
        error = type_error.value
    with pytest.raises(type(error)) as excinfo:
        scheduler._mamba_block_aligned_split(FakeRequest(**request_kwargs), 100, *args, **kwargs)
    if len(args) <= 2:
        assert excinfo.value is error
    assert str(excinfo.value) == str(error)
    assert excinfo.value.__cause__ is None and excinfo.value.__context__ is None
    assert logs.records == []  # not logged, not counted: it is vLLM's error to report


def test_original_raising_base_exceptions_propagate(patched: type, logs: LogCapture) -> None:
    scheduler = patched(BLOCK)
    for error in (KeyboardInterrupt(), SystemExit(3), AssertionError("num_external")):
        scheduler.to_raise = error
        with pytest.raises(type(error)) as excinfo:
            scheduler._mamba_block_aligned_split(FakeRequest(), 100)
        assert excinfo.value is error
    assert logs.records == []


class Bare:
    """A request with only what vLLM's own method needs."""

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)


class Exploding:
    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"cannot read {name}")


def _full(**overrides: Any) -> dict[str, Any]:
    attributes = vars(FakeRequest())
    attributes.update(overrides)
    return attributes


BROKEN_REQUESTS: dict[str, Callable[[], Any]] = {
    "no-num_computed_tokens": lambda: Bare(),
    "num_computed_tokens-None": lambda: Bare(**_full(num_computed_tokens=None)),
    "no-num_prompt_tokens": lambda: Bare(
        **{k: v for k, v in _full().items() if k != "num_prompt_tokens"}
    ),
    "no-mm_features": lambda: Bare(**{k: v for k, v in _full().items() if k != "mm_features"}),
    "no-request_id": lambda: Bare(**{k: v for k, v in _full().items() if k != "request_id"}),
    "every-attribute-raises": Exploding,
}


def split_cut_at_the_image(scheduler: Any, request: Any) -> int:
    """The split of a chunk vLLM's encoder check cut at FakeRequest's image, 256 tokens asked
    and 100 given, as the encoder wrapper notes it (a broken request would break the fake's
    own check first)."""
    encoder_cut.note(scheduler, request, 0, 256, 100)
    return int(scheduler._mamba_block_aligned_split(request, 100))


@pytest.mark.parametrize("case", sorted(BROKEN_REQUESTS))
def test_correction_failure_returns_vllms_result(
    case: str, patched: type, logs: LogCapture
) -> None:
    scheduler = patched(BLOCK)
    request = BROKEN_REQUESTS[case]()
    stock = 0  # 100 // 128 * 128: the correction would have been needed
    assert split_cut_at_the_image(scheduler, request) == stock
    logs.assert_no_traceback()
    assert len(logs.visible) == 1, logs.visible
    (warning,) = logs.warnings
    assert "correction failed" in warning and "using vLLM's result" in warning
    # Later failures stay quiet (vLLM calls this every step) and still return stock.
    for _ in range(3):
        assert split_cut_at_the_image(scheduler, BROKEN_REQUESTS[case]()) == stock
    assert len(logs.visible) == 1, logs.visible
    # Healthy requests are still corrected.
    assert split_cut_at_the_image(scheduler, FakeRequest()) == 100


def test_scheduler_without_cache_config(patched: type, logs: LogCapture) -> None:
    scheduler = patched(BLOCK)
    scheduler.cache_config = None
    with pytest.raises(AttributeError):  # vLLM's own method fails first, unchanged
        scheduler._mamba_block_aligned_split(FakeRequest(), 100)
    assert logs.records == []


def test_raising_scope_hook_falls_back_to_builtin(
    patched: type, logs: LogCapture, install_scope_rule: InstallScopeRule
) -> None:
    install_scope_rule(
        "raising_scope",
        """
        from vllm_mamba_fix.hookspecs import hookimpl

        @hookimpl
        def mamba_fix_in_scope(request, scope):
            raise RuntimeError("third-party scope hook bug")
        """,
    )
    unregister()  # rules load when the scheduler is patched: patch again
    register()
    logs.clear()
    scheduler = patched(BLOCK)
    assert split_cut_at_the_image(scheduler, FakeRequest()) == 100
    text = FakeRequest(has_encoder_inputs=False, request_id="text")
    assert scheduler._mamba_block_aligned_split(text, 100) == 0
    logs.assert_no_traceback()
    hook_warnings = [w for w in logs.warnings if "scope hook raised" in w]
    assert len(hook_warnings) == 1 and "RuntimeError" in hook_warnings[0]
    assert len(logs.warnings) == 1, logs.warnings
    assert not [r for r in logs.records if r.levelno >= logging.ERROR]


def test_scope_all_corrects_a_text_zero_only_where_it_never_clears(
    fake_vllm: FakeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A text request's 0 is a wait for budget unless the block exceeds the longest chunk."""
    from vllm_mamba_fix.rules.zero_streaks import tracked_requests

    monkeypatch.setenv("VLLM_MAMBA_FIX_SCOPE", "all")
    # A release whose split floors every chunk of a block wider than its longest to 0.
    scheduler = fake_vllm("0.25.1", scheduler=RAISING_SCHEDULER).import_scheduler()
    register()
    text = FakeRequest("text", num_computed_tokens=BLOCK, has_encoder_inputs=False)
    waits = scheduler(BLOCK)
    waits.max_num_scheduled_tokens = 8192  # a block's chunk fits: the 0 clears by itself
    for _ in range(3):
        assert waits._mamba_block_aligned_split(text, BLOCK // 2) == 0
    never = scheduler(BLOCK)
    never.max_num_scheduled_tokens = 100  # below the block: the 0 never clears
    assert never._mamba_block_aligned_split(text, BLOCK // 2) == BLOCK // 2
    assert "text" not in tracked_requests()
