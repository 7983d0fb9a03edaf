"""The split rule answers as upstream 0.28 orders the split (issue 35 item 1).

Through 0.27.1 vLLM budgets encoder inputs before the split, so a chunk the encoder check cut
short is floored to 0. 0.28 splits first (vLLM #51603): an encoder cut is never floored to 0,
whatever keeps the next input out. Each workload here stalls stock on 0.15-0.27 and completes
on stock 0.28.0; the plugin must complete it, with no request ended, in every harness mode,
held to stock of the same release by ``_differential.check`` (no boundary violation, stock's
chunks wherever stock's are right). On 0.28+ the split rule is not installed and the
workloads check that the block-unit rule, engaged or idle, changes nothing stock completes.
"""

from __future__ import annotations

import pytest

from tests.properties import _differential
from tests.properties._differential import Workload, check
from tools.prop_adapters import PropRequest, PropScenario
from tools.sched_harness import Mode

diff_mode = _differential.diff_mode  # the fixture: every harness mode


def mutual_hold(requests: int) -> Workload:
    """Requests that each hold their first image while the encoder cache cannot take a
    second image of any of them: each request's own images fit, so nothing about one
    request alone proves the stall. Stock 0.23-0.27 stop every request at 384 of 832."""
    return Workload(
        PropScenario(
            block_size=64, budget=256, encoder_cache=1000, threshold=128,
            requests=tuple(
                PropRequest(f"r{i}", 832, ((10, 400), (412, 400)), content=f"r{i}", max_tokens=2)
                for i in range(requests)
            ),
        ),
        encoder_compute_tokens=1000,
    )  # fmt: skip


def image_on_a_boundary(configured_block: int | None) -> Workload:
    """Image 2 starts exactly on a block boundary (128, block 64) while image 1 is still
    held: under MTP vLLM cuts one token before it, [64, 127), which floors to 0, and image 1
    is never released. Without speculation the cut is [64, 128) and nothing stalls.
    With ``configured_block`` 32 stock completes (its floor reaches 96, past image 1)."""
    return Workload(
        PropScenario(
            block_size=64, budget=256, encoder_cache=100, threshold=0,
            requests=(PropRequest("img", 250, ((20, 64), (128, 64)), content="img",
                                  max_tokens=2),),
            configured_block_size=configured_block,
        ),
        encoder_compute_tokens=100,
    )  # fmt: skip


@pytest.mark.parametrize("requests", [2, 3])
def test_requests_holding_each_others_cache_space_complete(diff_mode: Mode, requests: int) -> None:
    figures = check(mutual_hold(requests), diff_mode)
    assert figures["plugin_ended"] == 0, figures


@pytest.mark.parametrize("configured", [None, 32], ids=["pinned", "configured-half"])
def test_an_image_on_a_block_boundary_completes_under_mtp(
    diff_mode: Mode, configured: int | None
) -> None:
    if not diff_mode.speculative:
        pytest.skip("without speculation vLLM cuts at the image itself: a boundary, no stall")
    figures = check(image_on_a_boundary(configured), diff_mode)
    assert figures["plugin_ended"] == 0, figures
