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
  API server; never an engine core or a worker), adds a collector to ``REGISTRY`` and names
  a private directory to the engine cores it starts (:data:`ENV_DIR`); the first engine core
  that counts makes it. Counts made in the serving process itself (an engine in the same
  process) stay in memory, so that process writes no file.

A non-hybrid model's engine core prepares nothing (no directory, no series); a killed
server's private directory is removed when the next one starts (metrics_sweep.py).

An engine core's file is ``counter_vllm-mamba-fix-<pid>.db``: prometheus_client's own format
(``MmapedDict``), under a name of its own so it never shares a file with a metric
prometheus_client may keep in the same process. No server, no port. prometheus_client comes
with vLLM but is imported lazily: without it nothing is counted here and one line says so.
"""

from __future__ import annotations

import atexit
import glob
import multiprocessing
import os
import secrets
import shutil
import tempfile
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

from vllm_mamba_fix._log import logger
from vllm_mamba_fix.facts import blocks, config
from vllm_mamba_fix.observe import metrics_sweep

FILE_PREFIX = "counter_vllm-mamba-fix-"  # "counter_": the type MultiProcessCollector reads


# The environment is read and written in config.py, the one module that touches it.
directories = config.metrics_directories
hand_down = config.hand_down_metrics_directory
PROMETHEUS_DIR = config.PROMETHEUS_DIR  # vLLM's and prometheus_client's directory
ENV_DIR = config.METRICS_DIR_VAR  # the private one an API server hands down


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


def _key(mmap_dict: Any, series: Series) -> str:
    """prometheus_client's key of a sample in a multiprocess file."""
    names = [name for name, _ in series.labels]
    values = [value for _, value in series.labels]
    return mmap_dict.mmap_key(series.metric, series.sample, names, values, series.help)


class _Writer:
    """This process's counter file; callers hold ``_lock`` (MmapedDict is not thread-safe)."""

    def __init__(self, mmap_dict: Any, directory: str) -> None:
        self.pid = os.getpid()
        self._mmap_dict = mmap_dict
        self._file = mmap_dict.MmapedDict(os.path.join(directory, f"{FILE_PREFIX}{self.pid}.db"))

    def add(self, series: Series, amount: float) -> None:
        key = _key(self._mmap_dict, series)
        # Read back, not cached: a file left by an earlier run under the same pid (a
        # PROMETHEUS_MULTIPROC_DIR nobody wiped) keeps counting up, as prometheus_client does.
        stored = self._file.read_value(key)
        value = (stored[0] if isinstance(stored, tuple) else stored) + amount
        try:
            self._file.write_value(key, value, 0.0)
        except TypeError:  # prometheus_client before timestamps: (key, value)
            self._file.write_value(key, value)


class _Local:
    """The counts of the process that serves them (no file): an engine in the API server."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.values: dict[str, float] = {}  # stats() key -> count

    def add(self, series_key: str, amount: float) -> None:
        self.values[series_key] = self.values.get(series_key, 0.0) + amount


class _Collector:
    """This process's counts plus the files its engine cores write under ``directory``."""

    def __init__(self, prometheus_client: Any, multiprocess: Any, directory: str) -> None:
        from prometheus_client.core import CounterMetricFamily

        self._family = CounterMetricFamily
        self._merge = multiprocess.MultiProcessCollector.merge
        self.directory = directory  # "" until attach() names one

    def describe(self) -> list[Any]:
        # No names up front: REGISTRY would otherwise collect() while _serve_here holds _lock.
        return []

    def collect(self) -> Any:
        # Runs inside vLLM's /metrics handler: an error here must not fail the scrape.
        try:
            return self._collect()
        except Exception as exc:
            _say_once("warning", "metrics not read (%s)", f"{type(exc).__name__}: {exc}")
            return []

    def _collect(self) -> Any:
        totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        files = glob.glob(os.path.join(self.directory, "*.db")) if self.directory else []
        for path in files:  # one by one: a damaged file loses its own counts only
            try:
                merged = self._merge([path], accumulate=True)
            except Exception as exc:
                _say_once("warning", "metrics file %s not read (%s)", path, type(exc).__name__)
                continue
            for metric in merged:
                for sample in metric.samples:
                    where = (sample.name, tuple(sorted(sample.labels.items())))
                    totals[where] = totals.get(where, 0.0) + sample.value
        with _lock:
            local = dict(_local.values) if _local is not None else {}
        families: dict[str, Any] = {}
        for key, series in SERIES.items():
            where = (series.sample, tuple(sorted(series.labels)))
            if where not in totals and key not in local:
                continue  # not prepared yet: no engine core has built a scheduler
            family = families.get(series.metric)
            if family is None:
                family = families[series.metric] = self._family(
                    series.metric, series.help, labels=[name for name, _ in series.labels]
                )
            value = totals.get(where, 0.0) + local.get(key, 0.0)
            family.add_metric([value for _, value in series.labels], value)
        return list(families.values())


