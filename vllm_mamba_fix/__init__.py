"""vllm-mamba-fix: ends the multimodal prefill deadlock of hybrid Mamba models in vLLM."""

from __future__ import annotations

# The version is written once, in _version.py, which pyproject.toml reads.
from vllm_mamba_fix._version import __version__
from vllm_mamba_fix.install.plugin import register, unregister
from vllm_mamba_fix.observe.counters import stats
from vllm_mamba_fix.observe.record import records

__all__ = ["__version__", "records", "register", "stats", "unregister"]
