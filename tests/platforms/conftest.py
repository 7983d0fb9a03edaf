"""Fixtures for the platform-scheduler tests (issue 16): each test starts and ends stock."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

# The scheduler suite's autouse fixture: no plugin and no plugin settings around each test.
from tests.scheduler.conftest import stock_scheduler

__all__ = ["stock_scheduler"]
