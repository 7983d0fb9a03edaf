"""Fixtures shared by every test folder."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

PLUGIN_LOGGER = "vllm.mamba_fix"


@pytest.fixture
def plugin_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog wired straight to the plugin's logger.

    Once vLLM is imported its ``vllm`` logger stops propagating to the root,
    where caplog listens, so attach the handler to the plugin's logger itself.
    """
    logger = logging.getLogger(PLUGIN_LOGGER)
    previous_level, previous_propagate = logger.level, logger.propagate
    logger.propagate = False  # each record reaches caplog once, with or without vLLM
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.DEBUG)
    caplog.handler.setLevel(logging.DEBUG)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(previous_level)
        logger.propagate = previous_propagate
