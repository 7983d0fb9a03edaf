"""Which chunk the encoder-input check cut, told by its wrapper to the split rule.

Through 0.27.1 ``schedule()`` asks ``_try_schedule_encoder_inputs`` right before the split,
for every request with encoder inputs, in both of its loops: the check cuts the chunk before
the first input it cannot schedule (its own inputs, another request's, or the step's encoder
budget keep it out), and the split then floors that cut. Upstream 0.28 splits the uncut
chunk first and cuts second (vLLM #51603), so an encoder cut is never floored to 0 there.

The split alone cannot tell an encoder cut from a token-budget cut that happens to end
before an image; the encoder check can. Its wrapper notes, per scheduler, the request it
was asked about, where that request stood, how many tokens it was asked for and how many
it gave, in the session (:class:`EncoderNote`); the split wrapper reads it in place for
the same request at the same position. A note is overwritten by the next check, so it only
ever describes the chunk the split is asked about now; it holds ids, never the objects. No
vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_mamba_fix.changes import installation

# The last check's answer: (id() of the scheduler asked, id() of the request, the request's
# position when the check was asked, the tokens it was asked for (the chunk before any
# encoder cut), the tokens it gave). Ids, so that the note holds no reference; a plain
# tuple, since every call of the check writes one. vLLM asks the split right after the
# check, on the same thread; a note of another scheduler or request (interleaved threads)
# matches no split: stock's. The split rule reads it (split_rule.SplitRule).
EncoderCut = tuple[int, int, int, int, int]


@dataclass
class EncoderNote:
    """The session's memory: the last check's answer."""

    last: EncoderCut | None = None


def note(scheduler: Any, request: Any, computed: int, asked: int, given: int) -> None:
    """The encoder check of ``scheduler`` gave ``given`` of ``asked`` tokens at ``computed``."""
    installation.memory[EncoderNote].last = (id(scheduler), id(request), computed, asked, given)
