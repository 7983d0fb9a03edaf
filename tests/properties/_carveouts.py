"""The counted carve-outs of the differential suite's step bound (issue 44 item 4).

`_differential.check` holds a corrected run to stock's steps where stock completes with right
chunks, else to 0.28.0's where that completes with right chunks. A run over its bound passes
only where a named mechanism explains the excess, shown by a counterfactual run: the same
plugin run with that mechanism answered as proposed completes within the bound. Each is
counted in the run's figures (`carveout_<name>`) and described in docs/reliability.md
("Steps against stock and 0.28"). A run no counterfactual brings within its bound fails.

- (fixed, no longer a carve-out) `whole_block_tail`: the split rule's encoder stop replaced a
  whole-block answer by a chunk ending mid-block, at an input that waits on another request
  (or on the step's encoder budget), so the next chunk was a re-aligned one. The split rule now
  keeps the whole block where computing the tail frees nothing that input needs
  (`decision.tail_frees_room`, read by `split_rule._cut_input_room`).
- `waiting_reference`: through 0.27 the encoder check runs before the split, also for a
  waiting request whose chunk then is 0, and takes a reference on a cached input it shares
  (a concurrent copy, a repeat): the input stays held while the request waits, and another
  request's input does not fit. 0.28 splits first and takes none. The counterfactual drops a
  waiting request's references after each step; the plugin does not (a proposal).
- `eagle_last_cacheable` (0.15-0.26, MTP): the block-unit rule's re-align after a sub-block
  chunk stock schedules from the last cacheable boundary under EAGLE, which 0.28 floors to 0
  (`eagle_last_cacheable_realigns`); the run may exceed its bound by one step per such
  re-align, alone or after a counterfactual above (`waiting_reference+eagle_last_cacheable`).
- `zero_that_clears`: stock completes with right chunks and the plugin, answering as 0.28
  (moving a request stock leaves at 0 for a step, or ending a chunk at an input as 0.28
  does), is slower than stock and no slower than 0.28: stock's 0 cleared because another
  request moved later, which no rule can know at that step.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

from tools import sched_harness as harness

WAITING_REFERENCE = "waiting_reference"
ZERO_THAT_CLEARS = "zero_that_clears"


def _features(request: Any) -> list[Any]:
    return list(getattr(request, "mm_features", None) or [])


def release_waiting_references(scheduler: Any) -> None:
    """Drop every encoder-cache reference of a request left waiting (0.28 takes none)."""
    ecm = scheduler.encoder_cache_manager
    cached = getattr(ecm, "cached", {})
    for request in list(scheduler.waiting):
        for i, f in enumerate(_features(request)):
            if request.request_id in cached.get(f.identifier, ()):
                ecm.free_encoder_input(request, i)


@contextlib.contextmanager
def waiting_reference() -> Iterator[None]:
    """Every harness step as proposed: a request left waiting holds no reference."""
    advance = harness.Harness.advance

    def stepping(self: harness.Harness) -> bool:
        moved = advance(self)
        release_waiting_references(self.scheduler)
        return moved

    harness.Harness.advance = stepping  # type: ignore[method-assign]
    try:
        yield
    finally:
        harness.Harness.advance = advance  # type: ignore[method-assign]


COUNTERFACTUALS = {WAITING_REFERENCE: (waiting_reference,)}


EAGLE_LAST_CACHEABLE = "eagle_last_cacheable"


def eagle_last_cacheable_realigns(w: Any, mine: Any, mode: Any, release: tuple[int, int]) -> int:
    """The re-aligns of `eagle_last_cacheable`: under EAGLE-type speculation 0.15-0.26 back
    the last cacheable position off a block (`last_cache_position - block_size`) and leave a
    chunk starting there unfloored, so a budget's sub-block remainder is scheduled from that
    boundary ([96, 101) in block 48 for a 153-token prompt); its next chunk then crosses the
    next boundary from mid-block (vLLM #51113) and the block-unit rule re-aligns it, a step
    0.28 (which floors that remainder to 0 and waits) does not take. Counted per request."""
    if not mode.speculative or not (0, 15) <= release < (0, 27):
        return 0
    realigned = {(rid, step) for step, rid, action in mine.corrections if action == "realigned"}
    b, count = mine.block, 0
    for rid, chunks in mine.chunks.items():
        prompt = mine.prompt_len[rid]
        last = max(prompt - prompt % b - b, 0)
        for (_, s0, e0), (step, s1, _) in itertools.pairwise(chunks):
            if s0 % b == 0 and s0 >= last and e0 - s0 < b and s1 == e0 and e0 < prompt and (
                (rid, step) in realigned
            ):  # fmt: skip
                count += 1
    return count
