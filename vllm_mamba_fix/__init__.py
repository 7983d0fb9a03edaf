"""vllm-mamba-fix: ends the multimodal prefill deadlock of hybrid Mamba models in vLLM."""

from __future__ import annotations

from typing import Any

# The version is written once, in _version.py, which pyproject.toml reads.
from vllm_mamba_fix._version import __version__
from vllm_mamba_fix.install.plugin import register, unregister
from vllm_mamba_fix.observe.counters import stats

__all__ = ["__version__", "records", "register", "stats", "unregister"]


def __getattr__(name: str) -> Any:
    # records() loads the record (and what it names) on first use, not with the entry point.
    if name == "records":
        from vllm_mamba_fix.observe.record import records

        return records
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
