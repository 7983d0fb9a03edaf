"""Run vllm-ascend's own Scheduler subclasses on the importable vLLM, stock and patched, in
both load orders of ascend's Scheduler rebinding and this plugin; print JSON.

    python -m tests.platforms._ascend_run ASCEND_SRC LINK_DIR

``ASCEND_SRC`` holds the extracted sdist's ``vllm_ascend/``; only that package is linked
into ``LINK_DIR`` and put on ``sys.path`` (the sdist root's egg-info would register ascend's
platform plugin with vLLM). Stand-ins, here only, for what cannot load without an NPU:

- ``vllm_ascend.utils`` (imports torch_npu): ``vllm_version_is`` as ascend defines it;
- the packages ``vllm_ascend.patch`` and ``vllm_ascend.patch.platform`` without their
  ``__init__``, which imports every NPU patch;
- ``vllm_ascend.ascend_config``'s ``init_ascend_config``/``get_ascend_config``, whose
  ``AscendConfig`` reads NPU topology: ascend's own ``ProfilingChunkConfig()`` defaults and
  balance scheduling on (else ``BalanceScheduler.schedule`` returns the base's).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import sys
import types
from pathlib import Path
from typing import Any

from packaging.version import Version

from tests.platforms.layout import CONFIG, run
from tools import sched_harness as harness

RESULT_PREFIX = "ASCEND_RESULT "
BALANCE = "vllm_ascend.patch.platform.patch_balance_schedule"
EXPLICIT = {  # scheduler_cls as ascend's config sets it, and the harness mode it needs
    "RecomputeScheduler": ("vllm_ascend.core.recompute_scheduler", harness.SYNC),
    "AsyncRecomputeScheduler": ("vllm_ascend.core.recompute_scheduler", harness.ASYNC),
    "ProfilingChunkScheduler": ("vllm_ascend.core.scheduler_profiling_chunk", harness.SYNC),
}


def _vllm_version_is(target: str) -> bool:
    import vllm

    return Version(os.environ.get("VLLM_VERSION") or vllm.__version__) == Version(target)


def _install_stand_ins(source: Path, link_dir: Path) -> None:
    (link_dir / "vllm_ascend").symlink_to(source / "vllm_ascend", target_is_directory=True)
    sys.path.insert(0, str(link_dir))
    utils = types.ModuleType("vllm_ascend.utils")
    utils.vllm_version_is = _vllm_version_is  # type: ignore[attr-defined]
    sys.modules[utils.__name__] = utils
    for name in ("vllm_ascend.patch", "vllm_ascend.patch.platform"):
        package = types.ModuleType(name)
        package.__path__ = [str(link_dir / Path(*name.split(".")))]  # type: ignore[attr-defined]
        sys.modules[name] = package
    ascend_config = importlib.import_module("vllm_ascend.ascend_config")
    config = types.SimpleNamespace(
        profiling_chunk_config=ascend_config.ProfilingChunkConfig(),
        enable_balance_scheduling=True,
    )
    ascend_config.init_ascend_config = lambda vllm_config: config
    ascend_config.get_ascend_config = lambda: config


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[list[str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append([record.levelname, record.getMessage()])


def _case(cfg: harness.HarnessConfig) -> dict[str, Any]:
    from vllm_mamba_fix.observe import record

    out: dict[str, Any] = {"error": None}
    try:
        result = run(cfg)
        out.update(completed=result.completed, stalled=result.stalled, stall_at=result.stall_at)
    except Exception as exc:  # ascend code written for another vLLM API; the test says which
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["records"] = {r.scheduler_class: r.to_json() for r in record.records()}
    out["evidence"] = {
        r.scheduler_class: [r.evidence.schedule_owner, r.evidence.split_after_encoder]
        for r in record.records()
    }
    return out


def _import_balance() -> type:
    from vllm.v1.core.sched import scheduler as scheduler_module

    sys.modules.pop(BALANCE, None)
    module = importlib.import_module(BALANCE)
    assert scheduler_module.Scheduler is module.BalanceScheduler  # ascend's rebinding
    return module.BalanceScheduler


def _all_cases() -> dict[str, Any]:
    """Each explicit scheduler_cls, and the default config (which builds what vLLM's
    scheduler module's ``Scheduler`` is bound to: ascend's BalanceScheduler)."""
    out: dict[str, Any] = {}
    for name, (module, mode) in EXPLICIT.items():
        cls = getattr(importlib.import_module(module), name)
        out[name] = _case(dataclasses.replace(mode.apply(CONFIG), scheduler_cls=cls))
    out["BalanceScheduler"] = _case(CONFIG)
    return out


def main(source: str, link_dir: str) -> None:
    import vllm
    from vllm.v1.core.sched import scheduler as scheduler_module
    from vllm.v1.engine.core import EngineCoreProc

    vllms_scheduler = scheduler_module.Scheduler
    vllms_run_engine_core = EngineCoreProc.__dict__["run_engine_core"]
    _install_stand_ins(Path(source).resolve(), Path(link_dir))
    collect = _Collect()
    logging.getLogger("vllm.mamba_fix").addHandler(collect)
    out: dict[str, Any] = {"version": vllm.__version__}
    out["classes"] = {name: f"{module}.{name}" for name, (module, _) in EXPLICIT.items()} | {
        "BalanceScheduler": f"{BALANCE}.BalanceScheduler"
    }

    _import_balance()  # as ascend's global patches do, before any engine starts
    out["stock"] = _all_cases()

    # Ascend's general plugins ran first: the scheduler module is imported and rebound.
    harness.load_plugins()
    out["ascend_first"] = _all_cases()
    out["ascend_first_log"] = collect.lines[:]
    harness.unload_plugin()
    scheduler_module.Scheduler = vllms_scheduler
    EngineCoreProc.run_engine_core = vllms_run_engine_core
    collect.lines.clear()

    # This plugin ran first; ascend's patch rebinds the Scheduler afterwards.
    harness.load_plugins()
    _import_balance()
    out["plugin_first"] = _all_cases()
    out["plugin_first_log"] = collect.lines[:]
    print(RESULT_PREFIX + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
