"""Facts: what the plugin reads and never decides: vLLM's releases (``versions.py``), the names
and shapes it touches (``targets.py``), a scheduler's own code (``evidence.py``), the Mamba
block (``blocks.py``) and its own ``VLLM_MAMBA_FIX*`` settings (``config.py``).

May import one another and ``_log``; never vLLM, nor a layer above (``lint-imports``)."""
