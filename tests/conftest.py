"""Fixtures shared by every test folder."""

from __future__ import annotations

import logging
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_mamba_fix._log import FIELD_PREFIX
from vllm_mamba_fix.changes import Changes, installation
from vllm_mamba_fix.hookspecs import ENTRY_POINT_GROUP

PLUGIN_LOGGER = "vllm.mamba_fix"


def facts_of(record: logging.LogRecord) -> dict[str, Any]:
    """The plugin's fields on ``record``, without the prefix."""
    return {
        name.removeprefix(FIELD_PREFIX): value
        for name, value in vars(record).items()
        if name.startswith(FIELD_PREFIX)
    }


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # A test that takes `sched_mode` runs once per harness mode ({sync, async} x
    # {no speculation, MTP K=2}; $VLLM_MAMBA_FIX_HARNESS_MODES narrows the set).
    if "sched_mode" in metafunc.fixturenames:
        from tools import sched_harness as harness  # only where the harness is used

        metafunc.parametrize("sched_mode", harness.selected_modes(), ids=str, indirect=True)


@pytest.fixture
def sched_mode(request: pytest.FixtureRequest) -> Any:
    """The harness mode of this test item; skipped where the release cannot build it."""
    from tools import sched_harness as harness

    reason = harness.mode_unsupported_reason(request.param)
    if reason:
        pytest.skip(f"{request.param}: {reason}")
    return request.param


@pytest.fixture
def plugin_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog wired straight to the plugin's logger.

    Once vLLM is imported its ``vllm`` logger stops propagating to the root,
    where caplog listens, so attach the handler to the plugin's logger itself.
    """
    logger = logging.getLogger(PLUGIN_LOGGER)
    previous_level, previous_propagate = logger.level, logger.propagate
    logger.propagate = False  # each record reaches caplog once, with or without vLLM
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.DEBUG)
    caplog.handler.setLevel(logging.DEBUG)
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(previous_level)
        logger.propagate = previous_propagate


InstallScopeRule = Callable[[str, str], None]


@pytest.fixture
def install_scope_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> InstallScopeRule:
    """Install a third-party scope rule as a real distribution with an entry point."""

    def install(name: str, body: str) -> None:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
        dist_info = tmp_path / f"{name}-1.0.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (dist_info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{name} = {name}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, name, raising=False)

    return install


@pytest.fixture
def session() -> Iterator[Changes]:
    """The plugin's session (its changes to vLLM and everything it remembers), fresh for the
    test and closed after it, as ``monkeypatch`` undoes its own."""
    installation.close()
    yield installation
    installation.close()


@pytest.fixture(scope="session", autouse=True)
def no_shutdown_summary_in_pytest() -> Iterator[None]:
    """pytest closes its capture streams before exit, where the summary line would go:
    closing the session cancels it. The summary itself is tested in a subprocess
    (tests/scheduler/test_observability.py)."""
    yield
    installation.close()
