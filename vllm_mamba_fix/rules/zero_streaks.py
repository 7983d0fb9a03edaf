"""The stores of zero-token streaks (state, so not in ``decide/``): one per encoder-check
wrapper and one per scheduler the watchdog samples. The session knows every store, so
:func:`forget_request`, called when vLLM frees a request, leaves no streak behind."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.decide.stalls import Streak

MAX_TRACKED_REQUESTS = 4096


class ZeroStreaks:
    def __init__(self, capacity: int = MAX_TRACKED_REQUESTS) -> None:
        # Read-only outside this class; the hot path tests it directly (a dict's truth and
        # membership are C calls, a __bool__ is not).
        self.by_request: OrderedDict[str, Streak] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()
        installation.memory[Stores].add(self)

    def zero(
        self, request_id: str, position: int, now: float, steps: int = 1
    ) -> tuple[Streak, Streak | None]:
        """Count ``steps`` 0s at ``position``; returns the streak and one it ended by moving."""
        streak = self.by_request.get(request_id)
        if streak is not None and streak.position == position:
            # Another 0 where it stood (a request waiting for budget, every step): counted in
            # place; only the scheduler's thread counts a request's 0s.
            streak.steps += steps
            self.by_request.move_to_end(request_id)
            return streak, None
        with self._lock:
            old = self.by_request.pop(request_id, None)
            kept = old is not None and old.position == position  # another thread's 0 there
            streak, moved = (old, None) if kept else (Streak(position, 0, now), old)
            streak.steps += steps
            self.by_request[request_id] = streak
            if len(self.by_request) > self._capacity:
                self.by_request.popitem(last=False)
            return streak, moved

    def clear(self, request_id: str) -> Streak | None:
        with self._lock:
            return self.by_request.pop(request_id, None)


class Stores(weakref.WeakSet[ZeroStreaks]):
    """The session's memory of every store."""


def forget_request(request_id: str) -> None:
    # The weak set's own set of references: its iterator is Python code (a guard and a
    # generator), about 10 us of a freed request in a step that had evicted it.
    for ref in tuple(installation.memory[Stores].data):
        store = ref()
        if store is not None and request_id in store.by_request:
            store.clear(request_id)


def tracked_requests() -> set[str]:  # for tests and doctor
    stores = list(installation.memory[Stores])
    return {rid for store in stores for rid in list(store.by_request)}
