"""The split rule answers as upstream 0.28 orders the split (issue 35 item 1), under a block
mismatch too.

Through 0.27.1 vLLM budgets encoder inputs before the split, so a chunk the encoder check cut
short is floored to 0; 0.28 splits first (vLLM #51603). The mutual hold and the MTP cut on a
block boundary with the sizes agreeing are pinned in test_regressions.py. Here the same MTP cut
with ``cache_config.block_size`` half the cache's: stock completes it (its floor reaches past the
held image), the plugin before issue 35 hung it. Held by ``_differential.check`` to stock and to
upstream's fixed release, in every MTP mode.
"""

from __future__ import annotations

import pytest

from tests.properties import _differential
from tests.properties._differential import Workload, check
from tools.prop_adapters import PropRequest, PropScenario
from tools.sched_harness import Mode

diff_mode = _differential.diff_mode  # the fixture: every harness mode


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


def test_an_image_on_a_block_boundary_completes_under_mtp_with_half_the_block(
    diff_mode: Mode,
) -> None:
    if not diff_mode.speculative:
        pytest.skip("without speculation vLLM cuts at the image itself: a boundary, no stall")
    figures = check(image_on_a_boundary(32), diff_mode)
    assert figures["plugin_ended"] == 0, figures
