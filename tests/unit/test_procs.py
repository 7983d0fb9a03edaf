"""tools.procs.kill_group: the whole process group goes, also after its leader exited."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from tools.procs import kill_group

# The leader starts a sleeping grandchild, prints its pid, then exits or sleeps too.
LEADER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
if sys.argv[1] == "exit":
    sys.exit(0)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's reaper may be slow or absent in a container)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _start(leader_mode: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", LEADER, leader_mode],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    return proc, grandchild


def _wait_gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_kills_leader_and_grandchild() -> None:
    proc, grandchild = _start("stay")
    kill_group(proc, grace_s=5)
    assert proc.returncode is not None
    assert _wait_gone(grandchild)


def test_kills_grandchild_that_outlived_its_leader() -> None:
    proc, grandchild = _start("exit")
    proc.wait(timeout=10)
    assert _alive(grandchild)  # orphaned, still in the leader's group
    kill_group(proc, grace_s=5)
    assert _wait_gone(grandchild)
