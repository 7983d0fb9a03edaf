"""metrics_sweep.py: a leftover metrics directory is removed only where its name proves this
host's boot and this pid namespace, and its server is gone there (issue 35, item 4).

Every directory is named by a real process through the module's own ``directory_name``.
Other pid namespaces are real ones, made with ``unshare`` (util-linux): as root, or in a user
namespace that maps this user to root. The attach()-level sweep cases (zombies, reused pids,
writers, symlinks, other users) are in test_metrics.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mamba_fix.observe import metrics_sweep

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")

# A serving process: names its directory as attach() does, and one as 0.4.0 did (an upgrade
# window), prints both names, and lives until its stdin closes.
SERVER = """
import os, sys
from vllm_mamba_fix.observe import metrics_sweep
names = [metrics_sweep.directory_name("0123456789ab"),
         f"{metrics_sweep.PREFIX}{os.getpid()}-abcdefabcdef"]
for name in names:
    os.mkdir(os.path.join(sys.argv[1], name), 0o700)
print(" ".join(names), flush=True)
sys.stdin.read()
"""

# pid 1 of a new pid namespace: starts SERVER (argv[3]) as pid argv[1] of that namespace.
# ns_last_pid is the writer's own namespace's, whichever /proc it is opened through.
LAUNCHER = """
import subprocess, sys
with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
    fh.write(str(int(sys.argv[1]) - 1))
