"""Where :mod:`vllm_mamba_fix.observe.metrics` keeps the values: an engine core's own files in
prometheus_client's multiprocess format (:class:`Writer`; the gauge file removed at exit, as
``mark_process_dead`` does), the serving process's own (:class:`Local`), and the API server's
reader of both (:class:`Collector`, ``MultiProcessCollector``'s semantics, dead gauges skipped)."""

from __future__ import annotations

import atexit
import contextlib
import glob
import multiprocessing.util
import os
import re
import time
from collections.abc import Callable
from typing import Any

from vllm_mamba_fix.observe.series import Labels, Series

FILE_PREFIX = "counter_vllm-mamba-fix-"  # "counter_": the type MultiProcessCollector reads
GAUGE_FILE_PREFIX = "gauge_mostrecent_vllm-mamba-fix-"  # a gauge, in "mostrecent" mode
_GAUGE_FILE = re.compile(r"gauge_[a-z]+_vllm-mamba-fix-(\d{1,10})\.db")
PLUGIN_PREFIX = "vllm_mamba_fix"
Values = dict[tuple[Series, Labels], float]


def _remove_at_exit(path: str) -> None:
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:  # a forked child runs its parent's atexit too
            with contextlib.suppress(OSError):
                os.remove(path)

    atexit.register(remove)
    # An engine core is a multiprocessing child: its finalizers run where atexit does not.
    multiprocessing.util.Finalize(None, remove, exitpriority=10)


class Writer:
    """This process's files; callers hold metrics.py's lock (MmapedDict is not thread-safe)."""

    def __init__(self, mmap_dict: Any, directory: str) -> None:
        self.pid = os.getpid()
        self._mmap_dict = mmap_dict
        self._directory = directory
        self._files: dict[str, Any] = {}
        self._file("counter")  # opened now: a directory that cannot take it fails here

    def _file(self, kind: str) -> Any:
        found = self._files.get(kind)
        if found is None:
            prefix = FILE_PREFIX if kind == "counter" else GAUGE_FILE_PREFIX
            path = os.path.join(self._directory, f"{prefix}{self.pid}.db")
            found = self._files[kind] = self._mmap_dict.MmapedDict(path)
            if kind == "gauge":
                _remove_at_exit(path)
        return found

    def put(self, series: Series, labels: Labels, value: float, add: bool) -> None:
        names, values = [n for n, _ in labels], [v for _, v in labels]
        key = self._mmap_dict.mmap_key(series.metric, series.sample, names, values, series.help)
        file = self._file(series.kind)
        if add:
            # Read back, not cached: a file left by an earlier run under the same pid (a
            # PROMETHEUS_MULTIPROC_DIR nobody wiped) keeps counting up, as prometheus_client does.
            stored = file.read_value(key)
            value += stored[0] if isinstance(stored, tuple) else stored
        stamp = time.time() if series.kind == "gauge" else 0.0  # "mostrecent": the latest wins
        try:
            file.write_value(key, value, stamp)
        except TypeError:  # prometheus_client before timestamps: (key, value)
            file.write_value(key, value)


class Local:
    """The values of the process that serves them (no file): an engine in the API server."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.values: Values = {}

    def put(self, series: Series, labels: Labels, value: float, add: bool) -> None:
        if add:
            value += self.values.get((series, labels), 0.0)
        self.values[(series, labels)] = value


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        pass
    return True


class Collector:
    """This process's values plus the files its engine cores write under ``directory``."""

    def __init__(
        self, multiprocess: Any, local: Callable[[], Values], warn: Callable[..., None]
    ) -> None:
        from prometheus_client.metrics_core import Metric

        self._metric = Metric
        self._merge = multiprocess.MultiProcessCollector.merge
        self._local, self._warn = local, warn
        self.directory = ""  # until attach() names one

    def describe(self) -> list[Any]:  # none: REGISTRY would collect() under metrics.py's lock
        return []

    def collect(self) -> Any:
        # Runs inside vLLM's /metrics handler: an error here must not fail the scrape.
        try:
            return self._collect()
        except Exception as exc:
            self._warn("metrics not read (%s)", f"{type(exc).__name__}: {exc}")
            return []

    def _readable(self) -> list[str]:
        found = []
        for path in glob.glob(os.path.join(self.directory, "*.db")) if self.directory else []:
            gauge = _GAUGE_FILE.fullmatch(os.path.basename(path))
            if gauge is not None and not _alive(int(gauge.group(1))):
                continue
            try:  # one by one: a damaged file loses its own values only
                self._merge([path], accumulate=True)
            except Exception as exc:
                self._warn("metrics file %s not read (%s)", path, type(exc).__name__)
                continue
            found.append(path)
        return found

    def _collect(self) -> Any:
        families: dict[str, tuple[str, str]] = {}  # name -> (type, help)
        samples: dict[str, dict[tuple[str, Labels], float]] = {}
        for metric in self._merge(self._readable(), accumulate=True):
            if metric.name.startswith(PLUGIN_PREFIX):
                families[metric.name] = (metric.type, metric.documentation)
                found = samples.setdefault(metric.name, {})
                for s in metric.samples:
                    found[(s.name, tuple(sorted(s.labels.items())))] = s.value
        for (series, labels), value in self._local().items():
            families.setdefault(series.metric, (series.kind, series.help))
            found = samples.setdefault(series.metric, {})
            where = (series.sample, labels)
            found[where] = value + (found.get(where, 0.0) if series.kind == "counter" else 0.0)
        out = []
        for name, (kind, help_text) in families.items():
            metric = self._metric(name, help_text, kind)
            for (sample, labels), value in samples.get(name, {}).items():
                metric.add_sample(sample, dict(labels), value)
            out.append(metric)
        return out
