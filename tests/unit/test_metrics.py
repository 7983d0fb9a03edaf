"""metrics.py: counts made in child processes reach the registry vLLM's /metrics serves.

Every check runs in a fresh interpreter: ``attach()`` changes the process environment that
later ``vllm serve`` starts of the suite would inherit, and the "child" processes must be
real multiprocessing children, as vLLM's engine cores are. The parent reads the counts
through vLLM's own ``get_prometheus_registry()``, the function ``/metrics`` is built from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from vllm_mamba_fix._version import __version__ as vllm_mamba_fix_version
from vllm_mamba_fix.observe import counters, metrics
from vllm_mamba_fix.observe.metrics_store import GAUGE_FILE_PREFIX
from vllm_mamba_fix.observe.series import MAMBA_BLOCK, OLDEST_STALL, SPLIT_BLOCK, STALLED

REPO = Path(__file__).resolve().parents[2]

# The parent: optionally attach (what register() does in the API server), start children
# that count, then read vLLM's registry the way the API server builds /metrics.
PARENT = """
import json, multiprocessing as mp, os, sys, threading
from vllm_mamba_fix.observe import counters, metrics
from vllm_mamba_fix.decide.decision import Action
counters.report_to(metrics)  # what register() wires in every process vLLM starts

def through_counters(n):
    # The real counting path: counters.record() -> metrics.count().
    for i in range(n):
        counters.record(Action.COLLAPSE_PREVENTED, f"req-{{i}}", 256, 256, 256)
    counters.record_stall()

def direct(batch):
    metrics.prepare()
    for key, amount in batch:
        metrics.count(key, amount)

def beside_prometheus_client(n):
    # A metric prometheus_client keeps in the same process (multiprocess mode), as vLLM may.
    import prometheus_client
    other = prometheus_client.Counter("other_things", "not the plugin's", registry=None)
    for _ in range(n):
        other.inc()
        metrics.count("chunks_realigned")
        other.inc(2)

def fork_after_counting(first, then):
    # An engine core that counted (its file is open), then forked: the child writes its own.
    metrics.count("chunks_realigned", first)
    run("fork", direct, [["chunks_realigned", then]])

def threads(n_threads, n):
    metrics.prepare()
    sys.setswitchinterval(1e-6)  # switch threads often: an unlocked read-add-write loses counts
    def work():
        for _ in range(n):
            metrics.count("stalls_ended")
            metrics.count("block_rule_chunks", 2)
    ts = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in ts: t.start()
    for t in ts: t.join()

def build_scheduler(attention_only):
    # An engine core: the plugin loaded the engine's way, then a real Scheduler built, over
    # the attention layers' KV cache only (a model without Mamba layers) or the hybrid's.
    from tools import sched_harness
    from vllm_mamba_fix.facts import blocks

    sched_harness.load_plugins()
    harness = sched_harness.Harness(sched_harness.HarnessConfig(attention_only=attention_only))
    split = type(harness.scheduler).__dict__["_mamba_block_aligned_split"]
    assert hasattr(split, "__wrapped__"), "the plugin did not patch the scheduler"
    # What vLLM's own series carry (PrometheusStatLogger) and the block sizes, for the parent.
    config = harness.scheduler.vllm_config
    unit = blocks.unit_of_scheduler(harness.scheduler)
    with open(os.path.join(os.environ["TMPDIR"], "engine.json"), "w") as fh:
        json.dump({{"model_name": config.model_config.served_model_name,
                   "mamba": unit.mamba, "split": unit.configured}}, fh)

def engine_core(rank, batch, standing, end):
    # An engine core of DP rank `rank`: what prepare(scheduler) learns, as plain values.
    labels = (("engine", str(rank)), ("model_name", "m"))
    metrics.prepare_engine(labels, 16, 256, {{"version": "v", "rules": "split"}})
    for key, amount in batch:
        metrics.count(key, amount)
    metrics.stalls(*standing)
    if end == "kill":  # killed: no exit handler runs
        os.kill(os.getpid(), 9)

def held(target, ready, release, *args):
    target(*args)
    ready.set()
    release.wait(300)

