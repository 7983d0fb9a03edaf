"""The counted carve-outs of the differential suite's step bound (issue 44 item 4).

`_differential.check` holds a corrected run to stock's steps where stock completes with right
chunks, else to 0.28.0's where that completes with right chunks. A run over its bound passes
only where a named mechanism explains the excess, shown by a counterfactual run: the same
plugin run with that mechanism answered as proposed completes within the bound. Each is
counted in the run's figures (`carveout_<name>`) and described in docs/reliability.md
("Steps against stock and 0.28"). A run no counterfactual brings within its bound fails.

- `whole_block_tail`: the split rule's encoder stop replaced a whole-block answer by a chunk
  ending mid-block, at an input that waits on another request (or on the step's encoder
  budget): the next chunk is a re-aligned one. Fixed from 0.5.x: the split rule passes
  `decide(..., tail_frees=)` (`split_rule.tail_frees_room_at`) and keeps the whole block; the
  counterfactual (`tail_frees_of`, the same numbers read here) stays, so a run it still
  explains would show that the wiring missed a cut.
- `kept_whole_block`: the reverse of `whole_block_tail`: the split rule kept the whole-block
  answer where the tail frees nothing (as designed), and 0.28's chunk ending at the input
  finishes sooner anyway, because a preempting KV pool then runs differently (the kept block
  leaves another request's blocks in place, and a later step preempts; found in async on
  0.27.1, pinned as `KEPT_BLOCK_IN_A_PREEMPTING_POOL`). Counterfactual: the encoder stop as
  0.28 answers it (`decide(..., tail_frees=None)`). No rule: which way a preemption falls
  later is not the split call's to know.
- `waiting_reference`: through 0.27 the encoder check runs before the split, also for a
  waiting request whose chunk then is 0, and takes a reference on a cached input it shares
  (a concurrent copy, a repeat): the input stays held while the request waits, and another
  request's input does not fit. 0.28 splits first and takes none. Fixed from 0.5.x: the
  split rule drops them where the split answers 0 (`split_reads.drop_waiting_references`); the
  counterfactual drops every waiting request's references after each step (also those of a
  request whose encoder check itself answered 0, which 0.28 keeps too).
- `eagle_last_cacheable` (0.15-0.26, MTP): the block-unit rule's re-align after a sub-block
  chunk stock schedules from the last cacheable boundary under EAGLE, which 0.28 floors to 0
  (`eagle_last_cacheable_realigns`); the run may exceed its bound by one step per such
  re-align, alone or after a counterfactual above (`whole_block_tail+eagle_last_cacheable`).
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
from unittest import mock

from tools import sched_harness as harness
from vllm_mamba_fix.decide import decision
from vllm_mamba_fix.rules import split_rule

WHOLE_BLOCK_TAIL = "whole_block_tail"
KEPT_WHOLE_BLOCK = "kept_whole_block"
WAITING_REFERENCE = "waiting_reference"
ZERO_THAT_CLEARS = "zero_that_clears"


def _features(request: Any) -> list[Any]:
    return list(getattr(request, "mm_features", None) or [])


def tail_frees_of(scheduler: Any, request: Any, start: int, cut: int, answer: int) -> bool:
    """`decision.tail_frees_room` with the numbers of the real scheduler: the input at
    `start + cut`, the cache's room left to it, the slots of the request's own inputs ending
    in `(start + answer, start + cut]`."""
    feats = _features(request)
    spans = [(f.mm_position.offset, f.mm_position.length) for f in feats]
    at = start + cut
    nxt = sorted((o, i) for i, (o, _) in enumerate(spans) if o >= at)
    if not nxt:
        return True
    need = request.get_num_encoder_embeds(nxt[0][1])
    ecm = scheduler.encoder_cache_manager
    cached = getattr(ecm, "cached", {})
    rid = request.request_id
    own = [i for i, (o, n) in enumerate(spans)
           if rid in cached.get(feats[i].identifier, ()) or (o < at and o + n > start)]  # fmt: skip
    own_ids = {feats[i].identifier for i in own}
    sizes = {f.identifier: r.get_num_encoder_embeds(i)
             for r in scheduler.requests.values() for i, f in enumerate(_features(r))}  # fmt: skip
    others = sum(sizes.get(h, 0) for h, refs in cached.items() if h not in own_ids and refs - {rid})
    held = sum(request.get_num_encoder_embeds(i) for i in own)
    in_tail = sum(request.get_num_encoder_embeds(i) for i in own
                  if start + answer < spans[i][0] + spans[i][1] <= at)  # fmt: skip
    return decision.tail_frees_room(need, ecm.cache_size - others - held, in_tail)


@contextlib.contextmanager
def whole_block_tail() -> Iterator[None]:
    """The split rule as proposed: `decide` told `tail_frees` at every encoder cut."""
    correct, decide = split_rule.SplitRule.correct, split_rule.decide
    current: list[Any] = []  # the call being corrected

    def correcting(self: Any, call: Any, start: int) -> int:
        current.append((call, start))
        try:
            return correct(self, call, start)
        finally:
            current.pop()

    def deciding(stock: int, n: int, start: int, block: int, uncut: int | None = None,
                 tail_frees: bool | None = None) -> decision.Decision:  # fmt: skip
        if uncut is not None and current and current[-1][1] == start:
            call = current[-1][0]
            tail_frees = tail_frees_of(call.scheduler, call.request, start, n, stock)
        return decide(stock, n, start, block, uncut, tail_frees=tail_frees)

    split_rule.SplitRule.correct = correcting  # type: ignore[method-assign]
    split_rule.decide = deciding  # type: ignore[assignment]
    try:
        yield
    finally:
        split_rule.SplitRule.correct = correct  # type: ignore[method-assign]
        split_rule.decide = decide  # type: ignore[assignment]


def kept_whole_block() -> contextlib.AbstractContextManager[Any]:
    """The split rule's encoder stop as 0.28 answers it: `decide` never told `tail_frees`."""
    decide = split_rule.decide

    def deciding(stock: int, n: int, start: int, block: int, uncut: int | None = None,
                 tail_frees: bool | None = None) -> decision.Decision:  # fmt: skip
        return decide(stock, n, start, block, uncut, None)

    return mock.patch.object(split_rule, "decide", deciding)


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


COUNTERFACTUALS = {WHOLE_BLOCK_TAIL: (whole_block_tail,),
                   WAITING_REFERENCE: (waiting_reference,),
                   f"{WHOLE_BLOCK_TAIL}+{WAITING_REFERENCE}": (whole_block_tail,
                                                                 waiting_reference),
                   KEPT_WHOLE_BLOCK: (kept_whole_block,)}  # fmt: skip


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
