"""Issue 12 item 4 on every release: the code evidence agrees with the version policy.

Runs on the vLLM that `import vllm` finds (the matrix overlays each release),
so the real `Scheduler` source of every release from 0.15.0 to 0.33.0 is read.
"""

from __future__ import annotations

import inspect

from tools.release_facts import CutShift, facts_for
from vllm_mamba_fix.facts import targets
from vllm_mamba_fix.facts.evidence import read_evidence
from vllm_mamba_fix.facts.versions import Family, Verdict


def _scheduler() -> type:
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def test_code_evidence_agrees_with_the_version(family: Family) -> None:
    evidence = read_evidence(_scheduler())
    assert evidence.problem is None
    assert evidence.split_after_encoder == (family.verdict is Verdict.PATCH)
    assert evidence.deferred_encoder_free == family.deferred_encoder_free


def test_both_methods_have_the_expected_shape(family: Family) -> None:
    scheduler = _scheduler()
    assert targets.check_target(scheduler, targets.SPLIT_METHOD) is None
    assert targets.check_target(scheduler, targets.ENCODER_METHOD) is None


def test_the_cut_shift_is_the_one_the_family_names(family: Family) -> None:
    source = inspect.getsource(_scheduler().schedule)
    expected = {
        CutShift.USE_EAGLE: "shift_computed_tokens=1 if self.use_eagle else 0",
        CutShift.PREFILL_LOOKAHEAD: "shift_computed_tokens=self.num_prefill_lookahead",
    }[facts_for(family).cut_shift]
    assert source.count(expected) == 2  # the running and the waiting loop