HELD = []  # (process, release): engine cores still running while the parent reads

def start_held(method, target, *args):
    # A child that stays alive until the parent has read the registry (an engine core serving).
    ctx = mp.get_context(method)
    ready, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=held, args=(target, ready, release, *args))
    proc.start()
    assert ready.wait(300), "the child did not get ready"
    HELD.append((proc, release))
    return proc.pid

def run(method, target, *args, exitcode=0):
    proc = mp.get_context(method).Process(target=target, args=args)
    proc.start()
    proc.join(300)  # a spawned child imports vLLM and builds a scheduler: slow on a loaded box
    assert proc.exitcode == exitcode, proc.exitcode
    return proc.pid

if __name__ == "__main__":
    plan = json.loads(sys.argv[1])
    if plan.get("attach"):
        metrics.attach()
    pids = []
{body}
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    if plan.get("through_vllm"):
        import vllm.v1.metrics.prometheus as vllm_prometheus

        if plan.get("vllm_under"):  # the release under test, not the installed one
            assert vllm_prometheus.__file__.startswith(plan["vllm_under"]), vllm_prometheus.__file__
        registry = vllm_prometheus.get_prometheus_registry()
    else:  # what vLLM serves with one API server (the route tests check that it is)
        from prometheus_client import REGISTRY as registry

    text = generate_latest(registry).decode()
    samples, types = {{}}, {{}}
    for family in text_string_to_metric_families(text):
        if family.name.startswith(("vllm_mamba_fix", "other_things")):
            types[family.name] = family.type
            for s in family.samples:
                samples[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    directory = os.environ.get(metrics.PROMETHEUS_DIR) or os.environ.get(metrics.ENV_DIR)
    if directory and not os.path.isdir(directory):
        directory = None  # named by attach(), never made: no engine core counted
    gauge_files_while_held = sorted(f for f in (os.listdir(directory) if directory else [])
                                    if f.startswith("gauge_"))
    for proc, release in HELD:
        release.set()
        proc.join(60)
    print("RESULT " + json.dumps({{
        "samples": samples, "types": types, "pids": pids, "parent": os.getpid(),
        "dir": directory, "private": os.environ.get(metrics.ENV_DIR),
        "files": sorted(os.listdir(directory)) if directory else [],
        "held_gauge_files": gauge_files_while_held,
    }}))
"""


# vLLM serves /metrics from vllm.v1.metrics.prometheus.get_prometheus_registry(). The two
# route tests run it from the installed release and from the oldest, a middle and the newest
# release's own package (CI's overlays, used when cached: tools.releases downloads them).
RELEASES = ("installed", "0.15.1", "0.25.1", "0.33.0")


@pytest.fixture(params=RELEASES)
def release_path(request: pytest.FixtureRequest) -> str | None:
    """PYTHONPATH that puts the release's vllm package first (None: the installed one)."""
    if request.param == "installed":
        return None
    from tools import releases

    overlay = releases.cache_dir() / "overlays" / request.param
    if not (overlay / "vllm" / "v1" / "metrics" / "prometheus.py").exists():
        pytest.skip(f"vLLM {request.param} not cached (python -m tools.releases {request.param})")
    return releases.pythonpath_for(request.param, base=str(REPO))


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (metrics.PROMETHEUS_DIR, metrics.ENV_DIR) and not k.startswith("VLLM_MAMBA")
    }
    env.update(extra)
    return env


def _tmpdir(tmp_path: Path) -> Path:
    """The runs' TMPDIR: attach() names and sweeps private directories there, never in /tmp."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return tmp


def _run(tmp_path: Path, body: str, plan: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(body=textwrap.indent(textwrap.dedent(body), "    ")))
    env = {"TMPDIR": str(_tmpdir(tmp_path)), **env}
    run = subprocess.run(
        [sys.executable, str(script), json.dumps(plan)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "Traceback" not in output, output
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _key(series: metrics.Series, labels: dict[str, str] | None = None) -> str:
    return series.sample + json.dumps({**dict(series.labels), **(labels or {})}, sort_keys=True)


def _expected(counts: dict[str, float], labels: dict[str, str] | None = None) -> dict[str, float]:
    """Every counter, at the given stats()-key counts (0 where absent), under ``labels``."""
    return {
        _key(series, labels): float(counts.get(key, 0)) for key, series in metrics.SERIES.items()
    }


def _gauges(
    labels: dict[str, str], mamba: int, split: int, standing: int, oldest: float
) -> dict[str, float]:
    """The engine core's gauges but the info series."""
    values = {MAMBA_BLOCK: mamba, SPLIT_BLOCK: split, STALLED: standing, OLDEST_STALL: oldest}
    return {_key(series, labels): float(value) for series, value in values.items()}


