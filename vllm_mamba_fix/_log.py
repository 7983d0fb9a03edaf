"""The plugin's logger (a child of ``vllm``, so lines share vLLM's handler and format), and the
once-only report of a wrapper that fell back to vLLM's own result."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("vllm.mamba_fix")


def failure_reporter(what: str) -> Callable[[Exception, Any], Any]:
    reported = False

    def fall_back(exc: Exception, stock: Any) -> Any:
        # Never break the host: vLLM's own answer stands.
        nonlocal reported
        if not reported:
            reported = True
            logger.warning(
                "vllm-mamba-fix: %s failed (%s: %s); using vLLM's result",
                what,
                type(exc).__name__,
                exc,
            )
        return stock

    return fall_back
