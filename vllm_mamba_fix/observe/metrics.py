"""The plugin's ``vllm_mamba_fix_*`` series at ``vllm serve``'s own ``/metrics``.

The counts are made in the engine core and ``/metrics`` is served by the API server; vLLM
carries no plugin figure between them, so the values travel as vLLM's own API servers share
theirs: prometheus_client's multiprocess files, in ``PROMETHEUS_MULTIPROC_DIR`` where set
(``--api-server-count`` > 1, or the user); else :func:`attach` (in the API server) adds a
collector to ``REGISTRY`` and names a private directory to the engine cores (:data:`ENV_DIR`),
removed at exit. prometheus_client is imported lazily: without it, one line says so."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import multiprocessing
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any, NamedTuple

from vllm_mamba_fix._log import logger
from vllm_mamba_fix.changes import installation, say_once
from vllm_mamba_fix.facts import blocks, config
from vllm_mamba_fix.observe import metrics_sweep
from vllm_mamba_fix.observe.metrics_store import FILE_PREFIX, Collector, Local, Writer
from vllm_mamba_fix.observe.series import (
    INFO,
    MAMBA_BLOCK,
    OLDEST_STALL,
    SERIES,
    SPLIT_BLOCK,
    STALLED,
    Labels,
    Series,
    identity,
    with_labels,
)

__all__ = ["FILE_PREFIX", "SERIES", "Series"]

directories = config.metrics_directories
PROMETHEUS_DIR = config.PROMETHEUS_DIR  # vLLM's and prometheus_client's directory
ENV_DIR = config.METRICS_DIR_VAR  # the private one an API server hands down


class Support(NamedTuple):
    available: bool
    reason: str


_lock = threading.RLock()  # re-entered if a registry collects while _serve_here holds it


class Exported:
    """The session's memory of metrics in this process (a forked child chooses again)."""

    writer: Writer | None = None
    local: Local | None = None  # set in the process whose REGISTRY serves the values
    off_pid: int | None = None  # the process where opening the writer failed
    swept_pid: int | None = None  # the process that swept old directories (once per process)
    identity: Labels = ()  # vLLM's model_name and engine labels, learnt by prepare(scheduler)
    identity_pid: int | None = None  # gauges are written only here (never doctor, API server)
    collector: Collector | None = None  # the one this process registered


TAG = __name__  # the collector, the variable and the directory, in the record of changes


def _failed(what: str, exc: Exception) -> None:
    say_once(logging.DEBUG, what + " (%s)", f"{type(exc).__name__}: {exc}", event=None)


def _import_prometheus() -> tuple[ModuleType, ModuleType, ModuleType] | Exception:
    try:
        import prometheus_client
        from prometheus_client import mmap_dict, multiprocess
    except Exception as exc:  # ImportError, or a broken install
        return exc
    return prometheus_client, mmap_dict, multiprocess


def _sink_here() -> Writer | Local | None:
    """Chosen on first use (a forked child chooses again; holds ``_lock``): the shared directory,
    else its own served counts, the API server's directory, or its own (no API server)."""
    mem = installation.memory[Exported]
    pid = os.getpid()
    if mem.writer is not None and mem.writer.pid == pid:
        return mem.writer
    if mem.off_pid == pid:  # failed once here: not retried on every count
        return None
    mem.writer, mem.off_pid = None, pid
    found = _import_prometheus()
    if isinstance(found, Exception):
        why = f"{type(found).__name__}: {found}"
        line = "prometheus_client is not importable (%s); the counts are in the log lines only"
        say_once(logging.INFO, line, why, event=None)
        return None
    shared, private = directories()
    shared = shared if shared and os.path.isdir(shared) else None  # checked once
    if shared is None and mem.local is not None and mem.local.pid == pid:
        mem.off_pid = None
        return mem.local
    if shared:
        mem.writer = Writer(found[1], shared)
    elif private:  # the API server's, made by its first engine core; only if it is this user's
        os.makedirs(private, mode=0o700, exist_ok=True)
        if os.stat(private).st_uid != os.getuid():
            raise PermissionError(f"{private} belongs to another user")
        mem.writer = Writer(found[1], private)
    mem.off_pid = None  # chosen: not a failure
    if mem.writer is None:
        return _serve_here(found, None)
    logger.debug("vllm-mamba-fix: metrics are written to %s", shared or private)
    return mem.writer


def _put(series: Series, labels: Labels, value: float, add: bool) -> None:
    with _lock:
        sink = _sink_here()
        if sink is not None:
            sink.put(series, labels, value, add)


def count(key: str, amount: int = 1) -> None:
    """Add ``amount`` to the series of the ``stats()`` key ``key``. Never raises."""
    try:  # every stats() key has its series (SERIES mirrors counters.KEYS)
        series = SERIES[key]
        labels = installation.memory[Exported].identity
        _put(series, with_labels(series, labels), amount, add=True)
    except Exception as exc:
        _failed("metrics not written", exc)


def _set(series: Series, value: float, extra: Mapping[str, str] | None = None) -> None:
    """Only in the engine core :func:`prepare_engine` labelled. Never raises."""
    try:
        mem = installation.memory[Exported]
        if mem.identity_pid == os.getpid():
            own = tuple((str(k), str(v)) for k, v in (extra or {}).items())
            _put(series, with_labels(series, (*mem.identity, *own)), float(value), add=False)
    except Exception as exc:
        _failed("metrics not written", exc)


def stalls(standing: int, oldest_start: float) -> None:
    """A start, not an age: files cannot compute; ``time() - x`` is the age (docs/deployment.md)."""
    _set(STALLED, standing)
    _set(OLDEST_STALL, oldest_start if standing else 0.0)


