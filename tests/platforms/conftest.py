"""Fixtures for the platform-scheduler tests (issue 16): each test starts and ends stock."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

from tools import sched_harness as harness

PLUGIN_ENV = ("VLLM_MAMBA_FIX", "VLLM_MAMBA_FIX_SCOPE", "VLLM_PLUGINS")


@pytest.fixture(autouse=True)
def stock_scheduler(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No plugin and no plugin settings before and after each test."""
    for name in PLUGIN_ENV:
        monkeypatch.delenv(name, raising=False)
    harness.unload_plugin()
    assert not harness.split_is_wrapped()
    yield
    harness.unload_plugin()
