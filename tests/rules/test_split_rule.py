"""rules/split_rule.py: the split rule's corrector, per call, on plain numbers.

The split is a function of plain numbers with vLLM 0.26+'s shape (a chunk that is not the
prompt's last ends on a block boundary, a mid-block start stops at the next one), so each
case shows what the rule does with the answer vLLM would give. The rule on the real
Scheduler, stock against 0.28.0: tests/scheduler/ and tests/properties/test_regressions.py.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_mamba_fix.decide.decision import Action, decide
from vllm_mamba_fix.decide.scope import ScopePolicy
from vllm_mamba_fix.facts.blocks import SplitState
from vllm_mamba_fix.facts.config import Scope
from vllm_mamba_fix.facts.versions import PrefillGate
from vllm_mamba_fix.observe import counters
from vllm_mamba_fix.rules import encoder_cut
from vllm_mamba_fix.rules.split_rule import SplitCall, SplitRule, WrapOptions, stays_in_block

BLOCK = 256
PROMPT = 2000


def vllm_split(scheduler: Any, request: Any, num_new_tokens: int, *_: Any) -> int:
    """0.26+'s floor: the chunk's end to a boundary, and a mid-block start to the next one."""
    start = request.num_computed_tokens
    end = start + num_new_tokens
    if end >= request.num_prompt_tokens:
        return num_new_tokens
    if start % BLOCK:
        return min(num_new_tokens, BLOCK - start % BLOCK)
    return end // BLOCK * BLOCK - start


def request(rid: str = "r", at: int = 0, images: bool = True) -> Any:
    return SimpleNamespace(
        request_id=rid, num_computed_tokens=at, num_prompt_tokens=PROMPT, num_tokens=PROMPT,
        num_output_tokens=0, mm_features=[IMAGE] if images else [],
    )  # fmt: skip


# An input past every chunk here: a request holds it, and no encoder cache is there to wait on.
IMAGE = SimpleNamespace(identifier="image", mm_position=SimpleNamespace(offset=PROMPT, length=1))


pytestmark = pytest.mark.usefixtures("session")


def correct(req: Any, asked: int, beyond: bool = False, **options: Any) -> int:
    wrap = WrapOptions(PrefillGate.BEFORE_PREFILL_END, ScopePolicy(Scope.MULTIMODAL), **options)
    scheduler = object.__new__(type("Scheduler", (), {}))
    if "cut_from" in req.__dict__:  # the encoder check cut this chunk from a longer one
        encoder_cut.note(scheduler, req, req.num_computed_tokens, req.cut_from, asked)
    answer = vllm_split(scheduler, req, asked)
    state = SplitState(BLOCK, beyond_chunk=beyond)
    call = SplitCall(scheduler, req, asked, answer, 0, state, ())
    return SplitRule(vllm_split, wrap).correct(call, req.num_computed_tokens)


def test_an_encoder_cut_under_a_block_ends_at_the_cut_not_at_0() -> None:
    """The seed: the check cut [0, 300) to [0, 100) before an image it could not take; the
    floor makes 0, which stock returns forever. 0.28 splits [0, 300) first: 256, cut at 100."""
    req = request()
    req.cut_from = 300
    assert vllm_split(None, req, 100) == 0
    assert correct(req, 100) == 100
    assert counters.stats()["collapses_prevented"] == 1


def test_an_encoder_cut_past_a_boundary_ends_at_the_cut() -> None:
    req = request()
    req.cut_from = 900
    assert vllm_split(None, req, 600) == 512
    assert correct(req, 600) == 600  # 0.28: split [0, 900) = 768, then the cut at 600
    assert counters.stats()["chunks_stopped_at_encoder_input"] == 1


def test_a_cut_whose_uncut_chunk_is_below_a_block_waits_as_0_28_does() -> None:
    req = request()
    req.cut_from = 200  # the budget: 0.28's split of [0, 200) is 0 too
    assert correct(req, 100) == 0
    assert counters.stats()["collapses_prevented"] == 0


def test_a_token_budget_cut_stays_stocks_wait() -> None:
    assert correct(request(), 100) == 0  # no encoder cut noted: the budget's
    assert correct(request(at=256), 600) == 512  # a longer one: stock's chunk


def test_a_budget_cut_beyond_the_longest_chunk_progresses_to_the_boundary() -> None:
    """0.15-0.26 with a block no chunk reaches: that 0 never clears."""
    assert correct(request(at=100), 100, beyond=True) == 100
    assert correct(request(), 100, beyond=True) == 100


def test_a_note_of_another_request_or_position_is_no_cut() -> None:
    req = request()
    other = request("other")
    encoder_cut.note(object(), other, 0, 300, 100)
    assert correct(req, 100) == 0
    moved = request(at=10)
    moved.cut_from = 300
    assert correct(moved, 100) == 100  # its own note, at its own position


def test_a_text_request_is_out_of_the_multimodal_scope() -> None:
    req = request(images=False)
    req.cut_from = 300
    assert correct(req, 100) == 0


def test_a_mid_block_chunk_crossing_a_boundary_is_re_aligned() -> None:
    """0.15-0.25 floor the chunk's length, not its end: [100, 612) would cache block 1 with
    the state at 100. The rule stops it at 256."""

    def length_floor(scheduler: Any, req: Any, num_new_tokens: int, *_: Any) -> int:
        return num_new_tokens // BLOCK * BLOCK

    req = request(at=100)
    wrap = WrapOptions(PrefillGate.BEFORE_PREFILL_END, ScopePolicy(Scope.MULTIMODAL))
    answer = length_floor(None, req, 600)
    assert answer == 512
    call = SplitCall(None, req, 600, answer, 0, SplitState(BLOCK), ())
    assert SplitRule(length_floor, wrap).correct(call, 100) == 156
    assert counters.stats()["chunks_realigned"] == 1
    off = WrapOptions(PrefillGate.BEFORE_PREFILL_END, ScopePolicy(Scope.MULTIMODAL), realign=False)
    assert SplitRule(length_floor, off).correct(call, 100) == 512


def test_a_decode_is_never_corrected() -> None:
    req = request(at=PROMPT)
    req.cut_from = 10
    assert correct(req, 1) == 1
    assert counters.stats() == dict.fromkeys(counters.KEYS, 0)


def test_the_whole_chunk_fast_path_is_exactly_where_decide_changes_nothing() -> None:
    """``look`` returns a whole chunk first where ``stays_in_block``: exhaustively over
    small numbers, exactly where ``decide()`` leaves a whole chunk unchanged, whatever the
    encoder cut's uncut answer."""
    for size in range(1, 9):
        for start in range(3 * size):
            for asked in range(1, 3 * size + 1):
                fast = stays_in_block(start, asked, size)
                for uncut in (None, *range(3 * size + 2)):
                    action = decide(asked, asked, start, size, uncut).action
                    assert fast == (action is Action.UNCHANGED), (size, start, asked, uncut)


