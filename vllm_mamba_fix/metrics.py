"""The plugin's counters at ``vllm serve``'s own ``/metrics``, as ``vllm_mamba_fix_*`` counters.

The counts are made in the engine core; ``/metrics`` is served by the API server, another
process. vLLM carries no figure of a plugin between them (``SchedulerStats`` has fixed fields),
so the counts travel the way vLLM's own API servers share theirs: prometheus_client's
multiprocess files. Every release 0.15-0.33 serves ``/metrics`` from
``vllm.v1.metrics.prometheus.get_prometheus_registry()``:

- ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM sets it for ``--api-server-count`` > 1, which is the
  default under data parallelism; or the user did): a ``MultiProcessCollector`` over that
  directory. The engine core writes its file there.
- unset (one API server, the default): the global ``REGISTRY`` of the API server process.
  :func:`attach`, run by ``register()`` in a process that multiprocessing did not start (the
  API server; never an engine core or a worker), makes a private directory, adds a
  ``MultiProcessCollector`` over it to ``REGISTRY`` and hands the directory to the engine
  cores it starts through :data:`ENV_DIR`.

The engine core's file is ``counter_vllm-mamba-fix-<pid>.db``: prometheus_client's own format
(``MmapedDict``), under a name of its own so it never shares a file with a metric
prometheus_client may keep in the same process. No server, no port. prometheus_client comes
with vLLM but is imported lazily: without it nothing is counted here and one line says so.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

from vllm_mamba_fix._log import logger

PROMETHEUS_DIR = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's and vLLM's variable
# The private directory the API server hands to the engine cores it starts. Not ``VLLM_*``:
# vLLM warns about (or, with --fail-on-environ-validation, rejects) unknown VLLM_ variables.
ENV_DIR = "_VLLM_MAMBA_FIX_METRICS_DIR"
FILE_PREFIX = "counter_vllm-mamba-fix-"  # "counter_": the type MultiProcessCollector reads


@dataclass(frozen=True)
class Series:
    metric: str  # without "_total", as prometheus_client keys a counter
    help: str
    labels: tuple[tuple[str, str], ...] = ()

    @property
    def sample(self) -> str:
        return self.metric + "_total"


_CORRECTIONS = "vllm_mamba_fix_corrections"
_CORRECTIONS_HELP = (
    "Scheduler chunks vllm-mamba-fix corrected, by rule and action (engine core, summed)"
)


def _correction(rule: str, action: str) -> Series:
    return Series(_CORRECTIONS, _CORRECTIONS_HELP, (("action", action), ("rule", rule)))


# Per stats() key (counters.KEYS), its series.
SERIES: dict[str, Series] = {
    "collapses_prevented": _correction("split", "collapse-prevented"),
    # Also the block-unit rule's boundary stop: one action, one series.
    "chunks_realigned": _correction("split", "realigned"),
    "chunks_stopped_at_encoder_input": _correction("split", "stopped-at-encoder-input"),
    "speculative_stalls_released": _correction("speculative-stall", "released"),
    "block_rule_chunks": Series(
        "vllm_mamba_fix_block_rule_chunks",
        "Chunks the block-unit rule ended at the Mamba cache's block (vLLM #54076)",
    ),
    "stalls_detected": Series(
        "vllm_mamba_fix_stalls_named", "Stalled prefills the stall watchdog named"
    ),
    "stalls_resolved": Series(
        "vllm_mamba_fix_stalls_moved_again", "Named stalls whose request moved again"
    ),
    "stalls_ended": Series(
        "vllm_mamba_fix_stalls_ended", "Named stalls the plugin ended, finishing the request"
    ),
}


class Support(NamedTuple):
    available: bool
    reason: str


class _Writer:
    """This process's counter file; callers hold ``_lock`` (MmapedDict is not thread-safe)."""

    def __init__(self, mmap_dict: Any, directory: str) -> None:
        self.pid = os.getpid()
        self.directory = directory
        self._file = mmap_dict.MmapedDict(os.path.join(directory, f"{FILE_PREFIX}{self.pid}.db"))
        self._key = mmap_dict.mmap_key

    def add(self, series: Series, amount: float) -> None:
        names = [name for name, _ in series.labels]
        values = [value for _, value in series.labels]
        key = self._key(series.metric, series.sample, names, values, series.help)
        # Read back, not cached: a file left by an earlier run under the same pid (a
        # PROMETHEUS_MULTIPROC_DIR nobody wiped) keeps counting up, as prometheus_client does.
        stored = self._file.read_value(key)
        value = (stored[0] if isinstance(stored, tuple) else stored) + amount
        try:
            self._file.write_value(key, value, 0.0)
        except TypeError:  # prometheus_client before timestamps: (key, value)
            self._file.write_value(key, value)


_lock = threading.Lock()
_writer: _Writer | None = None
_said: set[str] = set()
_attached: str | None = None  # the private directory this process serves
_off_pid: int | None = None  # the process where opening the writer failed


def _say_once(level: str, message: str, *args: Any) -> None:
    if message not in _said:
        _said.add(message)
        getattr(logger, level)("vllm-mamba-fix: " + message, *args)


