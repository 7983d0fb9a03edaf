"""The code-evidence parsers on synthetic sources (the release matrix checks real ones)."""

from __future__ import annotations

import pytest

from vllm_mamba_fix.facts.evidence import (
    deferred_encoder_free,
    read_evidence,
    split_after_encoder,
)

ENCODER_FIRST = """
    def schedule(self):
        for request in self.running:
            n = self._try_schedule_encoder_inputs(request, 0, 10, 5, shift_computed_tokens=1)[1]
            n = self._mamba_block_aligned_split(request, n)
"""
SPLIT_FIRST = """
    def schedule(self):
        for request in self.running:
            n = self._mamba_block_aligned_split(request, 10)
            # self._try_schedule_encoder_inputs( in a comment does not count
            n = self._try_schedule_encoder_inputs(request, 0, n, 5)[1]
"""
DEFERRED = """
def _free_encoder_inputs(self, request):
    spec_lookahead = 1 if self.use_eagle else 0
    for i in list(self.encoder_cache_manager.get_cached_input_ids(request)):
        if end + spec_lookahead <= request.num_computed_tokens:
            self.encoder_cache_manager.free_encoder_input(request, i)
"""
IMMEDIATE = """
def _free_encoder_inputs(self, request):
    # The drafter only reads ahead of num_computed_tokens (no lookahead delay).
    for i in list(self.encoder_cache_manager.get_cached_input_ids(request)):
        if end <= request.num_computed_tokens:
            self._free_encoder_input(request, i)
"""


@pytest.mark.parametrize(
    ("source", "expected"),
    [(ENCODER_FIRST, True), (SPLIT_FIRST, False), ("def schedule(self):\n    pass\n", None),
     ("not python (", None)],
)  # fmt: skip
def test_split_order(source: str, expected: bool | None) -> None:
    assert split_after_encoder(source) is expected


def test_deferred_free_reads_code_not_comments() -> None:
    assert deferred_encoder_free(DEFERRED) is True
    assert deferred_encoder_free(IMMEDIATE) is False
    assert deferred_encoder_free("") is None


def test_read_evidence_never_raises() -> None:
    class NoSource:
        schedule = print  # a builtin: inspect.getsource raises TypeError

    evidence = read_evidence(NoSource)
    assert evidence.split_after_encoder is None and evidence.problem

    class Broken(type):
        def __getattribute__(cls, name: str) -> object:
            raise RuntimeError("boom")

    assert read_evidence(Broken("X", (), {})).problem
