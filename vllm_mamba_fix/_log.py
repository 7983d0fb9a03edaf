"""The plugin's logger, a child of ``vllm`` so lines share vLLM's handler and format."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.mamba_fix")
