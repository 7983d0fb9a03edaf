"""A scheduler class that overrides the split with its own contract (issue 16).

Mirrors vllm-gaudi's ``HPUAsyncScheduler`` (vllm_gaudi/v1/core/sched/, an ``AsyncScheduler``
subclass): its ``_mamba_block_aligned_split`` floors to the Mamba chunk size and never
calls the base. The plugin's rule re-asks vLLM's own split, so it cannot vouch for this
one: the override is named in the record and a warning, and left as it is.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from tools import scenarios as sc
from tools import sched_harness as harness
from tools.release_facts import facts_for
from vllm_mamba_fix.facts.targets import MARKER, SPLIT_METHOD
from vllm_mamba_fix.facts.versions import family_for
from vllm_mamba_fix.observe import record
from vllm_mamba_fix.observe.record import MethodState

MAMBA_CHUNK_SIZE = 64  # gaudi reads it from the model config; 64 is Qwen3.5's GDN chunk


class HPUStyleAsyncScheduler(AsyncScheduler):
    def _mamba_block_aligned_split(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        start = (
            request.num_computed_tokens
            + num_new_local_computed_tokens
            + num_external_computed_tokens
        )
        if start + num_new_tokens < request.num_prompt_tokens:
            num_new_tokens = num_new_tokens // MAMBA_CHUNK_SIZE * MAMBA_CHUNK_SIZE
        return num_new_tokens


QUALNAME = f"{__name__}.{HPUStyleAsyncScheduler.__qualname__}"


def test_override_is_named_not_wrapped(plugin_log: pytest.LogCaptureFixture) -> None:
    if not facts_for(family_for(harness.vllm_version())).image_deadlock:
        pytest.skip("on a fixed vLLM no split rule applies to this class")
    own = HPUStyleAsyncScheduler.__dict__[SPLIT_METHOD]
    harness.load_plugins()
    assert harness.split_rule_installed()  # the base carries the rule on this release
    cfg = harness.ASYNC.apply(sc.ISSUE_CONFIG)
    built = harness.build_scheduler(
        harness.HarnessConfig(**{**cfg.__dict__, "scheduler_cls": HPUStyleAsyncScheduler})
    )
    assert type(built.scheduler) is HPUStyleAsyncScheduler

    # Not wrapped: the class still resolves its own split, on itself.
    assert HPUStyleAsyncScheduler.__dict__[SPLIT_METHOD] is own
    assert not hasattr(built.scheduler._mamba_block_aligned_split, MARKER)

    recorded = next(r for r in record.records() if r.scheduler_class == QUALNAME)
    split = recorded.method(SPLIT_METHOD)
    assert split is not None
    assert split.state is MethodState.OVERRIDDEN
    assert split.owner == QUALNAME
    assert "split" not in {rule.value for rule in recorded.rules}
    assert "split" in {rule.value for rule in recorded.left_out}

    warnings = [r.getMessage() for r in plugin_log.records if r.levelname == "WARNING"]
    assert any(QUALNAME in m and SPLIT_METHOD in m for m in warnings), warnings
