"""Which chunk the encoder-input check cut, told by its wrapper to the split rule.

Through 0.27.1 ``schedule()`` asks ``_try_schedule_encoder_inputs`` right before the split, which
then floors the cut chunk; 0.28 splits first (vLLM #51603). The split alone cannot tell an
encoder cut from a token-budget cut; the check's wrapper notes each cut in the session (and
forgets it at an answer it did not cut), and the split wrapper reads it for the same request at
the same position. No vLLM import.
"""

from __future__ import annotations

from typing import Any

from vllm_mamba_fix.changes import installation

# (id() of the scheduler, id() of the request, its position, the tokens asked (the chunk before
# any cut), the tokens given): ids, so the note holds no reference. vLLM asks the split right
# after the check on the same thread; a note of another scheduler or request matches no split.
EncoderCut = tuple[int, int, int, int, int]


class EncoderNote:
    """The session's memory: the last check's answer."""

    last: EncoderCut | None = None


def note(scheduler: Any, request: Any, computed: int, asked: int, given: int) -> None:
    """The encoder check of ``scheduler`` gave ``given`` of ``asked`` tokens at ``computed``."""
    installation.memory[EncoderNote].last = (id(scheduler), id(request), computed, asked, given)
