"""Test-only start-up hook for the tiny-model tests, demo and CPU examples.

``PYTHONPATH=tools/test_site`` makes every Python process started with that environment (the
test or demo process, vLLM's engine-core subprocess, ``vllm serve`` and its engine core) run
this at start-up:

* ``e2e_tv_shim``: lets transformers' Qwen3-VL processing run without torchvision;
* ``e2e_video_shim``: lets videos through that path too (a torch-only ``tvF`` for transformers'
  video processor, and vLLM 0.27.1's text-without-videos processor call past transformers 5.x);
* ``e2e_progress_probe``: only if ``VLLM_E2E_PROBE`` is set, records scheduler progress for the
  hang watchdog;
* ``e2e_cpu_mamba_spec``: CPU stand-ins for the two Triton kernels of vLLM's speculative Mamba
  "align" path, bound only where Triton is unavailable (speculative decoding on the CPU engine).

Never raises: an interpreter that merely inherits PYTHONPATH must keep working.
"""

try:
    import e2e_cpu_mamba_spec as _cpu_mamba_spec
    import e2e_progress_probe as _probe
    import e2e_tv_shim as _tv_shim
    import e2e_video_shim as _video_shim

    _tv_shim.install()
    _video_shim.install()
    _probe.install()
    _cpu_mamba_spec.install()
except Exception as _exc:  # pragma: no cover - defensive
    import sys as _sys

    print(f"test_site: not installed ({type(_exc).__name__}: {_exc})", file=_sys.stderr)
