# Rule:     split (Rule.SPLIT in rules/table.py; off with VLLM_MAMBA_FIX_SPLIT_RULE=0)
# Answers:  the split deadlock of hybrid Mamba models with prefix caching: through 0.27.1
#           schedule() budgets encoder inputs before _mamba_block_aligned_split, which floors
#           a chunk cut short before an image to 0 tokens on every step. Upstream fixed the
#           order in vLLM #51603 ("Apply Mamba alignment before encoder caps", 0.28.0).
# Runs on:  0.15.0-0.27.1; on 0.28+ only under a scheduler whose own schedule() keeps the old
#           order (a platform's, or a build without #51603). Carried by the split method's
#           wrapper (rules/wrappers.py); the encoder check's wrapper tells it which chunks that
#           check cut (rules/encoder_cut.py). Answers to upstream 0.28.0: what 0.28 completes,
#           the rule completes, with 0.28's chunks.
# Decided:  by the scheduler class's own code (facts/evidence.py: split after encoder
#           budgeting), by the version where the code cannot tell (decide/policy.py:
#           split_verdict); VLLM_MAMBA_FIX=force installs it on any release.
# Removed:  once the oldest supported release has #51603 and no supported scheduler budgets
#           encoder inputs before the split.
"""The split rule's corrector: what the split wrapper does with an answer a rule acts on.

:func:`make_corrector` builds the rare path of :mod:`vllm_mamba_fix.rules.wrappers`: it asks
:func:`vllm_mamba_fix.decide.decision.decide` with the request's numbers, the scope hook, and
counts and logs a correction. No vLLM import; the scheduler and request are vLLM's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_mamba_fix.decide.decision import (
    Action,
    Decision,
    decide,
    in_prefill_by_output_tokens,
    in_prefill_by_position,
)
from vllm_mamba_fix.decide.scope import ScopePolicy
from vllm_mamba_fix.facts.blocks import SplitState
from vllm_mamba_fix.facts.targets import (
    EXTRA_COMPUTED_PARAMETERS,
    KNOWN_SPLIT_TRAILING_PARAMETERS,
    SPLIT_LEADING_PARAMETERS,
    Args,
    Kwargs,
)
from vllm_mamba_fix.facts.versions import PrefillGate
from vllm_mamba_fix.observe import counters
from vllm_mamba_fix.rules import encoder_cut


@dataclass(frozen=True)
class WrapOptions:
    """Options of the split wrapper: which of its rules it carries."""

    prefill_gate: PrefillGate
    scope: ScopePolicy
    # The split rule: collapse, re-align and encoder stop for in-scope requests.
    deadlock_rules: bool = True
    # The block-unit rule: vLLM's split asked in the cache's block where the sizes
    # differ, and (where ``realign``) any request that starts mid-block re-aligned.
    block_rule: bool = True
    # Re-align a chunk of the split rule's own requests that starts mid-block and would
    # cross the next boundary (tests switch it off to show what it prevents).
    realign: bool = True
    # The block-unit rule re-aligns every other request too: only where the release's
    # split does not stop every mid-block chunk at the next boundary itself (0.15-0.26).
    realign_others: bool = True
    # The release's split floors the chunk's end (0.26+), not its length: how the
    # block-unit rule's count tells a chunk it changed.
    absolute_end: bool = False
    # The release's split advances sub-block through a block wider than its longest chunk
    # (0.27+); before, the block-unit rule schedules the configured answer there.
    advances_sub_block: bool = True


# The fast split wrapper's default for a trailing argument its caller left out: methods with
# exactly the known trailing parameters get a wrapper with no *args/**kwargs forwarding
# (that alone costs about 0.6 us a call).
NOT_GIVEN: Any = object()


def extra_computed_tokens(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    extra = sum(args[: len(EXTRA_COMPUTED_PARAMETERS)])
    for name in EXTRA_COMPUTED_PARAMETERS[len(args) :]:
        extra += kwargs.get(name, 0)
    return extra


def has_known_parameters(method: Callable[..., int]) -> bool:
    parameters = list(inspect.signature(method).parameters.values())[
        len(SPLIT_LEADING_PARAMETERS) :
    ]
    names = tuple(p.name for p in parameters)
    known = KNOWN_SPLIT_TRAILING_PARAMETERS
    return names in (known[:2], known) and all(
        p.kind is p.POSITIONAL_OR_KEYWORD and p.default == 0 for p in parameters
    )


Corrector = Callable[[Any, Any, int, int, int, SplitState, Args, Kwargs], int]


def make_corrector(original: Callable[..., int], options: WrapOptions) -> Corrector:
    """The rare path: decide, ask the scope hook, count and log.

    The split rule answers as upstream 0.28 orders the split: where the encoder-input check
    cut the chunk (its wrapper says so, :mod:`vllm_mamba_fix.rules.encoder_cut`), vLLM's
    split is asked for the chunk before the cut, and the answer ends at the cut; whatever
    kept the input out (the request's own inputs, another request's, the encoder budget),
    the cut is never floored to 0. A chunk the token budget cut stays stock's wait, as in
    0.28, unless the block is beyond the longest chunk vLLM's split is ever asked for
    (``beyond_chunk``: that 0 never clears on 0.15-0.26).
    """
    by_position = options.prefill_gate is PrefillGate.BEFORE_PREFILL_END
    scope = options.scope
    deadlock_rules = options.deadlock_rules
    # Only the block-unit rule's re-align applies to a request the split rule leaves.
    realign_others = options.block_rule and options.realign and options.realign_others

    def correct(self: Any, request: Any, asked: int, answer: int, start: int, state: SplitState,
                args: Args, kwargs: Kwargs) -> int:  # fmt: skip
        ruled_out = not deadlock_rules or scope.rules_out(request)
        if ruled_out and (not realign_others or not answer):
            return answer  # re-aligning never touches a 0
        if not _in_prefill(by_position, request, start):
            return answer
        uncut = None
        if not ruled_out and answer < asked:
            uncut = _uncut_answer(original, self, request, start, asked, args, kwargs)
            # An encoder cut whose uncut chunk vLLM also floors to 0: 0.28 waits there too
            # (the budget is below a block). No encoder cut: a token-budget cut, stock's
            # wait as in 0.28, where only the re-align may still apply.
            wait = not uncut if uncut is not None else not answer or not realign_others
            if not state.beyond_chunk:
                if wait:
                    return answer
                ruled_out = ruled_out or uncut is None
        decision = decide(answer, asked, start, state.size, True, uncut)
        return _apply(options, realign_others, request, answer, start, state.size, decision,
                      ruled_out)  # fmt: skip

    return correct


def _apply(options: WrapOptions, realign_others: bool, request: Any, answer: int, start: int,
           size: int, decision: Decision, ruled_out: bool) -> int:  # fmt: skip
    """The decision's chunk where its rule acts on this request, counted; else vLLM's."""
    action = decision.action
    # No boundary is exempt, not even past vLLM's EAGLE-backed-off last_cache_position:
    # the block a mid-block start leaves behind holds the state at ``start`` and is
    # cached as the state at the boundary once a chunk crosses it (vLLM #51113, 0.27+).
    if action is Action.UNCHANGED or (action is Action.REALIGNED and not options.realign):
        return answer
    acts = not ruled_out and options.scope.in_scope(request)
    if not acts and not (action is Action.REALIGNED and realign_others):
        return answer
    counters.record(action, request.request_id, start, decision.num_tokens, size)
    return decision.num_tokens


def _in_prefill(by_position: bool, request: Any, start: int) -> bool:
    if by_position:
        return in_prefill_by_position(start, request.num_prompt_tokens, request.num_tokens)
    return in_prefill_by_output_tokens(request.num_output_tokens)


def _uncut_answer(split: Callable[..., int], scheduler: Any, request: Any, start: int,
                  asked: int, args: Args, kwargs: Kwargs) -> int | None:  # fmt: skip
    """Where the encoder check cut exactly this chunk: vLLM's split of the chunk the check was
    asked for (0.28's order: its look-ahead shift is in the cut already). Else None."""
    cut = encoder_cut.uncut_tokens(scheduler, request, start, asked)
    if cut is None:
        return None
    return split(scheduler, request, cut, *args, **kwargs)
