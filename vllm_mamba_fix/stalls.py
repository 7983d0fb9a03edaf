"""Zero-token streaks per request: when a 0 is a stall, and what the watchdog says.

A request that gets 0 tokens once may only be deferred for a step (a short
budget, another request's image in the cache). The same 0 at the same position
step after step is a stall. Both the rules and the watchdog ask this module.
No vLLM import: positions, sizes and times are plain numbers.
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

# Steps at the same position before the watchdog may name a stall.
WATCHDOG_MIN_STEPS = 3
# A 0 that repeats at the same position is one vLLM would return forever.
REPEATED = 2
_MAX_TRACKED_REQUESTS = 4096


@dataclass
class Streak:
    position: int
    steps: int
    since: float  # monotonic time of the first 0 at this position
    warned: bool = False


class ZeroStreaks:
    """Consecutive 0-token results per request, bounded in size.

    Every instance is known to :func:`forget_request`, which vLLM's freeing of a
    request calls, so no streak outlives its request.
    """

    def __init__(self, capacity: int = _MAX_TRACKED_REQUESTS) -> None:
        # Read-only outside this class; the hot path tests it directly (a
        # dict's truth and membership are C calls, a __bool__ is not).
        self.by_request: OrderedDict[str, Streak] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()
        _all_streaks.add(self)

    def zero(self, request_id: str, position: int, now: float) -> tuple[Streak, Streak | None]:
        """Count a 0 at ``position``; returns the streak and one it ended by moving."""
        with self._lock:
            streak = self.by_request.pop(request_id, None)
            moved = None
            if streak is None or streak.position != position:
                moved = streak
                streak = Streak(position, 0, now)
            streak.steps += 1
            self.by_request[request_id] = streak
            if len(self.by_request) > self._capacity:
                self.by_request.popitem(last=False)
            return streak, moved

    def clear(self, request_id: str) -> Streak | None:
        """The request got tokens: end its streak, returning it."""
        with self._lock:
            return self.by_request.pop(request_id, None)


_all_streaks: weakref.WeakSet[ZeroStreaks] = weakref.WeakSet()


def forget_request(request_id: str) -> None:
    """The request is finished or aborted: drop its streaks everywhere."""
    for streaks in list(_all_streaks):
        if streaks.by_request:
            streaks.clear(request_id)


def tracked_requests() -> set[str]:
    """Requests with a streak in any store (for tests and doctor)."""
    return {rid for streaks in list(_all_streaks) for rid in list(streaks.by_request)}


def watchdog_due(streak: Streak, now: float, seconds: float) -> bool:
    """Whether the watchdog names this streak now (once per stall)."""
    long_enough = now - streak.since >= seconds
    return not streak.warned and streak.steps >= WATCHDOG_MIN_STEPS and long_enough


class StallCause(enum.Enum):
    SPECULATIVE_LOOKAHEAD = "speculative-lookahead"
    INPUT_TOO_LARGE = "input-too-large"
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


@dataclass(frozen=True)
class StallReport:
    """The watchdog's facts about one stalled request."""

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

    def message(self) -> str:
        why, remedy = CAUSE_TEXT[self.cause]
        held = ", ".join(f"[{o}, {o + n})" for o, n in self.held) or "none"
        if self.waited is None:
            waited = "none found"
        else:
            offset, length, embeds = self.waited
            waited = f"[{offset}, {offset + length}) ({embeds} encoder tokens)"
        return (
            f"request {self.request_id} stalled at token {self.position} of "
            f"{self.prompt_tokens}: 0 tokens on {self.steps} consecutive steps over "
            f"{self.seconds:.0f} s; holds encoder inputs {held}; waits for {waited}; "
            f"encoder cache {self.cache_size} tokens ({self.cache_free} free), encoder budget "
            f"{self.compute_budget} per step; likely cause: {why}; remedy: {remedy}"
        )