sys.exit(subprocess.call([sys.executable, "-c", sys.argv[3], sys.argv[2]]))
"""

# A starting server: first names a gone server's directory with this pid namespace and boot
# as the kernel gives them (pid 300: only pid 1 lives in this new namespace), then sweeps.
SWEEPER = """
import json, logging, os, sys
from pathlib import Path
logging.basicConfig(level=logging.DEBUG, format="%(message)s")
from vllm_mamba_fix.observe import metrics_sweep
namespace = os.stat("/proc/self/ns/pid").st_ino
boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:16]
planted = f"{metrics_sweep.PREFIX}300-0-{namespace}-{boot}-0123456789ab"
os.mkdir(os.path.join(sys.argv[1], planted))
print("RESULT " + json.dumps([planted, metrics_sweep.sweep(directory=sys.argv[1])]))
"""


def _unshare(*flags: str) -> list[str]:
    """The command prefix for a new pid namespace; skips where none can be made (fails in CI)."""
    user = [] if os.getuid() == 0 else ["--user", "--map-root-user"]
    command = ["unshare", *user, "--pid", "--fork", *flags]
    why = "unshare (util-linux) is missing"
    if shutil.which("unshare"):
        probe = subprocess.run([*command, "true"], capture_output=True, text=True, timeout=30)
        why = "" if probe.returncode == 0 else f"unshare failed: {probe.stderr.strip()}"
    if why and os.environ.get("CI") == "true":
        pytest.fail(f"{why}: CI must run the pid-namespace tests")
    if why:
        pytest.skip(f"{why}: cannot make another pid namespace")
    return command


def _start_server(command: list[str], pid: int, tmp: Path) -> tuple[subprocess.Popen, list[str]]:
    """SERVER alive in a new pid namespace as ``pid``; its two directory names."""
    launch = [*command, sys.executable, "-c", LAUNCHER, str(pid), str(tmp), SERVER]
    pipe = subprocess.PIPE
    server = subprocess.Popen(launch, stdin=pipe, stdout=pipe, text=True, cwd=REPO)
    names = server.stdout.readline().split() if server.stdout else []
    assert len(names) == 2 and all((tmp / name).is_dir() for name in names), names
    return server, names


def _stop(server: subprocess.Popen) -> None:
    if server.stdin:
        server.stdin.close()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _pid_namespace() -> str:
    return str(os.stat("/proc/self/ns/pid").st_ino)


def _boot() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:16]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not Path(f"/proc/{proc.pid}").exists()
    return proc.pid


def _fields(name: str) -> list[str]:
    """pid, start, pid namespace, boot, token of a directory name (as many as it has)."""
    assert name.startswith(metrics_sweep.PREFIX), name
    return name[len(metrics_sweep.PREFIX) :].split("-")


def _make(tmp: Path, *fields: str) -> Path:
    path = tmp / (metrics_sweep.PREFIX + "-".join(fields))
    path.mkdir(mode=0o700)
    return path


def _named_by_a_gone_server(tmp: Path) -> tuple[Path, list[str]]:
    """A directory a server of this boot and pid namespace named, and its five fields; the
    server has exited."""
    script = "import os, sys; from vllm_mamba_fix.observe import metrics_sweep as m; "
    script += "name = m.directory_name('0123456789ab'); os.mkdir(os.path.join(sys.argv[1], name)); "
    script += "print(name, os.getpid())"
    run = subprocess.run([sys.executable, "-c", script, str(tmp)], capture_output=True, text=True,
                         cwd=REPO, timeout=60, check=True)  # fmt: skip
    name, pid = run.stdout.split()
    fields = _fields(name)
    assert len(fields) == 5, name  # pid, start, pid namespace, boot, token
    assert not Path(f"/proc/{pid}").exists()
    return tmp / name, fields


def test_a_gone_server_of_this_boot_and_namespace_is_removed(tmp_path: Path) -> None:
    """The name carries the pid, its start, this pid namespace and this boot; a server gone
    here is removed, as before."""
    path, (pid, start, namespace, boot, token) = _named_by_a_gone_server(tmp_path)
    assert (namespace, boot, len(token)) == (_pid_namespace(), _boot(), 12)
    assert int(pid) > 0 and int(start) > 0
    assert len(path.name) <= 105  # each field bounded
    assert metrics_sweep.sweep(directory=str(tmp_path)) == [str(path)]


def test_a_directory_of_another_boot_is_kept(tmp_path: Path) -> None:
    """Hosts sharing a temporary directory over a network file system: every host's initial
    pid namespace has the same inode, and only the boot tells them apart. A gone server's
    name with another boot stays; the same name with this boot is removed."""
    path, (pid, start, namespace, boot, token) = _named_by_a_gone_server(tmp_path)
    other = _make(tmp_path, pid, start, namespace, f"{int(boot, 16) ^ 1:016x}", token)
    assert metrics_sweep.sweep(directory=str(tmp_path)) == [str(path)]
    assert other.is_dir()


def test_older_names_and_unknown_namespace_or_boot_are_kept(
    tmp_path: Path, plugin_log: pytest.LogCaptureFixture
) -> None:
    """0.4.0's ``<pid>-<token>``, the development names without a boot, and names with an
    unknown (0) namespace or boot prove neither: they stay, in one log line. Their twin with
    both, of the same gone server, is removed."""
    path, (pid, start, namespace, boot, token) = _named_by_a_gone_server(tmp_path)
    kept = [
        _make(tmp_path, pid, token),  # 0.4.0
        _make(tmp_path, pid, start, namespace, token),  # no boot
        _make(tmp_path, pid, start, "0", boot, token),  # namespace unknown
        _make(tmp_path, pid, start, namespace, "0", token),  # boot unknown
    ]
    assert metrics_sweep.sweep(directory=str(tmp_path)) == [str(path)]
    assert [p for p in kept if not p.is_dir()] == []
    lines = [r.getMessage() for r in plugin_log.records if "not judged" in r.getMessage()]
    assert len(lines) == 1 and all(p.name in lines[0] for p in kept), lines


def test_a_live_server_in_another_pid_namespace_is_kept(tmp_path: Path) -> None:
    """Issue 35: a live server in another pid namespace (a container sharing the temporary
    directory) under a pid no process has here. Its directory, and one named as 0.4.0 named
    it (an upgrade window), stay; the same name with this namespace is removed."""
    pid = _dead_pid()  # free here; the server has it in its own namespace
    server, (theirs, old) = _start_server(_unshare("--mount-proc"), pid, tmp_path)
    try:
        fields = _fields(theirs)
        assert len(fields) == 5 and fields[0] == str(pid), theirs
        assert fields[2] not in ("0", _pid_namespace()) and fields[3] == _boot(), theirs
        twin = _make(tmp_path, *fields[:2], _pid_namespace(), *fields[3:])
        assert metrics_sweep.sweep(directory=str(tmp_path)) == [str(twin)]
        assert (tmp_path / theirs).is_dir() and (tmp_path / old).is_dir()
    finally:
        _stop(server)


def test_no_directory_is_removed_where_proc_is_another_namespaces(tmp_path: Path) -> None:
    """Issue 35: a live server and a starting one, each in a pid namespace of its own and
    both seeing the host's ``/proc`` (unshare without --mount-proc), where neither can read
    its namespace (0 == 0 judged the server's pid in the other namespace). The starting one
    removes nothing, not even a directory named with its namespace and boot, and says so."""
    command = _unshare()
    server, names = _start_server(command, 300, tmp_path)  # pid 300: none in the other
    try:
        assert all(_fields(name)[0] == "300" for name in names), names
        run = subprocess.run([*command, sys.executable, "-c", SWEEPER, str(tmp_path)],
                             capture_output=True, text=True, cwd=REPO, timeout=60)  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))
        planted, removed = json.loads(line[len("RESULT ") :])
        assert removed == [], run.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*names, planted])
        assert "not swept: this process cannot read its own pid namespace" in run.stderr
    finally:
        _stop(server)
