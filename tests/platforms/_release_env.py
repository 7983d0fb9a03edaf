"""The environment of a subprocess that imports one vLLM release's overlay, plugin unset."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tools import releases

REPO = Path(__file__).resolve().parents[2]


def release_env(release: str) -> dict[str, str]:
    """``os.environ`` with the release first on PYTHONPATH and no plugin settings; skips
    the test when the release can be neither found in the cache nor downloaded."""
    try:
        pythonpath = releases.pythonpath_for(release, base=str(REPO))
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"vLLM {release} is not cached and cannot be downloaded: {exc}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_MAMBA_FIX")}
    env.pop("VLLM_PLUGINS", None)
    env["PYTHONPATH"] = pythonpath
    return env
