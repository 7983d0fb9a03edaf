"""What stock vLLM does per release family: the facts the tests expect, not the plugin's data.

The plugin measures these live (the block, the cut shift, the parameters it is called
with) or never needs them, so they live here, beside the tests that check them against
each release's code (``tests/unit/test_versions.py``, ``tests/scheduler/test_evidence.py``)
and the tests whose expectations depend on them. One :class:`ReleaseFacts` per family
of :data:`vllm_mamba_fix.facts.versions.FAMILIES` (and the ``unknown`` family), by name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vllm_mamba_fix.facts.versions import Family


class CutShift(enum.Enum):
    """How ``schedule()`` shifts an encoder-limited cut under EAGLE-type speculation."""

    USE_EAGLE = "1 if use_eagle"  # 0.15-0.27
    PREFILL_LOOKAHEAD = "num_prefill_lookahead"  # 0.28+: num_spec_tokens for multi-module MTP


@dataclass(frozen=True)
class ReleaseFacts:
    family: str  # a Family.name
    # Stock keeps a request that starts mid-block misaligned: re-align is vital.
    stock_stays_misaligned: bool = False
    # Stock budgets the encoder before the split, so a sub-block cut becomes 0.
    image_deadlock: bool = True
    extra_parameter: bool = False  # 0.24-0.25 pass a fifth positional argument
    cut_shift: CutShift = CutShift.USE_EAGLE


_FACTS: tuple[ReleaseFacts, ...] = (
    ReleaseFacts("<0.15", image_deadlock=False),
    ReleaseFacts("0.15", stock_stays_misaligned=True),
    ReleaseFacts("0.17", stock_stays_misaligned=True),
    ReleaseFacts("0.24", stock_stays_misaligned=True, extra_parameter=True),
    ReleaseFacts("0.26"),
    ReleaseFacts("0.27"),
    ReleaseFacts("0.28", image_deadlock=False, cut_shift=CutShift.PREFILL_LOOKAHEAD),
    ReleaseFacts("0.33+", image_deadlock=False, cut_shift=CutShift.PREFILL_LOOKAHEAD),
    ReleaseFacts("unknown", image_deadlock=False, cut_shift=CutShift.PREFILL_LOOKAHEAD),
)

# By family name; tests/unit/test_versions.py checks it names every family, and no other.
FACTS: dict[str, ReleaseFacts] = {facts.family: facts for facts in _FACTS}


def facts_for(family: Family | str) -> ReleaseFacts:
    """The facts of ``family`` (a :class:`Family` or its name)."""
    return FACTS[family if isinstance(family, str) else family.name]