_lock = threading.RLock()  # re-entered if a registry collects while _serve_here holds it
_writer: _Writer | None = None
_local: _Local | None = None  # set in the process whose REGISTRY serves the counts
_said: set[str] = set()
_off_pid: int | None = None  # the process where opening the writer failed
_swept_pid: int | None = None  # the process that swept old directories (once per process)


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


def _private_directory(path: str) -> str:
    """The API server's directory, made by its first engine core; only if it is this user's."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user")
    return path


def _sink_here() -> _Writer | _Local | None:
    """Where this process counts, chosen on first use; a forked child chooses again.

    Holds ``_lock``. vLLM's ``PROMETHEUS_MULTIPROC_DIR`` first; then this process's own
    counts if it serves them; then the directory an API server handed down; else this
    process serves its own (an engine in a process no API server started).
    """
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
    shared, private = directories()
    if shared and os.path.isdir(shared):
        _writer = _Writer(found[1], shared)
    elif _local is not None and _local.pid == pid:
        _off_pid = None
        return _local
    elif private:
        _writer = _Writer(found[1], _private_directory(private))
    else:
        _off_pid = None
        return _serve_here(found, None)
    _off_pid = None
    logger.debug("vllm-mamba-fix: metrics are written to %s", shared or private)
    return _writer


def count(key: str, amount: int = 1) -> None:
    """Add ``amount`` to the series of the ``stats()`` key ``key``. Never raises."""
    try:
        series = SERIES.get(key)
        if series is None:
            _say_once("debug", "no metric for the count %r", key)
            return
        with _lock:
            sink = _sink_here()
            if isinstance(sink, _Local):
                sink.add(key, amount)
            elif sink is not None:
                sink.add(series, amount)
    except Exception as exc:
        _say_once("debug", "metrics not written (%s)", f"{type(exc).__name__}: {exc}")


def prepare(scheduler: Any = None) -> None:
    """Create every series at 0, so ``increase()`` alerts see them before the first count.

    Called when the engine core builds ``scheduler``. Not for a scheduler without Mamba KV
    cache groups (a non-hybrid model): vLLM never calls the split there, so the plugin has
    nothing to count, and the engine core makes no directory and no series. Never raises.
    """
    try:
        if scheduler is not None and blocks.unit_of_scheduler(scheduler).no_mamba:
            return
    except Exception:  # a broken attribute: prepare, as before
        pass
    for key in SERIES:
        count(key, 0)


def attach() -> None:
    """In the process that serves ``/metrics``: read the engine cores' counts there.

    Called by ``register()`` in every process; acts only where multiprocessing did not start
    the process (the API server): engine cores and workers are multiprocessing children and
    inherit :data:`ENV_DIR` from it. A value inherited by the API server itself (a program
    that loaded the plugin and then ran ``vllm serve``) is replaced. Writes no file: the
    directory is made by the first engine core that counts. First, once per process, removes
    the private directories of serving processes that are gone. Never raises.
    """
    global _swept_pid
    try:
        if multiprocessing.parent_process() is not None:
            return
        if _swept_pid != os.getpid():
            _swept_pid = os.getpid()
            metrics_sweep.sweep(keep=directories())
        if directories()[0]:
            return
        found = _import_prometheus()
        if isinstance(found, Exception):
            _say_once("debug", "prometheus_client is not importable (%s)", type(found).__name__)
            return
        with _lock:
            name = metrics_sweep.directory_name(secrets.token_hex(6))
            directory = _serve_here(found, os.path.join(tempfile.gettempdir(), name))
            hand_down(directory)
    except Exception as exc:
        _say_once("debug", "metrics not attached (%s)", f"{type(exc).__name__}: {exc}")


_collector: _Collector | None = None  # the one this process registered


def _serve_here(found: tuple[ModuleType, ModuleType, ModuleType], directory: str | None) -> Any:
    """A collector in this process's REGISTRY; counts made here stay in memory. Holds ``_lock``.

    Returns the directory it reads for ``attach`` (made later, by an engine core), or the
    in-memory sink for a process that counts without one.
    """
    global _local, _collector
    if _collector is None:
        prometheus_client, _, multiprocess = found
        collector = _Collector(prometheus_client, multiprocess, "")
        prometheus_client.REGISTRY.register(collector)
        _collector, _local = collector, _Local()
    if directory and not _collector.directory:
        _collector.directory = directory
        owner = os.getpid()
        # Only the serving process removes it (a forked child runs atexit too).
        atexit.register(
            lambda: os.getpid() == owner and shutil.rmtree(directory, ignore_errors=True)
        )
    return _collector.directory if directory is not None else _local


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
        where = directories()[0]
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