def test_series_cover_every_stats_key() -> None:
    assert set(metrics.SERIES) == set(counters.KEYS)
    keys = [_key(series) for series in metrics.SERIES.values()]
    assert len(set(keys)) == len(keys)  # no two stats() keys share a series
    for series in metrics.SERIES.values():
        assert series.metric.startswith("vllm_mamba_fix_") and not series.metric.endswith("_total")
    # One help text per metric name: MultiProcessCollector keeps the first it reads.
    helps: dict[str, set[str]] = {}
    for series in metrics.SERIES.values():
        helps.setdefault(series.metric, set()).add(series.help)
    assert all(len(texts) == 1 for texts in helps.values())


CHILDREN = """
pids.append(run("spawn", through_counters, 3))
pids.append(run("fork", direct, [["collapses_prevented", 2], ["speculative_stalls_released", 4],
                                  ["stalls_ended", 1]]))
"""
CHILD_COUNTS = {
    "collapses_prevented": 3 + 2,
    "stalls_detected": 1,
    "speculative_stalls_released": 4,
    "stalls_ended": 1,
}


def _check_children(result: dict[str, Any]) -> None:
    assert result["samples"] == _expected(CHILD_COUNTS)
    assert set(result["types"].values()) == {"counter"}
    # One file per child under its own name; the parent counted nothing and wrote none.
    assert result["files"] == sorted(f"{metrics.FILE_PREFIX}{pid}.db" for pid in result["pids"])


def _release_env(release_path: str | None, **extra: str) -> tuple[dict[str, str], dict[str, Any]]:
    plan: dict[str, Any] = {"attach": True, "through_vllm": True}
    if release_path is None:
        return _clean_env(**extra), plan
    plan["vllm_under"] = release_path.split(os.pathsep)[0]
    return _clean_env(PYTHONPATH=release_path, **extra), plan


def test_children_reach_vllms_multiprocess_registry(
    tmp_path: Path, release_path: str | None
) -> None:
    """vLLM's route for --api-server-count > 1 (or a user's PROMETHEUS_MULTIPROC_DIR)."""
    shared = tmp_path / "prom"
    shared.mkdir()
    env, plan = _release_env(release_path, PROMETHEUS_MULTIPROC_DIR=str(shared))
    result = _run(tmp_path, CHILDREN, plan, env)
    _check_children(result)
    assert result["dir"] == str(shared)
    assert result["private"] is None  # attach() leaves vLLM's directory alone


def test_a_prometheus_client_metric_in_the_same_process_keeps_its_file(tmp_path: Path) -> None:
    shared = tmp_path / "prom"
    shared.mkdir()
    body = 'pids.append(run("spawn", beside_prometheus_client, 50))'
    env = _clean_env(PROMETHEUS_MULTIPROC_DIR=str(shared))
    result = _run(tmp_path, body, {"through_vllm": True}, env)
    assert result["samples"] == {
        "other_things_total{}": 150.0,
        _key(metrics.SERIES["chunks_realigned"]): 50.0,
    }
    pid = result["pids"][0]
    assert result["files"] == sorted([f"counter_{pid}.db", f"{metrics.FILE_PREFIX}{pid}.db"])


def test_children_reach_the_api_servers_registry(tmp_path: Path, release_path: str | None) -> None:
    """The default single API server: vLLM serves the global REGISTRY of its own process."""
    env, plan = _release_env(release_path)
    result = _run(tmp_path, CHILDREN, plan, env)
    _check_children(result)
    assert result["dir"] == result["private"]
    assert not Path(result["private"]).exists()  # removed when the API server exited