def test_a_cut_out_of_scope_returns_early_exactly_where_decide_keeps_it() -> None:
    """``look`` returns a cut answer (short of the chunk, not 0) of a request out of the split
    rule's scope at once where it ``stays_in_block``: exhaustively, exactly where ``decide()``
    leaves it unchanged (no encoder cut: such a request's uncut answer is never read); where
    it crosses a boundary from mid-block, the re-align still applies."""
    for size in range(1, 9):
        for start in range(3 * size):
            for asked in range(2, 3 * size + 2):
                for answer in range(1, asked):
                    action = decide(answer, asked, start, size).action
                    fast = stays_in_block(start, answer, size)
                    assert fast == (action is Action.UNCHANGED), (size, start, asked, answer)
                    assert fast or action is Action.REALIGNED


def test_a_cut_text_chunk_that_crosses_from_mid_block_is_still_realigned() -> None:
    """The early return keeps the re-align of a request out of the split rule's scope."""
    wrap = WrapOptions(PrefillGate.BEFORE_PREFILL_END, ScopePolicy(Scope.MULTIMODAL))
    rule, scheduler = SplitRule(vllm_split, wrap), object.__new__(type("Scheduler", (), {}))
    looked = []
    for at, answer in ((100, 300), (100, 156), (256, 200)):
        req = request(at=at, images=False)
        looked.append(rule.look(SplitCall(scheduler, req, 400, answer, 0, SplitState(BLOCK), ())))
    assert looked == [156, 156, 200]
    assert counters.stats()["chunks_realigned"] == 1


def test_a_0_out_of_scope_is_vllms_whatever_the_rules() -> None:
    """The wrapper returns a 0 of a request out of the split rule's scope at once: the
    corrector returns it too, encoder cut or not, block beyond the longest chunk or not."""
    zeros = 0
    for at in range(0, 600, 37):
        for asked in range(1, 600, 23):
            req = request(at=at, images=False)
            if vllm_split(None, req, asked):
                continue
            zeros += 1
            req.cut_from = asked + 300
            for beyond in (False, True):
                assert correct(req, asked, beyond=beyond) == 0, (at, asked, beyond)
    assert zeros > 10


