"""The private metrics directories of serving processes that are gone, removed at start (an API
server removes its own at exit, which a SIGKILL skips). Only those:

- named by :func:`directory_name` with this host's boot and this pid namespace, where the pid
  in the name means what it means here (a temporary directory may be shared between
  containers or hosts); older names, or an unknown (0) namespace or boot, prove neither;
- a real directory (not a symlink), owned by this user;
- whose serving process is gone (no process, a zombie, or the pid reused: another start);
- holding only the plugin's counter files, each of a writer that no longer runs.

A process that cannot read its own pid namespace and boot removes nothing, and says so.
``PROMETHEUS_MULTIPROC_DIR`` is never looked into (its dead writers' files are in the totals)."""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable

from vllm_mamba_fix._log import logger

PREFIX = "vllm-mamba-fix-metrics-"
# <pid>-<start ticks>-<pid namespace>-<boot>-<token>, 0 where unknown: at most 105 characters.
_NAME = re.compile(PREFIX + r"(\d{1,10})-(\d{1,20})-(\d{1,20})-([0-9a-f]{16}|0)-[0-9a-f]{12}")
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


def _start_ticks(pid: int) -> int | None:  # in ticks since boot: unlike the clock, never stepped
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None  # field 22 of proc(5)
    except (IndexError, ValueError):
        return None


def _pid_namespace() -> int:
    """Our pid namespace (0: unknown), only where ``/proc`` is ours: ``NSpid`` lists one pid."""
    try:
        with open(f"{_PROC}/self/status") as fh:
            nspid = next((line.split()[1:] for line in fh if line.startswith("NSpid:")), None)
        if nspid != [str(os.getpid())]:
            return 0  # a /proc of another namespace (its pids are not ours), or a kernel < 4.1
        return os.stat(f"{_PROC}/self/ns/pid").st_ino
    except (OSError, ValueError):
        return 0


def _boot() -> str:
    """This host's boot: the first 16 hex digits of the kernel's random boot id ("0": unknown)."""
    try:
        with open(f"{_PROC}/sys/kernel/random/boot_id") as fh:
            digits = fh.read().strip().replace("-", "")
    except OSError:
        return "0"
    return digits[:16] if re.fullmatch(r"[0-9a-f]{32}", digits) else "0"


def directory_name(token: str) -> str:  # who made it, so that a later start can tell
    pid = os.getpid()
    return f"{PREFIX}{pid}-{_start_ticks(pid) or 0}-{_pid_namespace()}-{_boot()}-{token}"


def _gone(pid: int, start: int | None) -> bool:
    """True only where ``pid``'s process has surely exited, or the pid names another process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # exists: another user's process
    except (OSError, OverflowError):
        return False
    fields = _stat_fields(pid)
    if not fields:
        return False  # cannot tell
    if fields[0] in ("Z", "X"):  # exited, not reaped yet
        return True
    return start is not None and _start_ticks(pid) not in (None, start)


def _only_gone_writers(path: str) -> bool:
    with os.scandir(path) as entries:
        for entry in entries:
            match = _WRITER_FILE.fullmatch(entry.name)
            if match is None or not entry.is_file(follow_symlinks=False):
                return False  # not the plugin's file: someone else's directory, or in use
            if not _gone(int(match.group(1)), None):
                return False
    return True


def sweep(keep: Iterable[str | None] = (), directory: str | None = None) -> list[str]:
    """The paths of gone serving processes' directories it removed. Never raises."""
    try:
        return _sweep(keep, directory or tempfile.gettempdir())
    except Exception as exc:
        logger.debug("vllm-mamba-fix: old metrics directories not swept (%s)", exc)
        return []


def _sweep(keep: Iterable[str | None], directory: str) -> list[str]:
    here = (_pid_namespace(), _boot())
    if here[0] == 0 or here[1] == "0":
        logger.debug(
            "vllm-mamba-fix: old metrics directories not swept: this process cannot read its "
            "own pid namespace and boot id (%s is another pid namespace's, or unreadable)",
            _PROC,
        )
        return []
    kept = {os.path.realpath(path) for path in keep if path}
    removed, unjudged = [], []
    with os.scandir(directory) as entries:
        candidates = [entry.path for entry in entries if entry.name.startswith(PREFIX)]
    for path in candidates:
        match = _NAME.fullmatch(os.path.basename(path))
        if os.path.realpath(path) in kept:
            continue
        if match is None or (int(match.group(3)), match.group(4)) != here:
            # Another boot's or pid namespace's, or a name that proves neither: its pid is
            # not a pid here (a live server of another container or host). An equal inode
            # in this boot is this namespace, or one that ended with all its processes.
            unjudged.append(os.path.basename(path))
            continue
        pid, start = int(match.group(1)), int(match.group(2))
        try:
            info = None if pid == os.getpid() else os.lstat(path)
            if info is None or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            if not _gone(pid, start or None) or not _only_gone_writers(path):
                continue
        except OSError:  # removed meanwhile by another starting server, or unreadable
            continue
        shutil.rmtree(path, ignore_errors=True)  # another server may sweep it at once
        if not os.path.lexists(path):
            removed.append(path)
    if unjudged:
        logger.debug(
            "vllm-mamba-fix: %d metrics directories not judged (another host boot or pid "
            "namespace, or an older name); remove them by hand once their servers are gone: %s",
            len(unjudged), ", ".join(sorted(unjudged)),
        )  # fmt: skip
    if removed:
        logger.debug(
            "vllm-mamba-fix: removed %d metrics directories of exited processes: %s",
            len(removed), ", ".join(removed),
        )  # fmt: skip
    return removed
