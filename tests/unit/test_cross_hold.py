"""The proof across requests (issue 35 item 3), as a pure function of plain numbers.

:func:`cross_hold_block` ends a named stall only as the one victim of a set of stalls that
wait on each other's encoder cache space. Checked against an independent definition (a
brute force over every set of stalls), and by playing its ends out.
"""

from __future__ import annotations

from itertools import combinations

from hypothesis import given
from hypothesis import strategies as st

from vllm_mamba_fix.decide.stalls import Hold, cross_hold_block

STALLED = ("a", "b", "c", "d")  # named stalls
MOVING = ("x", "y")  # requests that can still move (or wait for token budget)


def _room(rid: str, trap: frozenset[str], holds: list[Hold], free: int) -> int:
    return free + sum(size for size, holders in holds if rid not in holders and not holders & trap)


def _deadlocked(
    needs: dict[str, int], holds: list[Hold], free: int, ending: frozenset[str]
) -> frozenset[str]:
    """Every stall in some set none of whose members fits even if all outside it freed all
    they hold: the union of all such sets, found by trying every set."""
    candidates = sorted(set(needs) - ending)
    union: set[str] = set()
    for k in range(1, len(candidates) + 1):
        for trap in map(frozenset, combinations(candidates, k)):
            if all(needs[r] > _room(r, trap, holds, free) for r in trap):
                union |= trap
    return frozenset(union)


def _held(rid: str, holds: list[Hold], others: frozenset[str]) -> int:
    """What ``rid`` holds that none of ``others`` holds too."""
    return sum(size for size, holders in holds if rid in holders and not holders & others - {rid})


@st.composite
def states(draw: st.DrawFn) -> tuple[dict[str, int], list[Hold], int, frozenset[str]]:
    stalled = draw(st.lists(st.sampled_from(STALLED), unique=True, min_size=1))
    holders = st.frozensets(st.sampled_from(stalled + list(MOVING)), min_size=1, max_size=3)
    holds = draw(st.lists(st.tuples(st.integers(1, 500), holders), max_size=5))
    needs = {rid: draw(st.integers(0, 600)) for rid in stalled}
    ending = draw(st.frozensets(st.sampled_from(stalled), max_size=1))
    return needs, holds, draw(st.integers(0, 500)), ending


@given(state=states(), arrival=st.dictionaries(st.sampled_from(STALLED), st.floats(0, 10)))
def test_proven_exactly_for_the_victim_of_a_deadlock(
    state: tuple[dict[str, int], list[Hold], int, frozenset[str]], arrival: dict[str, float]
) -> None:
    needs, holds, free, ending = state
    deadlocked = _deadlocked(needs, holds, free, ending)
    proven = {rid for rid in needs if cross_hold_block(rid, needs, holds, free, ending, arrival)}
    assert len(proven) <= 1, proven  # one end at a time
    if not deadlocked:
        assert not proven
        return
    victim = max(
        deadlocked,
        key=lambda r: (_held(r, holds, deadlocked), _held(r, holds, frozenset()),
                       arrival.get(r, 0.0), r),
    )  # fmt: skip
    assert proven == ({victim} if _held(victim, holds, frozenset()) else set())
    # Never a request that fits what is free, nor one a moving request's space lets through.
    for rid in proven:
        assert needs[rid] > free and rid not in ending


@given(state=states())
def test_one_end_at_a_time_breaks_every_hold(
    state: tuple[dict[str, int], list[Hold], int, frozenset[str]],
) -> None:
    """Ending the victim, then the next, and so on, each freeing what it held: the stalls
    left can all get their space once the moving requests move on, and no more ends are
    made than stalls that hold space."""
    needs, holds, free, _ = state
    # A stall its own inputs keep (needs and holds more than the cache) is the other proof's.
    cache = free + sum(size for size, _ in holds)
    needs = {
        rid: n for rid, n in needs.items()
        if n + sum(size for size, h in holds if rid in h) <= cache
    }  # fmt: skip
    ended: list[str] = []
    while True:
        proven = [r for r in needs if r not in ended and cross_hold_block(r, needs, holds, free)]
        if not proven:
            break
        (victim,) = proven
        ended.append(victim)
        # vLLM's finish: its references go; an entry no one references is free.
        kept: list[Hold] = []
        for size, holders in holds:
            holders = holders - {victim}
            if holders:
                kept.append((size, holders))
            else:
                free += size
        holds = kept
        needs = {r: n for r, n in needs.items() if r != victim}
    assert not _deadlocked(needs, holds, free, frozenset()), (needs, holds, free, ended)


def test_the_mutual_hold() -> None:
    """Two requests hold 400 each of a 1,000-token cache and need 400 more: one is ended,
    the later to arrive; with it ordered to end, the other is not."""
    holds: list[Hold] = [(400, frozenset({"r0"})), (400, frozenset({"r1"}))]
    needs = {"r0": 400, "r1": 400}
    arrival = {"r0": 1.0, "r1": 2.0}
    assert cross_hold_block("r0", needs, holds, 200, arrival=arrival) is None
    proof = cross_hold_block("r1", needs, holds, 200, arrival=arrival)
    assert proof is not None and "deadlock across requests" in proof and "(r0)" in proof
    assert cross_hold_block("r0", needs, holds, 200, frozenset({"r1"}), arrival) is None
    # A third request that holds nothing waits behind them: never the one ended.
    needs3 = {**needs, "r2": 400}
    assert cross_hold_block("r2", needs3, holds, 200, arrival={**arrival, "r2": 3.0}) is None
    # One holder that can move (not a named stall): no deadlock, no end.
    assert cross_hold_block("r1", {"r1": 400}, holds, 200) is None
    # Waiting for token budget: it needs no new space.
    assert cross_hold_block("r1", {"r0": 400, "r1": 0}, holds, 200) is None
    # What is free already holds it.
    assert cross_hold_block("r1", needs, holds, 400, arrival=arrival) is None