def _holder(rid: str, status: str) -> Any:
    """A request with one image of 10 embeddings, hash "img", in the given status."""
    return SimpleNamespace(
        request_id=rid, status=SimpleNamespace(name=status), has_encoder_inputs=True,
        mm_features=[SimpleNamespace(identifier="img")], get_num_encoder_embeds=lambda i: 10,
    )  # fmt: skip


@pytest.mark.parametrize("status", ["WAITING", "PREEMPTED", "RUNNING"])
def test_a_waiting_zero_drops_the_references_its_check_took(status: str) -> None:
    """Issue 44 item 4 (`waiting_reference`): vLLM's encoder cache manager, a reference taken
    by the check of a request whose split answers 0; a waiting request lets it go (the
    input becomes freeable, as in 0.28, which takes none), a running one keeps it."""
    manager_type = pytest.importorskip("vllm.v1.core.encoder_cache_manager").EncoderCacheManager
    manager = manager_type(cache_size=20)
    owner, copy = _holder("owner", "RUNNING"), _holder("copy", status)
    assert manager.can_allocate(owner, 0, 20, 0)
    manager.allocate(owner, 0)
    manager.free_encoder_input(owner, 0)  # computed and consumed: cached, freeable
    assert manager.check_and_update_cache(copy, 0)  # the copy's check takes a reference
    scheduler = SimpleNamespace(encoder_cache_manager=manager)
    wrap = WrapOptions(PrefillGate.BEFORE_PREFILL_END, ScopePolicy(Scope.MULTIMODAL))
    rule = SplitRule(lambda *a: 0, wrap)
    state = SplitState(BLOCK, quiet=False)
    copy.num_computed_tokens, copy.num_prompt_tokens, copy.num_tokens = 0, PROMPT, PROMPT
    copy.num_output_tokens = 0
    assert rule.look(SplitCall(scheduler, copy, 100, 0, 0, state, ())) == 0
    held = "copy" in manager.cached["img"]
    assert held is (status == "RUNNING")
    assert manager.num_freeable_slots == (10 if status == "RUNNING" else 20)


def _imaged(rid: str, images: tuple[tuple[int, int], ...]) -> Any:
    """A waiting-for-its-chunk request with images (offset, length), hashed by rid and index,
    each of as many encoder embeddings as tokens."""
    feats = [
        SimpleNamespace(identifier=f"{rid}-{i}", mm_position=SimpleNamespace(offset=o, length=n))
        for i, (o, n) in enumerate(images)
    ]
    req = request(rid)
    req.mm_features, req.status = feats, SimpleNamespace(name="RUNNING")
    req.get_num_encoder_embeds = lambda i: images[i][1]
    return req


@pytest.mark.parametrize("other_holds", [True, False])
def test_a_whole_block_is_kept_where_the_tail_frees_nothing(other_holds: bool) -> None:
    """Issue 44 item 4 (`whole_block_tail`), vLLM's encoder cache manager: the check cut
    [0, 600) at an image at 600 (from 900); the split's whole-block answer is [0, 512).
    Where the image waits on another request's input (the tail, with no input of its own,
    frees nothing) the whole block is kept; where the request's own image in the tail
    holds the room, the chunk ends at the cut (the encoder stop, as 0.28)."""
    manager_type = pytest.importorskip("vllm.v1.core.encoder_cache_manager").EncoderCacheManager
    manager = manager_type(cache_size=300)
    req = _imaged("r", ((400, 150), (600, 200)) if not other_holds else ((600, 200),))
    other = _imaged("o", ((0, 200),))
    holder = other if other_holds else req
    assert manager.can_allocate(holder, 0, 1000, 0)
    manager.allocate(holder, 0)  # held: the other's image, or r's own at 400 (in the tail)
    req.cut_from = 900
    wrap = WrapOptions(PrefillGate.BEFORE_PREFILL_END, ScopePolicy(Scope.MULTIMODAL))
    scheduler = SimpleNamespace(encoder_cache_manager=manager, requests={"r": req, "o": other})
    encoder_cut.note(scheduler, req, 0, 900, 600)
    call = SplitCall(scheduler, req, 600, vllm_split(scheduler, req, 600), 0, SplitState(BLOCK), ())
    assert call.answer == 512
    assert SplitRule(vllm_split, wrap).correct(call, 0) == (512 if other_holds else 600)


