"""Fixtures for the scheduler-level suite (issue 2) and its per-release matrix (issue 4).

Every test runs on the vLLM that `import vllm` finds: the environment's
(0.27.1) or a release overlay that tools/matrix.py puts first on PYTHONPATH.
Expectations come from that release's family (vllm_mamba_fix.facts.versions).

A test that takes the `sched_mode` fixture runs once per harness mode
({sync, async} x {no speculation, MTP K=2}; $VLLM_MAMBA_FIX_HARNESS_MODES
narrows the set for the whole process) and is skipped, with vLLM's reason,
where the release cannot build the mode.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tools import sched_harness as harness
from vllm_mamba_fix.facts.versions import Family, family_for

PLUGIN_ENV = ("VLLM_MAMBA_FIX", "VLLM_MAMBA_FIX_SCOPE", "VLLM_PLUGINS")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The release matrix selects this suite with `-m matrix`.
    for item in items:
        if "tests/scheduler/" in item.nodeid.replace("\\", "/"):
            item.add_marker(pytest.mark.matrix)


@pytest.fixture(scope="session")
def vllm_version() -> str:
    return harness.vllm_version()


@pytest.fixture(scope="session")
def family(vllm_version: str) -> Family:
    return family_for(vllm_version)


@pytest.fixture(autouse=True)
def stock_scheduler(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts and ends with vLLM's own scheduler and no plugin settings."""
    for name in PLUGIN_ENV:
        monkeypatch.delenv(name, raising=False)
    harness.unload_plugin()
    assert not harness.split_is_wrapped()
    yield
    harness.unload_plugin()


@pytest.fixture
def load_plugin(monkeypatch: pytest.MonkeyPatch):
    """Load the plugin through vLLM's own `load_general_plugins()`, with env settings;
    returns whether the split rule is installed (the block-unit rule wraps the split anyway)."""

    def _load(**env: str) -> bool:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        harness.load_plugins()
        return harness.split_rule_installed()

    return _load


@pytest.fixture
def vllm_log() -> Iterator[list[str]]:
    """Messages logged under the `vllm` logger tree (vLLM stops propagation at `vllm`)."""
    messages: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = _Collect(level=logging.DEBUG)
    logger = logging.getLogger("vllm")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def wrapped_without_realign(family: Family) -> Iterator[None]:
    """The plugin's wrapper with only the re-align rule switched off."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_mamba_fix.decide.scope import ScopePolicy
    from vllm_mamba_fix.facts.config import Scope
    from vllm_mamba_fix.install import patch
    from vllm_mamba_fix.rules import split_rule

    assert family.prefill_gate is not None
    options = split_rule.WrapOptions(
        family.prefill_gate, ScopePolicy(Scope.MULTIMODAL), realign=False
    )
    harness.wrap_split(Scheduler, options)
    try:
        yield
    finally:
        patch.undo(Scheduler)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under tools/matrix.py: measure the release once more for the table row."""
    target = os.environ.get("VLLM_MAMBA_FIX_MATRIX_REPORT")
    if not target:
        return
    from tools.matrix import probe

    Path(target).write_text(json.dumps(probe(), indent=1))


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    """Every record of the plugin's logger, at every level."""
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
