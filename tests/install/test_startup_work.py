"""Issue 45 item 4: what ``register()`` does at start-up, checked by what it leaves behind.

Not timed (speed targets live in benchmarks/, section 4): each test runs ``register()`` in a
fresh process, as vLLM's ``load_general_plugins()`` does, and looks at what it loaded and
read. With no scope rule installed, pluggy is never imported; vLLM's code is read once per
class from its code objects' lines, without ``inspect.getsource`` (which tokenizes the file),
and ``schedule()`` is not parsed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import InstallScopeRule
from vllm_mamba_fix import hookspecs
from vllm_mamba_fix.decide import scope

REPO = Path(__file__).resolve().parents[2]

# Runs in a fresh process: vLLM imported (the scheduler too, or not), then the entry point.
# inspect.getsource (called by the plugin) and the evidence reader are counted, not replaced.
PROBE = """
import inspect, json, sys
import vllm
if sys.argv[1] == "imported":
    import vllm.v1.core.sched.scheduler
import ast
getsource, parse = inspect.getsource, ast.parse
counts = {"getsource": 0, "read_evidence": 0, "parsed_lines": 0}

def counting_getsource(obj):
    # The plugin's calls only: importing vLLM's scheduler (the hook case) calls it too.
    caller = sys._getframe(1).f_globals.get("__name__", "")
    counts["getsource"] += caller.startswith("vllm_mamba_fix")
    return getsource(obj)

inspect.getsource = counting_getsource

def counting_parse(source, *args, **kwargs):
    # The lines of code the plugin parses (vLLM's schedule() is 800 lines).
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if caller.startswith("vllm_mamba_fix"):
        counts["parsed_lines"] += source.count(chr(10)) + 1
    return parse(source, *args, **kwargs)

ast.parse = counting_parse
import vllm_mamba_fix
from vllm_mamba_fix.facts import evidence
read_evidence = evidence.read_evidence

def counting_read(cls):
    counts["read_evidence"] += 1
    return read_evidence(cls)

evidence.read_evidence = counting_read  # before the patcher, which imports it, is imported
assert "vllm_mamba_fix.install.patch" not in sys.modules
vllm_mamba_fix.register()
loaded = sorted(m for m in sys.modules if m.startswith("vllm_mamba_fix"))
import vllm.v1.core.sched.scheduler as module
patched = sorted(m for m in sys.modules if m.startswith("vllm_mamba_fix"))
from tools.sched_harness import split_is_wrapped
import dataclasses
record = vllm_mamba_fix.records()[0]
built = sorted(f"{name}.{key}" for name in patched for key, value in vars(sys.modules[name]).items()
               if isinstance(value, type) and value.__module__ == name
               and dataclasses.is_dataclass(value))
print(json.dumps({**counts, "loaded": loaded, "patched_loaded": patched, "dataclasses": built,
                  "pluggy": "pluggy" in sys.modules,
                  "patched": split_is_wrapped(),
                  "problem": record.evidence.problem,
                  "split_after_encoder": record.evidence.split_after_encoder}))
"""


def _probe(case: str, env: dict[str, str] | None = None) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, case], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["imported", "hook"])
def test_register_reads_the_scheduler_once_and_leaves_pluggy_alone(case: str) -> None:
    found = _probe(case)
    assert found["patched"] is True, found
    # Read, not unknown (its value per release: tests/scheduler/test_evidence.py).
    assert found["problem"] is None and found["split_after_encoder"] in (True, False), found
    assert found["pluggy"] is False, found  # no scope rule installed: no manager to build
    assert found["read_evidence"] == 1, found  # the base, once (its settling reuses it)
    assert found["getsource"] == 0, found  # read from the code objects' line spans
    # schedule()'s calls are read from the lines its code runs, not parsed (issue 45 item 4):
    # only _free_encoder_inputs (under 40 lines) is.
    assert 0 < found["parsed_lines"] < 60, found  # type: ignore[operator]
    # A dataclass generates about five functions from source when its module loads (a
    # NamedTuple one): none is built on the way to a patched scheduler.
    assert found["dataclasses"] == STARTUP_DATACLASSES, found["dataclasses"]
    # Patched, no scheduler built: nothing logs an active line yet.
    assert ACTIVE_LINE not in found["patched_loaded"], found["patched_loaded"]  # type: ignore[operator]
    if case == "hook":  # no scheduler yet: the rules, patcher and record wait for it
        assert not _deferred_loaded(found["loaded"]), found["loaded"]  # type: ignore[arg-type]
        # Not one rule module: the stream-end patch imports its two when a serving module is.
        assert not [m for m in found["loaded"] if ".rules" in m], found["loaded"]  # type: ignore[union-attr]


# The dataclasses of the modules loaded by register() and the patch (19 in 0.6.1, 2 in 0.6.2:
# the record of changes and the streak).
STARTUP_DATACLASSES: list[str] = []

# What only a built (or imported) scheduler or doctor needs.
DEFERRED = (
    "vllm_mamba_fix.rules.table",
    "vllm_mamba_fix.rules.split_rule",
    "vllm_mamba_fix.rules.wrappers",
    "vllm_mamba_fix.rules.stall_end",
    "vllm_mamba_fix.install.patch",
    "vllm_mamba_fix.install.active_line",
    "vllm_mamba_fix.observe.record",
    "vllm_mamba_fix.observe.mtp_tokens",
    "vllm_mamba_fix.decide.scope",
    "vllm_mamba_fix.doctor",
)
# Loaded by importing the entry point (the package's front door), out of the 46 that 0.5.0's
# front door loaded; a new module on the path must earn its place here.
MAX_LOADED_BY_ENTRY_POINT = 24
ACTIVE_LINE = "vllm_mamba_fix.install.active_line"  # imported where a line is logged
STREAM_END = "vllm_mamba_fix.install.stream_end"  # attached by register(), not by the import


def _deferred_loaded(loaded: list[str]) -> list[str]:
    return [m for m in loaded if m.startswith(DEFERRED)]


def test_the_entry_point_loads_only_what_register_needs() -> None:
    # A fresh interpreter, without vLLM: what ``import vllm_mamba_fix`` alone loads.
    code = (
        "import json, sys, vllm_mamba_fix\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('vllm_mamba_fix'))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert "vllm_mamba_fix.install.plugin" in loaded, loaded  # the probe saw the package
    assert not _deferred_loaded(loaded), loaded
    assert not [m for m in loaded if m.startswith(("vllm_mamba_fix.rules", STREAM_END))], loaded
    assert len(loaded) <= MAX_LOADED_BY_ENTRY_POINT, loaded


def test_an_installed_scope_rule_still_builds_the_manager(
    install_scope_rule: InstallScopeRule,
) -> None:
    install_scope_rule(
        "startup_scope",
        """
        from vllm_mamba_fix.hookspecs import hookimpl

        @hookimpl
        def mamba_fix_in_scope(request, scope):
            return None
        """,
    )
    assert scope.load_third_party_hook() is not None


def test_the_scope_group_is_named_once() -> None:
    assert scope.ENTRY_POINT_GROUP == hookspecs.ENTRY_POINT_GROUP