def test_the_checks_wrapper_notes_a_cut_and_forgets_it_at_an_uncut_answer() -> None:
    """The split reads the note of the check vLLM asked right before it: a cut is noted for
    it, and an answer the check did not cut leaves none behind (a later split of the same
    request at the same position, asked that many tokens, is a token-budget cut)."""
    from vllm_mamba_fix.changes import installation
    from vllm_mamba_fix.rules.encoder_wrapper import EncoderOptions, make_encoder_wrapper

    given = {"tokens": 100}

    def check(self: Any, request: Any, computed: int, asked: int, budget: int, shift: int = 0):
        return [], min(asked, given["tokens"]), budget, None

    wrapper = make_encoder_wrapper(check, EncoderOptions(ScopePolicy(Scope.MULTIMODAL), False))
    scheduler, req = object(), request()
    note = installation.memory[encoder_cut.EncoderNote]
    assert wrapper(scheduler, req, 0, 300, 10)[1] == 100
    assert note.last == (id(scheduler), id(req), 0, 300, 100)
    assert wrapper(scheduler, req, 0, 100, 10)[1] == 100  # uncut: the note goes
    assert note.last is None
    given["tokens"] = 0
    assert wrapper(scheduler, req, 0, 300, 10)[1] == 0  # a 0 is a cut too
    assert note.last == (id(scheduler), id(req), 0, 300, 0)


@pytest.mark.parametrize("trailing", [2, 3])
def test_the_wrapper_forwards_every_trailing_argument(trailing: int) -> None:
    """0.24-0.25's split takes a third trailing argument (the wrapper for any signature); the
    others two (the positional one). Each passes vLLM's arguments through as given, defaults
    included."""
    from vllm_mamba_fix.rules.split_rule import make_wrapper

    seen: list[tuple[int, ...]] = []

    def two(self: Any, request: Any, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
            num_external_computed_tokens: int = 0) -> int:  # fmt: skip
        seen.append((num_new_local_computed_tokens, num_external_computed_tokens))
        return num_new_tokens

    def three(self: Any, request: Any, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
              num_external_computed_tokens: int = 0,
              num_uncached_common_prefix_tokens: int = 0) -> int:  # fmt: skip
        seen.append((num_new_local_computed_tokens, num_external_computed_tokens,
                     num_uncached_common_prefix_tokens))  # fmt: skip
        return num_new_tokens

    wrap = WrapOptions(PrefillGate.BEFORE_PREFILL_END, ScopePolicy(Scope.MULTIMODAL))
    wrapper = make_wrapper(two if trailing == 2 else three, wrap)
    state = SplitState(BLOCK, quiet=True, whole_chunks_cross=False)  # settled: no rule acts
    scheduler = object.__new__(type("Scheduler", (), {"_vllm_mamba_fix_split": state}))
    given = tuple(range(5, 5 + trailing))
    assert wrapper(scheduler, request(at=PROMPT), 1, *given) == 1
    assert wrapper(scheduler, request(at=PROMPT), 1) == 1
    assert seen == [given, (0,) * trailing]
    with pytest.raises(TypeError):
        wrapper(scheduler, request(at=PROMPT), 1, *range(trailing + 1))


@pytest.mark.parametrize("starved", [False, True])
@pytest.mark.parametrize("others", [False, True])
@pytest.mark.parametrize("deadlock_rules", [False, True])
def test_the_known_wrappers_early_returns_are_exactly_where_look_keeps_vllms_answer(
    starved: bool, others: bool, deadlock_rules: bool
) -> None:
    """The wrapper returns a chunk out of the split rule's reach without ``look`` where the
    settled state says no rule acts on it (``others_stand``): over requests with and without
    inputs, starts on, before and past a boundary, and chunks under, at and past a block, its
    answer is ``look``'s (the early returns only skip work)."""
    from vllm_mamba_fix.rules.split_rule import make_wrapper

    def known(self: Any, request: Any, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
              num_external_computed_tokens: int = 0) -> int:  # fmt: skip
        return vllm_split(self, request, num_new_tokens)

    options = WrapOptions(
        PrefillGate.BEFORE_PREFILL_END, ScopePolicy(Scope.MULTIMODAL),
        deadlock_rules=deadlock_rules, realign_others=others,
    )  # fmt: skip
    rule = SplitRule(known, options)
    stand = not starved and not rule.realign_others  # as split_settle.settle sets it
    state = SplitState(BLOCK, starved=starved, others_stand=stand)
    scheduler = object.__new__(type("Scheduler", (), {"_vllm_mamba_fix_split": state}))
    wrapper = make_wrapper(known, options)
    for images, start, asked in itertools.product(
        (True, False), (0, 1, 100, BLOCK - 1, BLOCK, BLOCK + 1, 700), (1, 100, BLOCK - 1, BLOCK,
        BLOCK + 1, 600)
    ):  # fmt: skip
        req = request(at=start, images=images)
        answer = vllm_split(scheduler, req, asked)
        looked = rule.look(SplitCall(scheduler, req, asked, answer, 0, state, (0, 0)))
        assert wrapper(scheduler, req, asked) == looked, (images, start, asked, answer)
