"""A scheduler's own namespace is never the plugin's (issue 35 item 5).

A profiler, a test's monkeypatch or another plugin may bind its own
``_mamba_block_aligned_split`` on a scheduler instance. The plugin wraps class methods
only: that binding stays where it was put, and every split call vLLM makes reaches it,
in every harness mode.
"""

from __future__ import annotations

from typing import Any

from tools import sched_harness as harness
from tools.prop_adapters import PropRequest, PropScenario, add
from tools.sched_harness import Mode
from vllm_mamba_fix.facts.targets import SPLIT_METHOD

# Text and image requests whose images fit the encoder cache: the plugin changes no chunk,
# so stock and the plugin make the same split calls.
MIXED = PropScenario(
    block_size=64, budget=256, encoder_cache=4096, threshold=0,
    requests=(
        PropRequest("text-a", 400, content="text-a", max_tokens=2),
        PropRequest("image", 300, ((30, 100), (150, 100)), content="image", max_tokens=2),
        PropRequest("text-b", 200, content="text-b", max_tokens=2),
    ),
)  # fmt: skip


def _observed_calls(mode: Mode) -> tuple[int, bool]:
    """Drive MIXED with an observer bound on the scheduler; its call count, and whether
    it is still the scheduler's own attribute at the end."""
    h = harness.Harness(MIXED.config(mode))
    scheduler = h.scheduler
    calls = 0

    def observer(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> int:
        nonlocal calls
        calls += 1
        split = getattr(type(scheduler), SPLIT_METHOD)  # the class's, wrapped or not
        return int(split(scheduler, request, num_new_tokens, *args, **kwargs))

    vars(scheduler)[SPLIT_METHOD] = observer
    for request in MIXED.requests:
        add(h, request)
    for _ in range(200):
        if len(h.finished) == len(h.requests):
            break
        h.advance()
    assert len(h.finished) == len(h.requests), "the workload did not finish"
    return calls, vars(scheduler).get(SPLIT_METHOD) is observer


def test_an_observer_bound_on_the_scheduler_sees_every_split_call(sched_mode: Mode) -> None:
    stock_calls, _ = _observed_calls(sched_mode)
    harness.load_plugins()
    assert harness.split_is_wrapped()
    calls, still_bound = _observed_calls(sched_mode)
    assert still_bound, "the plugin replaced an attribute it did not set"
    assert stock_calls > 0 and calls == stock_calls, (calls, stock_calls)
