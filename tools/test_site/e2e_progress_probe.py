"""Scheduler progress probe for the hang watchdog (TEST-ONLY, observes, never changes).

Enabled by ``VLLM_E2E_PROBE=<file>`` in a process that has ``tools/test_site`` on PYTHONPATH.
It wraps ``Scheduler.schedule`` of the process that builds the scheduler (vLLM's engine core)
and appends JSON lines to ``<file>``::

    {"pid": 123, "step": 4711, "t": 1.7e9, "reqs": {"<id>": [computed, prompt, scheduled, still]},
     "block_size": 128, "use_eagle": false}

(``block_size`` and ``use_eagle``, the scheduler's own values, only on lines where a position
changed.)

``still`` is the number of consecutive ``schedule()`` calls in which that request's
``num_computed_tokens`` did not move while it was unfinished. A line is written whenever a
request's position changes, and otherwise at most every 0.5 s, so a spinning, stuck engine
(thousands of empty steps per second) is visible from outside at low cost.

The watchdog (``tools.engine_demo``) decides "hung" only when a prefilling request has been
stuck at one position for many steps *and* seconds: evidence of no progress, not a timeout.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from types import ModuleType

from e2e_post_import import when_imported

ENV = "VLLM_E2E_PROBE"
SCHED_MODULE = "vllm.v1.core.sched.scheduler"
HEARTBEAT_S = 0.5


def _install_on(module: ModuleType, path: str) -> None:
    cls = module.Scheduler
    original = cls.schedule
    if getattr(original, "_e2e_probe", False):
        return
    state: dict[str, object] = {"step": 0, "last_write": 0.0, "pos": {}, "still": {}}

    def schedule(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        # The probe must never break the engine.
        with contextlib.suppress(Exception):
            _record(self, out, state, path)
        return out

    schedule._e2e_probe = True  # type: ignore[attr-defined]
    schedule.__wrapped__ = original  # type: ignore[attr-defined]
    cls.schedule = schedule


def _record(sched, out, state: dict, path: str) -> None:
    state["step"] += 1
    pos: dict[str, int] = state["pos"]
    still: dict[str, int] = state["still"]
    scheduled = getattr(out, "num_scheduled_tokens", {}) or {}
    reqs = {}
    changed = False
    for req_id, req in list(sched.requests.items()):
        computed = int(req.num_computed_tokens)
        if pos.get(req_id) == computed:
            still[req_id] = still.get(req_id, 0) + 1
        else:
            changed = True
            still[req_id] = 0
            pos[req_id] = computed
        reqs[req_id] = [
            computed,
            int(req.num_prompt_tokens),
            int(scheduled.get(req_id, 0)),
            still[req_id],
        ]
    for gone in set(pos) - set(sched.requests):
        pos.pop(gone, None)
        still.pop(gone, None)
        changed = True
    now = time.time()
    if not changed and now - state["last_write"] < HEARTBEAT_S:
        return
    state["last_write"] = now
    rec = {"pid": os.getpid(), "step": state["step"], "t": now, "reqs": reqs}
    if state["step"] == 1 or changed:
        # The engine's configured block, for tests that check the layout they ran (e.g. block
        # size under speculative decoding, which vLLM derives differently). Read from the
        # engine's config: where the block-unit rule engaged, the scheduler's own cache_config
        # is the plugin's view with the cache's block.
        config = getattr(getattr(sched, "vllm_config", None), "cache_config", sched.cache_config)
        rec["block_size"] = int(config.block_size)
        rec["use_eagle"] = bool(getattr(sched, "use_eagle", False))
    line = json.dumps(rec)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line + "\n")


def install() -> bool:
    path = os.environ.get(ENV)
    if not path:
        return False
    when_imported(SCHED_MODULE, lambda module: _install_on(module, path))
    return True
