"""vllm-mamba-fix: ends the multimodal prefill deadlock of hybrid Mamba models in vLLM."""

from __future__ import annotations

# The one place the version is written: pyproject.toml reads it (setuptools dynamic version).
__version__ = "0.4.0"

from vllm_mamba_fix.counters import stats
from vllm_mamba_fix.plugin import register, unregister
from vllm_mamba_fix.record import records

__all__ = ["__version__", "records", "register", "stats", "unregister"]
