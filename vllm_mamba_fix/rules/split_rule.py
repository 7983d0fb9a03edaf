# Rule:     split (Rule.SPLIT in rules/table.py; off with VLLM_MAMBA_FIX_SPLIT_RULE=0)
# Answers:  the split deadlock of hybrid Mamba models with prefix caching: through 0.27.1
#           schedule() budgets encoder inputs before _mamba_block_aligned_split, which floors
#           a chunk cut short before an image to 0 tokens on every step. Upstream fixed the
#           order in vLLM #51603 ("Apply Mamba alignment before encoder caps", 0.28.0).
# Runs on:  0.15.0-0.27.1; on 0.28+ only under a scheduler whose own schedule() keeps the old
#           order (a platform's, or a build without #51603); what 0.28 completes, the rule
#           completes, with 0.28's chunks. Its wrapper carries the block-unit rule too.
# Decided:  by the scheduler class's own code (facts/evidence.py: split after encoder
#           budgeting), by the version where the code cannot tell (decide/policy.py:
#           split_verdict); VLLM_MAMBA_FIX=force installs it on any release.
# Removed:  once the oldest supported release has #51603 and no supported scheduler budgets
#           encoder inputs before the split.
"""The split method's wrapper and the split rule, top to bottom: the wrapper returns vLLM's
answer at once wherever no rule can act (every decode, most prefill chunks); the rest, one
:class:`SplitCall`, meets :meth:`SplitRule.look` and ``decide()`` (tested exhaustively). A
wrapper never raises anything of its own into vLLM. No vLLM import.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NamedTuple

from vllm_mamba_fix._log import failure_reporter
from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.decide.decision import (
    Action,
    Decision,
    can_need_correction,
    configured_floor_differs,
    decide,
    in_prefill_by_output_tokens,
    in_prefill_by_position,
    tail_frees_room,
)
from vllm_mamba_fix.decide.scope import builtin_scope
from vllm_mamba_fix.facts.blocks import SPLIT_ATTR, SplitState
from vllm_mamba_fix.facts.config import Scope
from vllm_mamba_fix.facts.targets import EXTRA_COMPUTED_PARAMETERS, Args, Kwargs
from vllm_mamba_fix.facts.versions import PrefillGate
from vllm_mamba_fix.observe import counters, record
from vllm_mamba_fix.rules import block_unit, encoder_cut, split_reads
from vllm_mamba_fix.rules.marking import marked
from vllm_mamba_fix.rules.split_settle import WrapOptions, settle

NO_KWARGS: Kwargs = {}  # the known signature's keywords: none (only unpacked, never changed)


def extra_computed_tokens(args: Args, kwargs: Kwargs) -> int:
    given = sum(args[: len(EXTRA_COMPUTED_PARAMETERS)])
    return given + sum(kwargs.get(name, 0) for name in EXTRA_COMPUTED_PARAMETERS[len(args) :])


def make_wrapper(original: Callable[..., int], options: WrapOptions) -> Callable[..., int]:
    """Wrap the split ``original``; vLLM's own exceptions propagate, the wrapper's never do."""
    rule = SplitRule(original, options)
    if split_reads.has_known_parameters(original):
        wrapper = _known_signature(original, rule)
    else:  # 0.24-0.25's third trailing parameter too: no call of the others tests for it
        wrapper = _any_signature(original, rule)
    return marked(wrapper, original, options)


def _known_signature(original: Callable[..., int], rule: SplitRule) -> Callable[..., int]:
    """The wrapper for the split's known parameters, the one vLLM calls on every release: it
    forwards positionally (no *args, about 0.6 us a call) and returns a whole chunk (every
    decode) on one comparison and one flag, and a chunk out of the split rule's reach (its 0s;
    any chunk where no rule acts on others) on a few more; the rest meets ``rule.look``. A
    scheduler's state is set at its first split, before vLLM is asked (it may engage the
    block-unit rule's view), and deleted by unregister()."""
    settled, look, takes, fall_back = rule.settled, rule.look, rule.takes, rule.fall_back

    def split(
        self: Any,
        request: Any,
        num_new_tokens: int,
        num_new_local_computed_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> int:
        try:
            state = self._vllm_mamba_fix_split  # facts.blocks.SPLIT_ATTR
        except AttributeError:
            state = settled(self)
        answer = original(
            self, request, num_new_tokens, num_new_local_computed_tokens,
            num_external_computed_tokens,
        )  # fmt: skip
        try:
            if answer == num_new_tokens:
                if not state.whole_chunks_cross:  # also where quiet
                    return answer
            elif state.quiet or not ((answer and not state.others_stand) or takes(request)):
                return answer  # out of the split rule's reach: a 0, or where no rule acts
        except Exception as exc:
            return fall_back(exc, answer)
        args = num_new_local_computed_tokens, num_external_computed_tokens
        offset = num_new_local_computed_tokens + num_external_computed_tokens
        return look(SplitCall(self, request, num_new_tokens, answer, offset, state, args))

    return split


def _any_signature(original: Callable[..., int], rule: SplitRule) -> Callable[..., int]:
    """The wrapper for any other split's parameters (0.24-0.25's third trailing one, or a
    platform's): the same answers as the known one's (``look`` decides every early return)."""
    settled, look = rule.settled, rule.look

    def split(self: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> int:
        state = getattr(self, SPLIT_ATTR, None) or settled(self)
        answer = original(self, request, num_new_tokens, *args, **kwargs)
        if state.quiet or (answer == num_new_tokens and not state.whole_chunks_cross):
            return answer
        try:
            offset = extra_computed_tokens(args, kwargs)
        except Exception as exc:
            return rule.fall_back(exc, answer)
        return look(SplitCall(self, request, num_new_tokens, answer, offset, state, args, kwargs))

    return split


def whole_chunk_stands(scheduler: Any, start: int, answer: int, state: SplitState) -> bool:
    """A whole chunk that stays in its block: vLLM's, but for a sub-block chunk from a
    boundary under EAGLE (see :func:`eagle_remainder_waits`)."""
    size = state.size
    return stays_in_block(start, answer, size) and (
        answer >= size or bool(start % size) or not getattr(scheduler, "use_eagle", 0)
    )


def stays_in_block(start: int, tokens: int, size: int) -> bool:
    """Whether a chunk of ``tokens`` from ``start`` starts on a boundary or ends in its block:
    a whole chunk ``decide()`` leaves as it is (tested exhaustively), returned at once."""
    into_block = start % size
    return not into_block or into_block + tokens <= size


class SplitCall(NamedTuple):
    """One split call a rule may act on."""

    scheduler: Any
    request: Any
    asked: int  # num_new_tokens: the chunk vLLM's split was asked for
    answer: int  # what vLLM's split returned
    offset: int  # the computed tokens the trailing arguments add to the request's
    state: SplitState  # the scheduler's, settled at its first split
    args: Args  # the trailing arguments, forwarded as vLLM gave them
    kwargs: Kwargs = NO_KWARGS


class SplitRule:
    """What one split wrapper knows besides vLLM's split: its options, and its one failure
    report (then vLLM's answer stands)."""

    def __init__(self, original: Callable[..., int], options: WrapOptions) -> None:
        self.original = original
        self.options = options
        self.fall_back = failure_reporter("correction")
        self._settle_failed = failure_reporter("settling the split of a new scheduler")
        self.by_position = options.prefill_gate is PrefillGate.BEFORE_PREFILL_END
        # Only the block-unit rule's re-align applies to a request the split rule leaves.
        self.realign_others = options.block_rule and options.realign and options.realign_others
        # Whether the split rule acts on a request: it is on, and the request is in its scope
        # (the patch loaded the scope hooks).
        off = lambda request: False  # noqa: E731
        self.takes = _scope_test(options.scope) if options.deadlock_rules else off

    def settled(self, scheduler: Any) -> SplitState:
        """The state of a scheduler the wrapper meets unsettled."""
        try:
            state, unit = settle(scheduler, self.options)
            record.note_block_unit(type(scheduler), unit)
            return state
        except Exception as exc:
            self._settle_failed(exc, None)
            # Stand down, once.
            state = SplitState(0, quiet=True, whole_chunks_cross=False)
            installation.set_on(scheduler, SPLIT_ATTR, state)
            return state

    def look(self, call: SplitCall) -> int:
        """An answer a rule may act on: counted or corrected, else returned as it is."""
        answer = call.answer
        try:
            start, state = call.request.num_computed_tokens + call.offset, call.state
            if answer == call.asked and whole_chunk_stands(call.scheduler, start, answer, state):
                return answer
            if state.view is not None or state.starved:
                answer = self._block_unit(call, start)
            if answer == call.asked:
                if stays_in_block(start, answer, state.size):
                    if self.realign_others and eagle_remainder_waits(call, start):
                        rid = call.request.request_id
                        counters.record(Action.REALIGNED, rid, start, 0, state.size)
                        return 0
                    return answer
            elif not answer:
                if call.asked <= 0 or not self.takes(call.request):
                    return answer  # a 0 out of the split rule's reach: vLLM's (re-aligning never)
            elif stays_in_block(start, answer, state.size) and not self.takes(call.request):
                return answer  # a cut out of its reach that decide() keeps (no re-align)
            if can_need_correction(answer, call.asked, start, state.size):
                answer = self.correct(call._replace(answer=answer), start)
            request = call.request
            dropping = not answer and request.mm_features
            if dropping and split_reads.drop_waiting_references(call.scheduler, request):
                rid, dropped = request.request_id, Action.ENCODER_REFERENCES_DROPPED
                counters.record(dropped, rid, start, 0, state.size)
            return answer
        except Exception as exc:
            return self.fall_back(exc, answer)

    def _block_unit(self, call: SplitCall, start: int) -> int:
        """The block-unit rule on a call that reached the slow path: its stop where starved,
        and the count of a chunk the configured block would have ended elsewhere."""
        request, state, answer = call.request, call.state, call.answer
        if not self._in_prefill(request, start):
            return answer
        if state.starved:
            if call.asked >= state.size and state.view is not None:
                chunk = block_unit.asked_through(state.view, self.original, call.scheduler, call)
            else:
                chunk = block_unit.stop_at_cache_boundary(start, answer, state.size)
            changed = chunk != answer
        else:
            chunk = answer
            end = start + call.asked
            # A chunk that reaches the end of prefill, which no release floors.
            final = not in_prefill_by_position(end, request.num_prompt_tokens, request.num_tokens)
            absolute = self.options.absolute_end
            changed = configured_floor_differs(
                start, call.asked, chunk, state.configured, absolute, final
            )
        if changed and chunk > 0:
            counters.record(Action.BLOCK_ALIGNED, request.request_id, start, chunk, state.size)
        return chunk

    def correct(self, call: SplitCall, start: int) -> int:
        """The rare path: 0.28's answer where the encoder check cut the chunk (its wrapper
        noted it, :mod:`~vllm_mamba_fix.rules.encoder_cut`: the chunk ends at the cut, never
        floored to 0), the re-align. A token-budget cut stays stock's wait, as in 0.28, unless
        ``beyond_chunk`` (that 0 never clears on 0.15-0.26)."""
        request, asked, answer, state = call.request, call.asked, call.answer, call.state
        ruled_out = not self.takes(request)
        if ruled_out and (not self.realign_others or not answer):
            return answer  # re-aligning never touches a 0
        if not self._in_prefill(request, start):
            return answer
        uncut = None
        if not ruled_out and answer < asked:
            uncut = self._uncut_answer(call, start)
            # An encoder cut whose uncut chunk vLLM also floors to 0: 0.28 waits there too
            # (the budget is below a block). No encoder cut: a token-budget cut, stock's
            # wait as in 0.28, where only the re-align may still apply.
            wait = not uncut if uncut is not None else not answer or not self.realign_others
            if not state.beyond_chunk:
                if wait:
                    return answer
                ruled_out = ruled_out or uncut is None
        tail_frees = None
        if uncut is not None and uncut > answer > 0 and not (start + answer) % state.size:
            tail_frees = tail_frees_room_at(call.scheduler, request, start, asked, answer)
        decision = decide(answer, asked, start, state.size, uncut, tail_frees)
        return self._apply(call, start, decision, ruled_out)

    def _apply(self, call: SplitCall, start: int, decision: Decision, ruled_out: bool) -> int:
        """The decision's chunk where its rule acts on this request, counted; else vLLM's."""
        action = decision.action
        # No boundary is exempt, not even past vLLM's EAGLE-backed-off last_cache_position:
        # a block left mid-block is cached with the wrong state once crossed (#51113, 0.27+).
        if action is Action.UNCHANGED or (action is Action.REALIGNED and not self.options.realign):
            return call.answer
        if ruled_out and not (action is Action.REALIGNED and self.realign_others):
            return call.answer
        rid, size = call.request.request_id, call.state.size
        counters.record(action, rid, start, decision.num_tokens, size)
        return decision.num_tokens

    def _in_prefill(self, request: Any, start: int) -> bool:
        if self.by_position:
            return in_prefill_by_position(start, request.num_prompt_tokens, request.num_tokens)
        return in_prefill_by_output_tokens(request.num_output_tokens)

    def _uncut_answer(self, call: SplitCall, start: int) -> int | None:
        """Where the encoder check cut exactly this chunk: vLLM's split of the chunk the check
        was asked for (0.28's order: its look-ahead shift is in the cut already). Else None."""
        note = installation.memory[encoder_cut.EncoderNote].last  # encoder_cut.EncoderCut
        if note is None:
            return None
        scheduler, request, asked = call.scheduler, call.request, call.asked
        if note[:3] != (id(scheduler), id(request), start) or note[4] != asked:
            return None
        if note[3] <= asked:
            return None
        return self.original(scheduler, request, note[3], *call.args, **call.kwargs)


def tail_frees_room_at(scheduler: Any, request: Any, start: int, cut: int, answer: int) -> bool:
    """``decision.tail_frees_room`` with the scheduler's numbers (where the stop is in doubt)."""
    feats = list(getattr(request, "mm_features", None) or ())
    at = start + cut
    later = [i for i, f in enumerate(feats) if f.mm_position.offset >= at]
    manager = getattr(scheduler, "encoder_cache_manager", None)
    cached = getattr(manager, "cached", None)
    if not later or not isinstance(cached, dict):
        return True  # nothing to wait on the cache for: the encoder stop, as 0.28
    rid, size = request.request_id, request.get_num_encoder_embeds
    ends = [f.mm_position.offset + f.mm_position.length for f in feats]
    # Its own: inputs it references, and those the chunk covers (the split's to schedule).
    covered = {i for i, f in enumerate(feats) if f.mm_position.offset < at and ends[i] > start}
    own = [i for i, f in enumerate(feats) if i in covered or rid in cached.get(f.identifier, ())]
    own_ids = {feats[i].identifier for i in own}
    others = {h for h, refs in cached.items() if h not in own_ids and refs - {rid}}
    held = sum(size(i) for i in own)
    for other in scheduler.requests.values():
        for i, f in enumerate(other.mm_features or ()):
            if f.identifier in others:
                others.discard(f.identifier)
                held += other.get_num_encoder_embeds(i)
    in_tail = sum(size(i) for i in own if start + answer < ends[i] <= at)
    return tail_frees_room(size(later[0]), manager.cache_size - held, in_tail)


def eagle_remainder_waits(call: Any, start: int) -> bool:
    """Whether a token budget's sub-block remainder from the last cacheable boundary under
    EAGLE waits for a step that gives a block, as 0.28 floors it (0.15-0.26 only): those
    releases back that position off a block and leave a chunk from it unfloored ([96, 101) of
    a 153-token prompt in block 48), whose next chunk crosses 144 from mid-block (#51113).
    Only where a step can give a block and the token budget, not an input, cut the chunk."""
    request, size, answer = call.request, call.state.size, call.answer
    if answer >= size or start % size or getattr(call.scheduler, "use_eagle", False) is not True:
        return False
    tokens = request.num_tokens
    last = max(tokens - tokens % size - size, 0)
    prefill_end = max(request.num_prompt_tokens, tokens - 1)
    if start != last or start + size >= prefill_end:
        return False
    # An input at the chunk's end (or one look-ahead token past): an encoder cut, left as it is.
    end = start + answer
    if any(end <= f.mm_position.offset <= end + 1 for f in request.mm_features or ()):
        return False
    # A step can give a block (facts.blocks.longest_chunk's reads: one package file fewer).
    scheduler = call.scheduler
    budget = getattr(scheduler, "max_num_scheduled_tokens", None)
    threshold = getattr(
        getattr(scheduler, "scheduler_config", None), "long_prefill_token_threshold", 0
    )
    limits = [x for x in (budget, threshold) if isinstance(x, int) and x > 0]
    return bool(limits) and size <= min(limits)


def _scope_test(scope: Any) -> Callable[[Any], bool]:
    """``scope.in_scope(request)``, answered here where only the built-in rule runs."""
    try:
        builtin = builtin_scope(scope)
    except Exception:  # a scope of another kind: it answers for itself, per request
        builtin = None
    if builtin is Scope.MULTIMODAL:  # facts.config.builtin_in_scope, with no Python frame
        return operator.attrgetter("mm_features")  # a list: true where it holds an input
    if builtin is Scope.ALL:
        return lambda request: True
    return scope.in_scope
