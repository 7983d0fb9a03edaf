"""Zero-token streaks per request: when a 0 at the same position step after step is a stall,
and what the watchdog says. Plain numbers only: the stores are ``rules/zero_streaks.py`` and
the clock is the caller's."""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

WATCHDOG_MIN_STEPS = 3  # steps at one position before the watchdog may name a stall
REPEATED = 2  # a 0 that repeats at one position is one vLLM would return forever


class Streak:
    """A request's run of 0s at one position; the watchdog sets the rest as it learns. A plain
    class: a dataclass writes its methods from source as its module loads (start-up)."""

    warned = False  # named by the watchdog
    named_at: float | None = None
    steps_named = 0  # 0s seen after the naming
    cause: StallCause | None = None
    ordered = False  # its request is to be ended (stall_end)
    unproven_until = float("-inf")  # its own inputs fit: look again from then
    window_end: int | None = None  # end of the smallest chunk it waits for (once named)

    def __init__(self, position: int, steps: int, since: float) -> None:
        self.position = position
        self.steps = steps
        self.since = since  # monotonic time of the first 0 at this position


def watchdog_due(streak: Streak, now: float, seconds: float) -> bool:
    long_enough = now - streak.since >= seconds
    return not streak.warned and streak.steps >= WATCHDOG_MIN_STEPS and long_enough


def end_due(streak: Streak, now: float, end_after: float) -> bool:
    if streak.named_at is None or streak.ordered:
        return False
    return streak.steps_named >= REPEATED and now - streak.named_at >= end_after


def own_inputs_block(
    held: Mapping[Hashable, int],
    needed: Mapping[Hashable, int],
    cache_size: int,
    encoder_budget: int | None,
) -> str | None:
    """Why the request's own encoder inputs keep it at its position whatever others do, or None
    (``held``: it frees none while it gets 0; ``encoder_budget`` None: an EC connector)."""
    needed = {key: n for key, n in needed.items() if key not in held}
    largest = max(needed.values(), default=0)
    if largest > cache_size or (encoder_budget is not None and largest > encoder_budget):
        shown = "" if encoder_budget is None else f", per-step encoder budget {encoder_budget}"
        return (
            f"an encoder input it needs next has {largest} tokens (encoder cache "
            f"{cache_size}{shown})"
        )
    due = sum(needed.values())
    if encoder_budget is not None and due > encoder_budget:
        return (
            f"the encoder inputs it needs next have {due} tokens together, more than one "
            f"step's encoder budget of {encoder_budget}"
        )
    total = due + sum(held.values())
    if total > cache_size:
        return (
            f"the encoder inputs it holds and needs next take {total} cache tokens together, "
            f"more than the encoder cache's {cache_size}"
        )
    return None


# One encoder cache entry requests reference: (encoder tokens, ids of the requests holding it).
Hold = tuple[int, frozenset[str]]


def _blocked(
    needs: Mapping[str, int], holds: Sequence[Hold], free: int, ending: frozenset[str]
) -> frozenset[str]:
    """The largest set of stalled requests none of which gets its space even if every request
    outside it (and every one ordered to end) freed all it holds."""
    blocked = {rid for rid in needs if rid not in ending}
    changed = True
    while changed:
        changed = False
        for rid in sorted(blocked):
            room = sum(n for n, holders in holds if rid not in holders and not holders & blocked)
            if needs[rid] <= free + room:
                blocked.discard(rid)
                changed = True
    return frozenset(blocked)


def cross_hold_block(
    subject: str,
    needs: Mapping[str, int],
    holds: Sequence[Hold],
    free: int,
    ending: frozenset[str] = frozenset(),
    arrival: Mapping[str, float] | None = None,
) -> str | None:
    """Why ``subject`` must be ended to break a hold across requests, or None. ``needs``: per
    named stall, the encoder tokens it must newly place (a request not in it frees all it
    holds); ``free``: tokens free or held by no request; ``ending``: ordered to end (counted
    free). Proven only in a deadlock, and only as its one victim: the most space freed, then
    held, then the latest arrival, then the largest id; never one holding nothing."""
    blocked = _blocked(needs, holds, free, ending)
    if subject not in blocked:
        return None

    def held(rid: str, only: bool) -> int:
        """What it holds; ``only``: what its end lets requests that can move free too."""
        return sum(
            size for size, holders in holds
            if rid in holders and not (only and (holders - {rid}) & blocked)
        )  # fmt: skip

    when = arrival or {}
    victim = max(blocked, key=lambda r: (held(r, True), held(r, False), when.get(r, 0.0), r))
    if victim != subject or not held(subject, False):
        return None
    holding = sorted(rid for rid in blocked - {subject} if any(rid in h for _, h in holds))
    named = ", ".join(holding[:3]) + (f" and {len(holding) - 3} more" if len(holding) > 3 else "")
    return (
        f"it needs {needs[subject]} more encoder cache tokens and {free} are free; the "
        f"requests that hold the rest ({named or 'none'}) are stalled too, each waiting for "
        f"space the others hold: a deadlock across requests, which its end breaks (it "
        f"holds {held(subject, False)})"
    )


