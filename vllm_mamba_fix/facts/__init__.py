"""Facts: what the plugin reads and never decides, about vLLM and about its own settings.

- ``versions.py``: the release data per vLLM family (``FAMILIES``, ``family_for``);
- ``targets.py``: the names and shapes of the module, class and methods it touches;
- ``evidence.py``: what a scheduler class's own code shows;
- ``blocks.py``: the block the Mamba cache really stores, and the split's settlement;
- ``config.py``: the plugin's ``VLLM_MAMBA_FIX*`` variables, parsed into ``Settings``.

May import: one another, and the bottom modules (``_log``). Never vLLM, and nothing of
``decide``, ``observe``, ``rules``, ``install`` or ``doctor`` (pyproject.toml's import
contracts, checked by ``lint-imports``).
"""