def block_sizes(mamba: int | None, split: int | None) -> None:
    """The Mamba cache's block and the split's (``cache_config.block_size``); 0: unknown."""
    _set(MAMBA_BLOCK, mamba or 0)
    _set(SPLIT_BLOCK, split or 0)


def prepare(
    scheduler: Any = None,
    info: Mapping[str, str] | None = None,
    standing: tuple[int, float] = (0, 0.0),
) -> None:
    """Every series before its first count (for ``increase()``, ``absent()``), labelled from the
    scheduler's config (unlabelled without one); none without Mamba groups. Never raises."""
    try:
        if scheduler is not None:
            unit = blocks.unit_of_scheduler(scheduler)
            if unit.no_mamba:
                return
            labels = identity(getattr(scheduler, "vllm_config", None))
            prepare_engine(labels, unit.mamba, unit.configured, info, standing)
            return
    except Exception as exc:  # a broken attribute: the counters, as before
        _failed("no labels for the metrics", exc)
    for key in SERIES:
        count(key, 0)


def prepare_engine(
    labels: Labels,
    mamba_block: int | None,
    split_block: int | None,
    info: Mapping[str, str] | None = None,
    standing: tuple[int, float] = (0, 0.0),
) -> None:
    """This process is ``labels``'s engine core: every series at its value now. Never raises."""
    mem = installation.memory[Exported]
    mem.identity, mem.identity_pid = tuple(sorted(labels)), os.getpid()
    for key in SERIES:
        count(key, 0)
    _set(INFO, 1, info)
    block_sizes(mamba_block, split_block)
    stalls(*standing)


def attach() -> None:
    """In the API server: the engine cores' counts via :data:`ENV_DIR`, swept once. Never raises."""
    try:
        if multiprocessing.parent_process() is not None:
            return
        mem = installation.memory[Exported]
        if mem.swept_pid != os.getpid():
            mem.swept_pid = os.getpid()
            metrics_sweep.sweep(keep=directories())
        if directories()[0]:
            return
        found = _import_prometheus()
        if isinstance(found, Exception):
            why = type(found).__name__
            say_once(logging.DEBUG, "prometheus_client is not importable (%s)", why, event=None)
            return
        with _lock:
            name = metrics_sweep.directory_name(secrets.token_hex(6))
            directory = _serve_here(found, os.path.join(tempfile.gettempdir(), name))
            installation.set_env(ENV_DIR, directory, TAG)  # the engine cores inherit it
    except Exception as exc:
        _failed("metrics not attached", exc)


def _local_values() -> dict[tuple[Series, Labels], float]:
    with _lock:
        local = installation.memory[Exported].local
        return dict(local.values) if local is not None else {}


def _serve_here(found: tuple[ModuleType, ModuleType, ModuleType], directory: str | None) -> Any:
    """A collector on REGISTRY (holds ``_lock``): the directory it reads, or the memory sink."""
    mem = installation.memory[Exported]
    if mem.collector is None:
        registry = found[0].REGISTRY
        warn = functools.partial(say_once, logging.WARNING, event=None)
        collector = Collector(found[2], _local_values, warn)
        registry.register(collector)
        mem.collector, mem.local = collector, Local()
        what = "the vllm_mamba_fix_* collector on prometheus_client's REGISTRY"
        revert = functools.partial(_unserve, registry, collector)
        installation.record(TAG, what, revert, registry, value=collector)
    if directory and not mem.collector.directory:
        mem.collector.directory = directory
        owner = os.getpid()

        def remove() -> None:
            if os.getpid() == owner:  # only the serving process (a forked child runs atexit)
                shutil.rmtree(directory, ignore_errors=True)

        atexit.register(remove)
        removal = functools.partial(_remove_now, remove, directory)
        installation.record(TAG, f"the removal of {directory} at exit", removal)
    return mem.collector.directory if directory is not None else mem.local


def _unserve(registry: Any, collector: Collector) -> None:  # later counts choose a sink again
    with _lock:
        mem = installation.memory[Exported]
        if mem.collector is collector:
            mem.collector, mem.local = None, None
    with contextlib.suppress(KeyError):  # someone else unregistered it
        registry.unregister(collector)


def _remove_now(remove: Any, directory: str) -> None:  # the undo: removed now, if it was made
    atexit.unregister(remove)
    if os.path.isdir(directory):
        remove()


def support() -> Support:
    """Whether the engine core's counts reach ``vllm serve``'s ``/metrics``. Never raises."""
    instead = "alert on the log lines instead (docs/deployment.md)"
    try:
        found = _import_prometheus()
        if isinstance(found, Exception):
            why = f"{type(found).__name__}: {found}"
            return Support(False, f"prometheus_client is not importable ({why}); {instead}")
        _, mmap_dict, multiprocess = found
        wanted = ((mmap_dict, "MmapedDict"), (mmap_dict, "mmap_key"),
                  (multiprocess, "MultiProcessCollector"))  # fmt: skip
        missing = [name for module, name in wanted if not hasattr(module, name)]
        if missing:
            return Support(False, f"this prometheus_client lacks {', '.join(missing)}")
        try:
            from vllm.v1.metrics.prometheus import get_prometheus_registry  # noqa: F401
        except Exception as exc:
            return Support(
                False,
                "this vLLM has no vllm.v1.metrics.prometheus.get_prometheus_registry "
                f"({type(exc).__name__}); {instead}",
            )
        where = directories()[0]
        private = "a private directory the API server reads"
        route = f"PROMETHEUS_MULTIPROC_DIR={where}" if where else private
        return Support(
            True,
            f"vllm_mamba_fix_* counters at vllm serve's /metrics, through {route}; engine cores "
            "on other hosts or in Ray actors keep theirs to their logs",
        )
    except Exception as exc:
        return Support(False, f"cannot tell ({type(exc).__name__}: {exc})")
