"""Run the old-order subclass and the base ``Scheduler`` on the importable vLLM, stock and
patched; print what happened as JSON (test_old_order_releases.py runs this per release).

    python -m tests.platforms._old_order_run WORK_DIR
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

from tests.platforms.layout import CONFIG, run
from tests.platforms.old_order import build_old_order_subclass
from tools import sched_harness as harness
from vllm_mamba_fix.facts.targets import MARKER, SPLIT_METHOD


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def _run(cfg: harness.HarnessConfig) -> dict[str, Any]:
    result = run(cfg)
    return {
        "completed": result.completed,
        "stalled": result.stalled,
        "stall_at": result.stall_at,
        "chunks": {rid: [list(c) for c in spans] for rid, spans in result.chunks.items()},
    }


def _split_facts(cls: type) -> dict[str, Any]:
    own = cls.__dict__.get(SPLIT_METHOD)
    return {
        "defines_split": own is not None,
        "split_is_wrapper": hasattr(own, MARKER),
        "split_module": getattr(own, "__module__", None),
        "split_qualname": getattr(own, "__qualname__", None),
    }


def main(work_dir: str) -> None:
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_mamba_fix.facts.evidence import read_evidence
    from vllm_mamba_fix.observe import record

    subclass = build_old_order_subclass(Path(work_dir))
    vllms_own_split = Scheduler.__dict__[SPLIT_METHOD]
    with_subclass = dataclasses.replace(CONFIG, scheduler_cls=subclass)
    out: dict[str, Any] = {
        "version": vllm.__version__,
        "subclass": f"{subclass.__module__}.{subclass.__qualname__}",
        "subclass_split_after_encoder": read_evidence(subclass).split_after_encoder,
        "base_split_after_encoder": read_evidence(Scheduler).split_after_encoder,
        "stock_subclass": _run(with_subclass),
        "stock_base": _run(CONFIG),
    }
    collect = _Collect()
    logging.getLogger("vllm.mamba_fix").addHandler(collect)
    harness.load_plugins()
    out["plugin_subclass"] = _run(with_subclass)
    out["plugin_base"] = _run(CONFIG)
    out["base_after"] = _split_facts(Scheduler)
    out["base_split_is_vllms_own"] = Scheduler.__dict__[SPLIT_METHOD] is vllms_own_split
    out["subclass_after"] = _split_facts(subclass)
    out["records"] = {r.scheduler_class: r.to_json() for r in record.records()}
    out["log"] = collect.lines
    print("OLD_ORDER_RESULT", json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
