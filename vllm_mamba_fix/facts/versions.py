"""Release data: how each vLLM family behaves, read from every release's scheduler
(0.15.0-0.33.0). Only what the plugin reads; what stock does that only the tests expect (the
cut shift, where the image deadlock is) is ``tools/release_facts.py``. No vLLM import."""

from __future__ import annotations

import enum
from typing import NamedTuple

from packaging.version import InvalidVersion, Version


class PrefillGate(enum.Enum):  # how a release decides that a request is still in prefill
    NO_OUTPUT_TOKENS = "num_output_tokens == 0"  # 0.15-0.16
    BEFORE_PREFILL_END = "start < max(num_prompt_tokens, num_tokens - 1)"  # 0.17+


class Verdict(enum.Enum):
    PATCH = "patch"  # affected: the split fix is needed
    NOT_NEEDED = "not-needed"  # fixed upstream
    ABSENT = "absent"  # the method does not exist yet
    UNKNOWN = "unknown"  # the version cannot be parsed


class Family(NamedTuple):
    name: str
    first: tuple[int, int, int]  # inclusive
    end: tuple[int, int, int] | None  # exclusive; None: open-ended
    verdict: Verdict  # of the split rule
    summary: str
    prefill_gate: PrefillGate | None = PrefillGate.BEFORE_PREFILL_END
    deferred_encoder_free: bool = False  # stock defers a free by the drafter's look-ahead (#46315)
    # The model runner falls back to token embeddings when the drafter reads an unencoded input
    # (0.24+); before, a miss asserts (the 0.33 cut would crash the engine).
    drafter_fallback: bool = True
    # The split stops every chunk that starts mid-block at the next boundary (0.27+, #51113);
    # 0.26 only up to its last_cache_position, which EAGLE backs off a block (under MTP a
    # stale block; the plugin re-aligns there).
    stops_mid_block: bool = True
    absolute_end: bool = True  # the split floors the chunk's end, not its length (0.26+)
    # Advances sub-block through a block wider than its longest chunk (0.27+'s guard; before: 0)
    advances_sub_block: bool = True


_AFTER_ENCODER = "split after encoder budgeting"
_DEFERRED_FREE = "encoder free deferred by the drafter's look-ahead"

FAMILIES: tuple[Family, ...] = (
    Family(
        "<0.15", (0, 0, 0), (0, 15, 0), Verdict.ABSENT, "method absent; nothing to patch",
        prefill_gate=None, drafter_fallback=False, stops_mid_block=False,
        absolute_end=False, advances_sub_block=False,
    ),
    Family(
        "0.15", (0, 15, 0), (0, 17, 0), Verdict.PATCH, f"chunk-length alignment; {_AFTER_ENCODER}",
        prefill_gate=PrefillGate.NO_OUTPUT_TOKENS, drafter_fallback=False,
        stops_mid_block=False, absolute_end=False, advances_sub_block=False,
    ),
    Family(
        "0.17", (0, 17, 0), (0, 24, 0), Verdict.PATCH, f"chunk-length alignment; {_AFTER_ENCODER}",
        drafter_fallback=False, stops_mid_block=False, absolute_end=False,
        advances_sub_block=False,
    ),
    Family(
        "0.24", (0, 24, 0), (0, 26, 0), Verdict.PATCH,
        f"chunk-length alignment, fifth parameter; {_AFTER_ENCODER}; {_DEFERRED_FREE}",
        deferred_encoder_free=True, stops_mid_block=False, absolute_end=False,
        advances_sub_block=False,
    ),
    Family(
        "0.26", (0, 26, 0), (0, 27, 0), Verdict.PATCH,
        f"absolute-end alignment; {_AFTER_ENCODER}; {_DEFERRED_FREE}", deferred_encoder_free=True,
        stops_mid_block=False, advances_sub_block=False,
    ),
    Family(
        "0.27", (0, 27, 0), (0, 28, 0), Verdict.PATCH,
        f"absolute-end alignment with guard; {_AFTER_ENCODER}; {_DEFERRED_FREE}",
        deferred_encoder_free=True,
    ),
    Family(
        "0.28", (0, 28, 0), (0, 33, 0), Verdict.NOT_NEEDED,
        f"upstream splits before encoder budgeting (vLLM #51603); {_DEFERRED_FREE}",
        deferred_encoder_free=True,
    ),
    Family(
        "0.33+", (0, 33, 0), None, Verdict.NOT_NEEDED,
        "upstream splits before encoder budgeting and frees encoder inputs without delay",
    ),
)  # fmt: skip

# Used with VLLM_MAMBA_FIX=force when the version cannot be read.
UNKNOWN_FAMILY = Family(
    "unknown", (0, 0, 0), None, Verdict.UNKNOWN, "version not recognised", drafter_fallback=False,
    stops_mid_block=False, absolute_end=False, advances_sub_block=False,
)  # fmt: skip


def release_of(version: str) -> tuple[int, int, int] | None:
    """The (major, minor, micro) release of a version; dev and local parts ignored."""
    try:
        parsed = Version(version.strip())
    except (InvalidVersion, TypeError, AttributeError):
        return None
    major, minor, micro = (*parsed.release, 0, 0)[:3]
    return major, minor, micro


def family_for(version: str) -> Family:
    release = release_of(version)
    if release is None:
        return UNKNOWN_FAMILY
    found = (f for f in FAMILIES if f.first <= release and (f.end is None or release < f.end))
    return next(found, UNKNOWN_FAMILY)  # not reached: FAMILIES covers every release