class StallCause(enum.Enum):
    SPECULATIVE_LOOKAHEAD = "speculative-lookahead"
    INPUT_TOO_LARGE = "input-too-large"
    SPLIT_FLOOR = "split-floor"
    SHARED_CACHE = "shared-cache"
    UNKNOWN = "unknown"


CAUSE_TEXT = {
    StallCause.SPECULATIVE_LOOKAHEAD: (
        "EAGLE-type speculative decoding: vLLM cuts the chunk before the next encoder input "
        "by the drafter's look-ahead and frees held inputs only past it, so the inputs due next "
        "do not fit the encoder cache together, on a release where the plugin cannot end that "
        "safely",
        "upgrade to vLLM 0.33+, or put two or more tokens between images",
    ),
    StallCause.INPUT_TOO_LARGE: (
        "the encoder input it waits for is larger than the encoder cache or the per-step "
        "encoder budget",
        "raise --max-num-batched-tokens (the encoder cache is sized from it) or send smaller "
        "inputs",
    ),
    StallCause.SPLIT_FLOOR: (
        "vLLM's block-aligned split floors the chunk cut before an encoder input that does "
        "not fit to 0 tokens, and the plugin does not correct that split (its split rule is "
        "off, or a platform scheduler overrides the split)",
        "turn the split rule on (unset VLLM_MAMBA_FIX_SPLIT_RULE), upgrade to vLLM 0.28+, or "
        "raise --max-num-batched-tokens",
    ),
    StallCause.SHARED_CACHE: (
        "the encoder input it needs next fits the encoder cache, but other requests' inputs "
        "hold the space it needs",
        "none if those requests move on; raise --max-num-batched-tokens (the encoder cache is "
        "sized from it) if this lasts",
    ),
    StallCause.UNKNOWN: (
        "unknown",
        "raise --max-num-batched-tokens, or upgrade to vLLM 0.33+; please report this line",
    ),
}


def stall_cause(
    speculative_state: bool, waited_embeds: int | None, cache_size: int, compute_budget: int
) -> StallCause:
    if waited_embeds is not None and waited_embeds > min(cache_size, compute_budget):
        return StallCause.INPUT_TOO_LARGE
    if speculative_state:
        return StallCause.SPECULATIVE_LOOKAHEAD
    return StallCause.UNKNOWN


class StallReport(NamedTuple):
    request_id: str
    position: int
    prompt_tokens: int
    steps: int
    seconds: float
    held: tuple[tuple[int, int], ...]  # (offset, length) of inputs it holds in the cache
    waited: tuple[int, int, int] | None  # (offset, length, embeds) of the input it waits for
    cache_size: int
    cache_free: int
    compute_budget: int
    cause: StallCause
    end_note: str = ""  # what the plugin does about it (stall_end)

    def message(self) -> str:
        why, remedy = CAUSE_TEXT[self.cause]
        held = ", ".join(f"[{o}, {o + n})" for o, n in self.held) or "none"
        waited = "none found"
        if self.waited is not None:
            offset, length, embeds = self.waited
            waited = f"[{offset}, {offset + length}) ({embeds} encoder tokens)"
        return (
            f"request {self.request_id} stalled at token {self.position} of "
            f"{self.prompt_tokens}: 0 tokens on {self.steps} consecutive steps over "
            f"{self.seconds:.0f} s; holds encoder inputs {held}; waits for {waited}; "
            f"encoder cache {self.cache_size} tokens ({self.cache_free} free), encoder budget "
            f"{self.compute_budget} per step; likely cause: {why}; remedy: {remedy}"
            f"{self.end_note}"
        )