def test_an_inherited_private_dir_is_replaced(tmp_path: Path) -> None:
    """A program that loaded the plugin, then started ``vllm serve``: the server reads its own."""
    stale = tmp_path / "stale"
    stale.mkdir()
    result = _run(tmp_path, CHILDREN, {"attach": True}, _clean_env(**{metrics.ENV_DIR: str(stale)}))
    _check_children(result)
    assert result["private"] != str(stale)
    assert list(stale.iterdir()) == []


def test_a_damaged_file_never_fails_the_scrape(tmp_path: Path) -> None:
    """vLLM's /metrics handler collects the plugin's collector: it must not raise there."""
    body = """
    pids.append(run("spawn", direct, [["stalls_ended", 2]]))
    bad = os.path.join(os.environ[metrics.ENV_DIR], "counter_damaged.db")
    import struct
    with open(bad, "wb") as fh:  # one entry whose key is not UTF-8: prometheus_client raises
        fh.write(struct.pack("i", 10**6) + bytes(4) + struct.pack("i", 8) + b"\\xff" * 28)
    from prometheus_client.multiprocess import MultiProcessCollector
    try:
        MultiProcessCollector.merge([bad])
        raise SystemExit("the damaged file did not make prometheus_client raise")
    except UnicodeDecodeError:
        pass
    """
    result = _run(tmp_path, body, {"attach": True, "through_vllm": True}, _clean_env())
    assert result["samples"] == _expected({"stalls_ended": 2})
    assert "counter_damaged.db" in result["files"]


def test_prepare_makes_every_series_at_zero(tmp_path: Path) -> None:
    body = 'pids.append(run("spawn", direct, []))'
    result = _run(tmp_path, body, {"attach": True}, _clean_env())
    assert result["samples"] == _expected({})
    assert set(result["types"]) == {s.metric for s in metrics.SERIES.values()}


def test_a_forked_child_writes_its_own_file(tmp_path: Path) -> None:
    """The serving process counts in memory; its child counts to a file, then forks one more
    that counts too: the grandchild must open a file of its own, not write to its parent's."""
    body = """
    metrics.count("chunks_realigned", 5)
    pids.append(run("spawn", fork_after_counting, 7, 11))
    """
    result = _run(tmp_path, body, {"attach": True}, _clean_env())
    assert result["samples"] == _expected({"chunks_realigned": 5 + 7 + 11})
    assert len(result["files"]) == 2, result["files"]
    assert f"{metrics.FILE_PREFIX}{result['pids'][0]}.db" in result["files"]


def test_the_serving_process_writes_no_file(tmp_path: Path) -> None:
    """attach() names the directory; only an engine core that counts makes it."""
    body = 'metrics.prepare()\nmetrics.count("stalls_detected", 3)'
    result = _run(tmp_path, body, {"attach": True}, _clean_env())
    assert result["samples"] == _expected({"stalls_detected": 3})
    assert result["private"] and result["dir"] is None and result["files"] == []


def test_concurrent_counts_are_exact(tmp_path: Path) -> None:
    body = 'pids.append(run("spawn", threads, 8, 3000))'
    result = _run(tmp_path, body, {"attach": True}, _clean_env())
    assert result["samples"] == _expected({"stalls_ended": 8 * 3000, "block_rule_chunks": 8 * 6000})


def test_an_engine_in_this_process_is_served_here(tmp_path: Path) -> None:
    """No API server attached (in-process engine): counts still reach this REGISTRY."""
    body = 'metrics.count("stalls_detected", 2)\npids.append(os.getpid())'
    result = _run(tmp_path, body, {"attach": False}, _clean_env())
    assert result["samples"] == {_key(metrics.SERIES["stalls_detected"]): 2.0}
    assert result["private"] is None  # nothing exported to children