def _import_prometheus() -> tuple[ModuleType, ModuleType, ModuleType] | Exception:
    try:
        import prometheus_client
        from prometheus_client import mmap_dict, multiprocess
    except Exception as exc:  # ImportError, or a broken install
        return exc
    return prometheus_client, mmap_dict, multiprocess


def _directory() -> str | None:
    """Where this process's counts are read from: vLLM's directory first, then the private one."""
    for name in (PROMETHEUS_DIR, ENV_DIR):
        path = os.environ.get(name)
        if path and os.path.isdir(path):
            return path
    return None


def _writer_here() -> _Writer | None:
    """This process's writer, opened on first use; a forked child opens its own. Holds ``_lock``."""
    global _writer, _off_pid
    pid = os.getpid()
    if _writer is not None and _writer.pid == pid:
        return _writer
    if _off_pid == pid:  # failed once here: not retried on every count
        return None
    _writer, _off_pid = None, pid
    found = _import_prometheus()
    if isinstance(found, Exception):
        _say_once(
            "info",
            "prometheus_client is not importable (%s); the counts are in the log lines only",
            f"{type(found).__name__}: {found}",
        )
        return None
    # Without a directory from an API server (the engine runs in this very process, or its
    # front end did not attach) the counts are served from this process's REGISTRY.
    directory = _directory() or _attach(found)
    _writer, _off_pid = _Writer(found[1], directory), None
    logger.debug("vllm-mamba-fix: metrics are written to %s", directory)
    return _writer


def count(key: str, amount: int = 1) -> None:
    """Add ``amount`` to the series of the ``stats()`` key ``key``. Never raises."""
    try:
        series = SERIES.get(key)
        if series is None:
            _say_once("debug", "no metric for the count %r", key)
            return
        with _lock:
            writer = _writer_here()
            if writer is not None:
                writer.add(series, amount)
    except Exception as exc:
        _say_once("debug", "metrics not written (%s)", f"{type(exc).__name__}: {exc}")


def prepare() -> None:
    """Create every series at 0, so ``increase()`` alerts see them before the first count.

    Called when the engine core builds a scheduler. Never raises.
    """
    for key in SERIES:
        count(key, 0)


def attach() -> None:
    """In the process that serves ``/metrics``: read the engine cores' counts there.

    Called by ``register()`` in every process; acts only where multiprocessing did not start
    the process (the API server): engine cores and workers are multiprocessing children and
    inherit :data:`ENV_DIR` from it. A value inherited by the API server itself (a program
    that loaded the plugin and then ran ``vllm serve``) is replaced. Never raises.
    """
    try:
        if os.environ.get(PROMETHEUS_DIR) or multiprocessing.parent_process() is not None:
            return
        found = _import_prometheus()
        if isinstance(found, Exception):
            _say_once("debug", "prometheus_client is not importable (%s)", type(found).__name__)
            return
        with _lock:
            os.environ[ENV_DIR] = _attach(found)
    except Exception as exc:
        _say_once("debug", "metrics not attached (%s)", f"{type(exc).__name__}: {exc}")


def _attach(found: tuple[ModuleType, ModuleType, ModuleType]) -> str:
    """A private directory read by a collector in this process's REGISTRY. Holds ``_lock``."""
    global _attached
    if _attached is not None:
        return _attached
    prometheus_client, _, multiprocess = found
    directory = tempfile.mkdtemp(prefix="vllm-mamba-fix-metrics-")
    try:
        multiprocess.MultiProcessCollector(prometheus_client.REGISTRY, path=directory)
    except Exception:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    _attached = directory
    owner = os.getpid()
    # Only the creating process removes it (a forked child runs atexit too).
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(directory, ignore_errors=True))
    return directory


def support() -> Support:
    """Whether counts made in the engine core reach ``vllm serve``'s ``/metrics``, and why not.

    For doctor, which runs in a process of its own: it checks what the API server and the
    engine core will need. Never raises.
    """
    try:
        found = _import_prometheus()
        if isinstance(found, Exception):
            return Support(
                False,
                f"prometheus_client is not importable ({type(found).__name__}: {found}); "
                "alert on the log lines instead (docs/deployment.md)",
            )
        _, mmap_dict, multiprocess = found
        missing = [
            name
            for module, name in (
                (mmap_dict, "MmapedDict"),
                (mmap_dict, "mmap_key"),
                (multiprocess, "MultiProcessCollector"),
            )
            if not hasattr(module, name)
        ]
        if missing:
            return Support(False, f"this prometheus_client lacks {', '.join(missing)}")
        try:
            from vllm.v1.metrics.prometheus import get_prometheus_registry  # noqa: F401
        except Exception as exc:
            return Support(
                False,
                "this vLLM has no vllm.v1.metrics.prometheus.get_prometheus_registry "
                f"({type(exc).__name__}); alert on the log lines instead (docs/deployment.md)",
            )
        where = os.environ.get(PROMETHEUS_DIR)
        route = (
            f"through PROMETHEUS_MULTIPROC_DIR={where}"
            if where
            else "through a private directory the API server reads"
        )
        return Support(
            True,
            f"vllm_mamba_fix_* counters at vllm serve's /metrics, {route}; engine cores on "
            "other hosts or in Ray actors keep theirs to their logs",
        )
    except Exception as exc:
        return Support(False, f"cannot tell ({type(exc).__name__}: {exc})")
