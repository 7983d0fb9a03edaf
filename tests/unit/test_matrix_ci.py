"""CI's matrix subset (tools.matrix.CI_MODES): one release per family, modes that exist."""

from __future__ import annotations

from tools import releases
from tools.matrix import CI_MODES, default_releases
from tools.sched_harness import MODES_BY_NAME
from vllm_mamba_fix.versions import family_for


def test_one_release_per_family_and_every_family() -> None:
    families = [family_for(release).name for release in CI_MODES]
    assert len(families) == len(set(families)), families
    assert set(families) == {family_for(r).name for r in releases.ALL_RELEASES}


def test_ci_releases_are_published_and_modes_known() -> None:
    for release, modes in CI_MODES.items():
        assert release in releases.ALL_RELEASES
        names = list(MODES_BY_NAME) if modes == "all" else modes.split(",")
        assert names and all(name in MODES_BY_NAME for name in names), (release, modes)


def test_every_mode_on_the_last_affected_release_only() -> None:
    assert CI_MODES["0.27.1"] == "all"
    assert [r for r, modes in CI_MODES.items() if modes == "all"] == ["0.27.1"]


def test_exhaustive_run_covers_twenty_releases_and_every_ci_family() -> None:
    chosen = default_releases()
    assert len(chosen) == 20
    assert {family_for(r).name for r in chosen} == {family_for(r).name for r in CI_MODES}