BLOCKED = """
import importlib.abc, logging, os, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "prometheus_client" or name.startswith("prometheus_client."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, Blocker())
logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s %(message)s")
from vllm_mamba_fix.observe import counters, metrics
from vllm_mamba_fix.decide.decision import Action
metrics.attach()
metrics.prepare()
for _ in range(3):
    metrics.count("collapses_prevented")
counters.record(Action.COLLAPSE_PREVENTED, "req-1", 256, 256, 256)
counters.record_stall_ended()
support = metrics.support()
print("RESULT", support.available, support.reason)
print("RESULT stats", counters.stats()["collapses_prevented"], counters.stats()["stalls_ended"])
print("RESULT env", os.environ.get(metrics.ENV_DIR))
print("RESULT imported", "prometheus_client" in sys.modules)
"""


def test_without_prometheus_client_nothing_raises(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-c", BLOCKED],
        capture_output=True,
        text=True,
        env=_clean_env(),
        cwd=tmp_path,
        timeout=120,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "Traceback" not in output, output
    assert "RESULT False prometheus_client is not importable" in output
    assert "RESULT stats 1 1" in output  # the plugin's own counters still count
    assert "RESULT env None" in output and "RESULT imported False" in output
    said = [
        line
        for line in output.splitlines()
        if "vllm.mamba_fix" in line and "prometheus_client" in line and not line.startswith("DEBUG")
    ]
    assert len(said) == 1 and said[0].startswith("INFO"), output


# --------------------------------------------------------------------------- housekeeping


@pytest.mark.parametrize("attention_only", [True, False], ids=["no-mamba-groups", "hybrid"])
def test_only_a_scheduler_with_mamba_groups_prepares_the_series(
    tmp_path: Path, attention_only: bool
) -> None:
    """Issue 27: a non-hybrid model's engine core makes no directory and no series.

    The child builds vLLM's real ``Scheduler`` with the plugin loaded the engine's way; the
    API-server parent reads vLLM's own registry. The hybrid run is the control: the same
    build prepares every series at 0 in a file of its own.
    """
    body = f'pids.append(start_held("spawn", build_scheduler, {attention_only}))'
    env = _clean_env(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    result = _run(tmp_path, body, {"attach": True, "through_vllm": True}, env)
    if attention_only:
        assert result["samples"] == {} and result["types"] == {}
        assert result["dir"] is None and result["files"] == []
        assert result["private"]  # attach() named one; no engine core made it
        assert not list(_tmpdir(tmp_path).glob("vllm-mamba-fix-metrics-*"))
    else:
        # Issue 37: the labels vLLM's own series carry, and the engine core's gauges.
        engine = json.loads((_tmpdir(tmp_path) / "engine.json").read_text())
        labels = {"engine": "0", "model_name": engine["model_name"]}
        info = [k for k in result["samples"] if k.startswith("vllm_mamba_fix_info{")]
        assert len(info) == 1 and result["samples"].pop(info[0]) == 1.0, info
        found = json.loads(info[0][len("vllm_mamba_fix_info") :])
        assert {k: found.pop(k) for k in ("engine", "model_name")} == labels
        assert found["version"] == vllm_mamba_fix_version and found["scope"] == "multimodal"
        assert "split" in found["rules"].split(",") and found["scheduler"].endswith("Scheduler")
        assert result["samples"] == {
            **_expected({}, labels),
            **_gauges(labels, engine["mamba"], engine["split"], 0, 0.0),
        }
        assert engine["mamba"] and engine["split"]  # both read: the gauges are not 0s
        assert result["types"]["vllm_mamba_fix_info"] == "gauge"
        pid = result["pids"][0]
        assert result["held_gauge_files"] == [f"{GAUGE_FILE_PREFIX}{pid}.db"]
        # Exited: its gauge file went with it (a dead engine's gauges do not linger).
        assert result["files"] == [f"{metrics.FILE_PREFIX}{pid}.db"]


def _proc_start(pid: int) -> int:
    """proc(5) field 22 of ``pid``: its start, in clock ticks since boot."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rindex(")") + 2 :].split()[19])


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _boot() -> str:
    """This boot, as the directory names carry it: the boot id's first 16 hex digits."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:16]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not Path(f"/proc/{proc.pid}").exists()
    return proc.pid


def _private(
    tmp: Path,
    name: str,
    writers: tuple[int, ...] = (),
    other: str = "",
    gauges: tuple[int, ...] = (),
) -> Path:
    path = tmp / f"vllm-mamba-fix-metrics-{name}"
    path.mkdir(mode=0o700)
    for pid in writers:
        (path / f"{metrics.FILE_PREFIX}{pid}.db").write_bytes(b"\0" * 16)
    for pid in gauges:
        (path / f"{GAUGE_FILE_PREFIX}{pid}.db").write_bytes(b"\0" * 16)
    if other:
        (path / other).write_text("not the plugin's")
    return path


SWEEP_PARENT = """
import json, os, sys
from vllm_mamba_fix.observe import metrics
metrics.attach()
metrics.attach()  # once per process
print("RESULT " + json.dumps({"pid": os.getpid(), "private": os.environ.get(metrics.ENV_DIR)}))
"""


def _attach_in_a_server(tmp: Path, **extra: str) -> dict[str, Any]:
    env = _clean_env(TMPDIR=str(tmp), **extra)
    run = subprocess.run([sys.executable, "-c", SWEEP_PARENT], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=120)  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "Traceback" not in output, output
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc")
def test_attach_sweeps_only_the_directories_of_gone_servers(tmp_path: Path) -> None:
    """Issue 27: a server killed before its atexit left its private directory behind; the
    next server's attach() removes such directories, and nothing else."""
    tmp = _tmpdir(tmp_path)
    ns, dead, dead_writer = _pid_namespace(), _dead_pid(), _dead_pid()
    here = f"{ns}-{_boot()}"  # this pid namespace and boot
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        live_start, zombie_start = _proc_start(live.pid), _proc_start(zombie.pid)
        zombie.kill()  # not reaped until after the sweep: a zombie
        for _ in range(100):
            if Path(f"/proc/{zombie.pid}/stat").read_text().split(") ")[1].startswith("Z"):
                break
            time.sleep(0.05)
        gone = {  # must be removed
            "server gone": _private(tmp, f"{dead}-{live_start}-{here}-0123456789ab", (dead,)),
            "start unknown, server gone": _private(tmp, f"{dead}-0-{here}-0123456789ab"),
            "pid reused by another process": _private(
                tmp, f"{live.pid}-{live_start + 1}-{here}-0123456789ab", (dead_writer,)
            ),
            "server a zombie": _private(tmp, f"{zombie.pid}-{zombie_start}-{here}-0123456789ab"),
            "server gone, with gauges": _private(
                tmp, f"{dead}-{live_start}-{here}-0123456789ac", (dead,), gauges=(dead,)
            ),
        }
        shared = _private(tmp, f"{dead}-{live_start}-{here}-000000000000", (dead,))
        kept = {  # must stay, with everything in them
            "server alive": _private(
                tmp, f"{live.pid}-{live_start}-{here}-0123456789ab", (live.pid, dead_writer)
            ),
            "start unknown, pid alive": _private(tmp, f"{live.pid}-0-{here}-0123456789ab"),
            "server gone, an engine core alive": _private(
                tmp, f"{dead}-0-{here}-abcdefabcdef", (dead_writer, live.pid)
            ),
            "a file not the plugin's": _private(
                tmp, f"{dead}-0-{here}-111111111111", (dead,), "x.db"
            ),
            "0.4.0 name, server gone": _private(tmp, f"{dead}-0123456789ab", (dead_writer,)),
            "another pid namespace": _private(
                tmp, f"{dead}-{live_start}-{ns + 1}-{_boot()}-0123456789ab"
            ),
            "server gone, an engine core's gauges alive": _private(
                tmp, f"{dead}-0-{here}-abcdefabcdee", (dead_writer,), gauges=(live.pid,)
            ),
            "not the plugin's name": _private(tmp, f"{dead}-0123456789ab-old", (dead,)),
            "PROMETHEUS_MULTIPROC_DIR": shared,
        }
        if os.getuid() == 0:  # root can make another user's directory
            other = _private(tmp, f"{dead}-0-{here}-222222222222", (dead,))
            kept["another user's"] = other
            os.chown(other, 12345, 12345)
        target = _private(tmp, f"{dead}-0-{here}-333333333333-target", (dead,))
        link = tmp / f"vllm-mamba-fix-metrics-{dead}-0-{here}-444444444444"
        link.symlink_to(target, target_is_directory=True)
        before = {name: sorted(p.iterdir()) for name, p in kept.items()}
        result = _attach_in_a_server(tmp, PROMETHEUS_MULTIPROC_DIR=str(shared))
        assert [name for name, path in gone.items() if path.exists()] == []
        assert {name: sorted(p.iterdir()) for name, p in kept.items() if p.exists()} == before
        assert link.is_symlink() and sorted(target.iterdir()) == [
            target / f"{metrics.FILE_PREFIX}{dead}.db"
        ]
        assert result["private"] is None  # vLLM's directory is used, as before
        # attach() names its own directory so that a later start can tell it is alive.
        result = _attach_in_a_server(tmp)
        pid, start, namespace, boot, token = Path(result["private"]).name.split("-")[4:]
        assert (int(pid), int(namespace), boot, len(token)) == (result["pid"], ns, _boot(), 12)
        assert int(start) >= _proc_start(os.getpid())  # it started after this test did
    finally:
        for proc in (live, zombie):
            proc.kill()
            proc.wait()


def test_the_sweep_never_raises(tmp_path: Path) -> None:
    """A temporary directory that is missing, or holds an unreadable match: nothing removed."""
    from vllm_mamba_fix.observe import metrics_sweep

    assert metrics_sweep.sweep(directory=str(tmp_path / "missing")) == []
    here = f"{_pid_namespace()}-{_boot()}"
    broken = tmp_path / f"vllm-mamba-fix-metrics-{_dead_pid()}-0-{here}-0123456789ab"
    broken.symlink_to(tmp_path / "nowhere")  # a dangling link with the plugin's name
    huge = _private(tmp_path, f"9999999999-1-{here}-0123456789ab")  # beyond a C int: cannot tell
    assert metrics_sweep.sweep(directory=str(tmp_path)) == []
    assert broken.is_symlink() and huge.is_dir()


KILLED_SERVER = """
import multiprocessing as mp, os, sys, time
from vllm_mamba_fix.observe import metrics

def engine_core():
    metrics.prepare()
    metrics.count("stalls_ended", 3)

if __name__ == "__main__":
    metrics.attach()
    proc = mp.get_context("spawn").Process(target=engine_core)
    proc.start()
    proc.join(60)
    print("DIR", os.environ[metrics.ENV_DIR], flush=True)
    time.sleep(600)  # serving, until killed
"""


def test_a_killed_servers_directory_is_swept_by_the_next_start(tmp_path: Path) -> None:
    """Real processes, vLLM's registry: a server killed with SIGKILL keeps its directory (no
    atexit); a server that starts while it lives leaves it alone; one that starts after it
    is gone removes it, and serves its own engine cores' counts."""
    tmp = _tmpdir(tmp_path)
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SERVER)
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env=_clean_env(TMPDIR=str(tmp)), cwd=REPO)  # fmt: skip
    try:
        line = server.stdout.readline() if server.stdout else ""
        assert line.startswith("DIR "), line
        leftover = Path(line.split(" ", 1)[1].strip())
        files = sorted(leftover.iterdir())
        assert len(files) == 1 and files[0].name.startswith(metrics.FILE_PREFIX)
        result = _run(tmp_path, CHILDREN, {"attach": True, "through_vllm": True}, _clean_env())
        _check_children(result)  # only its own children's counts
        assert sorted(leftover.iterdir()) == files  # the live server's directory is kept
    finally:
        server.kill()
        server.wait()
    assert sorted(leftover.iterdir()) == files  # SIGKILL: no atexit, the directory stays
    result = _run(tmp_path, CHILDREN, {"attach": True, "through_vllm": True}, _clean_env())
    _check_children(result)
    assert not leftover.exists()
    # Both later servers removed their own at exit.
    assert not list(tmp.glob("vllm-mamba-fix-metrics-*"))


