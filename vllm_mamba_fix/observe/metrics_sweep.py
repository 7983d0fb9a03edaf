"""The private metrics directories of serving processes that are gone, removed at start.

:func:`vllm_mamba_fix.observe.metrics.attach` names one private directory per serving process (an
API server) in the temporary directory; its first engine core makes it, and the serving
process removes it at exit. A SIGKILL or an unhandled SIGTERM skips that, so such a run
left its directory behind. The next serving process to start removes those, and only
those:

- named as :func:`directory_name` names them (or 0.4.0's ``<pid>-<token>``), a real
  directory (not a symlink), owned by this user;
- whose serving process is gone: its pid names no process, a zombie, or a process that
  started at another time than the one in the name (the pid was reused). A directory named
  in another pid namespace is never judged (a ``/tmp`` shared between containers);
- holding nothing but the plugin's counter files, each of a writer (an engine core) that
  no longer runs.

Where any of it cannot be told, the directory stays. ``PROMETHEUS_MULTIPROC_DIR`` is never
looked into: vLLM and the user own it, and a dead process's counter file there is part of
the counters' totals (prometheus_client's multiprocess mode). Never raises.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable

from vllm_mamba_fix._log import logger

PREFIX = "vllm-mamba-fix-metrics-"
# <pid>-<start ticks>-<pid namespace>-<token> (0 where unknown); 0.4.0: <pid>-<token>.
_NAME = re.compile(r"vllm-mamba-fix-metrics-(\d{1,10})-(?:(\d{1,20})-(\d{1,20})-)?[0-9a-f]{12}")
# An engine core's counter file, and its gauge file (metrics_store.py).
_WRITER_FILE = re.compile(r"(?:counter|gauge_mostrecent)_vllm-mamba-fix-(\d{1,10})\.db")
_PROC = "/proc"


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from the state field on (the name may hold spaces); None: unknown."""
    try:
        with open(f"{_PROC}/{pid}/stat") as fh:
            text = fh.read()
        return text[text.rindex(")") + 2 :].split()
    except (OSError, ValueError):
        return None


def _start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot: unlike the wall clock, never stepped."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None  # field 22 of proc(5)
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> int:
    """This process's pid namespace (0: unknown); only where ``/proc`` shows this namespace."""
    try:
        if int(os.readlink(f"{_PROC}/self")) != os.getpid():
            return 0  # a /proc of another namespace: its pids are not ours
        return os.stat(f"{_PROC}/self/ns/pid").st_ino
    except (OSError, ValueError):
        return 0


def directory_name(token: str) -> str:
    """This serving process's directory name: who made it, so a later start can tell."""
    return f"{PREFIX}{os.getpid()}-{_start_ticks(os.getpid()) or 0}-{_pid_namespace()}-{token}"


def _gone(pid: int, start: int | None, procfs: bool) -> bool:
    """True only where ``pid``'s process has surely exited, or the pid names another process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists: another user's process
    except (OSError, OverflowError):
        return False
    fields = _stat_fields(pid) if procfs else None
    if not fields:
        return False  # cannot tell
    if fields[0] in ("Z", "X"):  # exited, not reaped yet
        return True
    return start is not None and _start_ticks(pid) not in (None, start)


def _only_gone_writers(path: str, procfs: bool) -> bool:
    with os.scandir(path) as entries:
        for entry in entries:
            match = _WRITER_FILE.fullmatch(entry.name)
            if match is None or not entry.is_file(follow_symlinks=False):
                return False  # not the plugin's file: someone else's directory, or in use
            if not _gone(int(match.group(1)), None, procfs):
                return False
    return True


def _is_ours(path: str) -> bool:
    info = os.lstat(path)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()


def sweep(keep: Iterable[str | None] = (), directory: str | None = None) -> list[str]:
    """Remove the directories of gone serving processes; the paths removed. Never raises."""
    try:
        return _sweep(keep, directory or tempfile.gettempdir())
    except Exception as exc:
        logger.debug("vllm-mamba-fix: old metrics directories not swept (%s)", exc)
        return []


def _sweep(keep: Iterable[str | None], directory: str) -> list[str]:
    kept = {os.path.realpath(path) for path in keep if path}
    namespace = _pid_namespace()
    procfs = namespace != 0  # /proc shows this pid namespace: start times can be read
    removed = []
    with os.scandir(directory) as entries:
        candidates = [entry.path for entry in entries if entry.name.startswith(PREFIX)]
    for path in candidates:
        match = _NAME.fullmatch(os.path.basename(path))
        if match is None or os.path.realpath(path) in kept:
            continue
        pid, start, named_in = match.group(1, 2, 3)
        if named_in is not None and int(named_in) != namespace:
            continue  # another pid namespace's process: not ours to judge
        try:
            if int(pid) == os.getpid() or not _is_ours(path):
                continue
            started = int(start) if start else 0  # 0: unknown, or 0.4.0's name
            if not _gone(int(pid), started or None, procfs):
                continue
            if not _only_gone_writers(path, procfs):
                continue
        except OSError:  # removed meanwhile by another starting server, or unreadable
            continue
        shutil.rmtree(path, ignore_errors=True)  # another server may sweep it at once
        if not os.path.lexists(path):
            removed.append(path)
    if removed:
        logger.debug(
            "vllm-mamba-fix: removed %d metrics directories of exited processes: %s",
            len(removed),
            ", ".join(removed),
        )
    return removed
