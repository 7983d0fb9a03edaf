from __future__ import annotations

import itertools
import logging

import pytest

from vllm_mamba_fix.config import Mode
from vllm_mamba_fix.plugin import policy
from vllm_mamba_fix.versions import FAMILIES, PrefillGate, Verdict, family_for, release_of


@pytest.mark.parametrize(
    ("version", "family"),
    [
        ("0.14.1", "<0.15"),
        ("0.15.0", "0.15"),
        ("0.16.0", "0.15"),
        ("0.17.0", "0.17"),
        ("0.23.0", "0.17"),
        ("0.24.0", "0.24"),
        ("0.25.1", "0.24"),
        ("0.26.0+cpu", "0.26"),
        ("0.27.1", "0.27"),
        ("0.27.2.dev12+g0123abc", "0.27"),
        ("0.28.0", "0.28+"),
        ("0.28.0rc1", "0.28+"),
        ("0.33.0", "0.28+"),
        ("0.15", "0.15"),
        ("dev", "unknown"),
        ("", "unknown"),
        ("garbage", "unknown"),
    ],
)
def test_family_for(version: str, family: str) -> None:
    assert family_for(version).name == family


def test_release_ignores_dev_and_local_parts() -> None:
    assert release_of("0.27.2.dev12+gabc") == (0, 27, 2)
    assert release_of("not a version") is None


def test_families_tile_the_version_line() -> None:
    for earlier, later in itertools.pairwise(FAMILIES):
        assert earlier.end == later.first
    assert FAMILIES[-1].end is None


def test_family_facts_match_the_release_notes() -> None:
    affected = [f.name for f in FAMILIES if f.verdict is Verdict.PATCH]
    assert affected == ["0.15", "0.17", "0.24", "0.26", "0.27"]
    assert [f.name for f in FAMILIES if f.stock_stays_misaligned] == ["0.15", "0.17", "0.24"]
    assert [f.name for f in FAMILIES if f.extra_parameter] == ["0.24"]
    assert family_for("0.16.0").prefill_gate is PrefillGate.NO_OUTPUT_TOKENS
    assert family_for("0.17.0").prefill_gate is PrefillGate.BEFORE_PREFILL_END


@pytest.mark.parametrize(
    ("mode", "version", "patches", "level", "says"),
    [
        (Mode.AUTO, "0.27.1", True, logging.DEBUG, "affected"),
        (Mode.AUTO, "0.15.0", True, logging.DEBUG, "affected"),
        (Mode.AUTO, "0.28.0", False, logging.INFO, "not needed"),
        (Mode.FORCE, "0.28.0", True, logging.INFO, "force"),
        (Mode.AUTO, "0.14.1", False, logging.INFO, "has no Scheduler"),
        (Mode.FORCE, "0.14.1", False, logging.INFO, "has no Scheduler"),
        (Mode.AUTO, "dev", False, logging.WARNING, "cannot read"),
        (Mode.FORCE, "dev", True, logging.INFO, "force"),
        (Mode.OFF, "0.27.1", False, logging.INFO, "disabled"),
    ],
)
def test_policy(mode: Mode, version: str, patches: bool, level: int, says: str) -> None:
    should_patch, log_level, reason = policy(mode, family_for(version), version)
    assert (should_patch, log_level) == (patches, level)
    assert says in reason