# ------------------------------------------------------------------ issue 37: labels, gauges

ENGINE_CORES = """
pids.append(start_held("spawn", engine_core, 0, [["collapses_prevented", 2]], [1, 1000.0], ""))
pids.append(start_held("spawn", engine_core, 1, [["collapses_prevented", 3],
                                                 ["stalls_detected", 1]], [2, 2000.0], ""))
"""


def _engine(rank: int) -> dict[str, str]:
    return {"engine": str(rank), "model_name": "m"}


def _info(rank: int) -> str:
    labels = {**_engine(rank), "rules": "split", "version": "v"}
    return "vllm_mamba_fix_info" + json.dumps(labels, sort_keys=True)


@pytest.mark.parametrize("route", ["shared", "private"])
def test_each_engine_core_has_its_own_labels(tmp_path: Path, route: str) -> None:
    """Two engine cores (DP ranks 0 and 1) alive while /metrics is read: each one's counters
    and gauges under its own ``engine`` label; a total over the labels is the old sum."""
    extra = {}
    if route == "shared":
        (tmp_path / "prom").mkdir()
        extra = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom")}
    result = _run(
        tmp_path, ENGINE_CORES, {"attach": True, "through_vllm": True}, _clean_env(**extra)
    )
    expected = {
        **_expected({"collapses_prevented": 2}, _engine(0)),
        **_expected({"collapses_prevented": 3, "stalls_detected": 1}, _engine(1)),
        **_gauges(_engine(0), 16, 256, 1, 1000.0),
        **_gauges(_engine(1), 16, 256, 2, 2000.0),
        _info(0): 1.0,
        _info(1): 1.0,
    }
    assert result["samples"] == expected
    collapses = [v for k, v in result["samples"].items() if '"action": "collapse-prevented"' in k]
    assert len(collapses) == 2 and sum(collapses) == 5  # the sum the unlabelled series had
    assert result["types"]["vllm_mamba_fix_stalled_requests"] == "gauge"
    assert result["types"]["vllm_mamba_fix_corrections"] == "counter"
    assert len(result["held_gauge_files"]) == 2
    assert not [f for f in result["files"] if f.startswith("gauge_")]  # removed at their exit


KILLED_THEN_RESTARTED = """
pids.append(run("spawn", engine_core, 0, [["stalls_ended", 1]], [3, 100.0], "kill", exitcode=-9))
pids.append(start_held("spawn", engine_core, 0, [["stalls_ended", 1]], [0, 0.0], ""))
"""


def test_a_killed_engine_cores_gauge_does_not_add_to_the_next(tmp_path: Path) -> None:
    """A ``PROMETHEUS_MULTIPROC_DIR`` nobody wiped keeps a killed engine core's gauge file;
    the next engine core of the same labels writes later, and "mostrecent" shows its value
    (a "livesum" gauge would show 3 stalls that no longer stand)."""
    (tmp_path / "prom").mkdir()
    env = _clean_env(PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "prom"))
    result = _run(tmp_path, KILLED_THEN_RESTARTED, {"through_vllm": True}, env)
    assert result["samples"] == {
        **_expected({"stalls_ended": 2}, _engine(0)),  # counts add up, as prometheus_client's
        **_gauges(_engine(0), 16, 256, 0, 0.0),
        _info(0): 1.0,
    }
    assert f"{GAUGE_FILE_PREFIX}{result['pids'][0]}.db" in result["files"]  # left by the kill


def test_a_killed_engine_cores_gauges_are_not_served(tmp_path: Path) -> None:
    """The API server's own reader (one API server) skips the gauge file of a process that is
    gone: its counts stay, its stalls no longer stand."""
    body = 'pids.append(run("spawn", engine_core, 1, [], [3, 100.0], "kill", exitcode=-9))'
    result = _run(tmp_path, body, {"attach": True, "through_vllm": True}, _clean_env())
    assert result["samples"] == _expected({}, _engine(1))
    assert f"{GAUGE_FILE_PREFIX}{result['pids'][0]}.db" in result["files"]
