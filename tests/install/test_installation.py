"""The record of changes (``vllm_mamba_fix/changes.py``) and ``unregister()``, its undo.

First the recorder itself, on plain objects: newest first and once, what each kind of change
restores, schedulers held weakly, an attribute the plugin did not set never overwritten.
Then the whole cycle on vLLM's real scheduler: ``register()`` with a private metrics
directory (so the /metrics collector and the variable are really made), a ``Scheduler`` and
an ``AsyncScheduler`` built on the harness's hybrid Mamba config, the two-image split run
through both, ``unregister()``, and the process as it was before ``register()``: the scheduler
classes' namespaces, ``sys.meta_path``, prometheus_client's ``REGISTRY``, ``os.environ`` and
the plugin's attributes of the live schedulers.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

import vllm_mamba_fix
from vllm_mamba_fix import _log, changes
from vllm_mamba_fix.changes import INSTANCE_TAG, Changes
from vllm_mamba_fix.facts.blocks import BLOCK_ATTR, SPLIT_ATTR
from vllm_mamba_fix.facts.config import METRICS_DIR_VAR, PROMETHEUS_DIR

PLUGIN_PREFIX = "_vllm_mamba_fix"
VARIABLE = "VLLM_MAMBA_FIX_TEST_CHANGES"


class Base:
    method = "base's"


class Target(Base):
    own = "stock"


class Instance:
    """A stand-in for a scheduler instance: an object with a namespace."""


# Each test's lines are said, whatever an earlier test said once.
pytestmark = pytest.mark.usefixtures("session")


def _warnings(log: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in log.records if r.levelno >= logging.WARNING]


# -- the recorder -----------------------------------------------------------------------------


def test_undo_reverts_newest_first_and_only_once() -> None:
    changes = Changes()
    reverted: list[int] = []
    for n in (1, 2, 3):
        changes.record("test", f"change {n}", lambda n=n: reverted.append(n))
    assert changes.undo() is True
    assert reverted == [3, 2, 1]
    assert changes.undo() is False
    assert reverted == [3, 2, 1]
    assert changes.changes() == []


def test_an_undo_that_fails_is_said_and_the_others_still_run(
    plugin_log: pytest.LogCaptureFixture,
) -> None:
    changes = Changes()
    reverted: list[str] = []

    def fail() -> None:
        raise RuntimeError("gone")

    changes.record("test", "first", lambda: reverted.append("first"))
    changes.record("test", "broken", fail)
    changes.record("test", "last", lambda: reverted.append("last"))
    assert changes.undo() is True
    assert reverted == ["last", "first"]
    assert any("could not undo broken (RuntimeError: gone)" in w for w in _warnings(plugin_log))


def test_a_class_attribute_is_restored_or_deleted_unless_someone_else_set_it() -> None:
    changes = Changes()
    changes.set_attr(Target, "own", "wrapped", "test")
    changes.set_attr(Target, "method", "wrapped", "test")  # inherited: not in Target's own dict
    assert (Target.own, Target.method) == ("wrapped", "wrapped")
    assert changes.changed(Target, "own") and not changes.changed(Base, "method")
    changes.undo()
    assert vars(Target)["own"] == "stock"
    assert "method" not in vars(Target) and Target.method == "base's"

    changes.set_attr(Target, "own", "wrapped", "test")
    Target.own = "another plugin's"  # assigned over the plugin's since
    changes.undo()
    assert Target.own == "another plugin's"
    Target.own = "stock"


def test_undo_where_reverts_only_what_it_accepts() -> None:
    changes = Changes()
    changes.set_attr(Target, "own", "a", "one")
    changes.set_attr(Base, "method", "b", "other")
    assert changes.undo(lambda c: c.tag == "one") is True
    assert Target.own == "stock" and Base.method == "b"
    assert [c.tag for c in changes.changes()] == ["other"]
    changes.undo()
    assert Base.method == "base's"


def test_a_variable_is_restored_or_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    changes = Changes()
    changes.set_env(VARIABLE, "first", "test")
    assert changes.set_env(VARIABLE, "first", "test") is None  # the same value: nothing new
    changes.set_env(VARIABLE, "second", "test")
    assert os.environ[VARIABLE] == "second"
    changes.undo()
    assert VARIABLE not in os.environ

    monkeypatch.setenv(VARIABLE, "inherited")
    changes.set_env(VARIABLE, "mine", "test")
    changes.undo()
    assert os.environ[VARIABLE] == "inherited"

    changes.set_env(VARIABLE, "mine", "test")
    os.environ[VARIABLE] = "the user's"  # set by someone else since
    changes.undo()
    assert os.environ[VARIABLE] == "the user's"


def test_an_item_put_first_comes_off_by_itself_or_with_the_undo() -> None:
    changes = Changes()
    items: list[Any] = ["vllm's"]
    first = changes.insert_first(items, "hook", "test", "a hook", "module")
    assert items == ["hook", "vllm's"]
    assert changes.revert(first) is True  # used up: off at once
    assert items == ["vllm's"]
    assert changes.revert(first) is False
    changes.insert_first(items, "hook", "test", "a hook", "module")
    assert changes.undo() is True
    assert items == ["vllm's"]


def test_instances_are_held_weakly() -> None:
    changes = Changes()
    instance = Instance()
    assert changes.set_on(instance, "_plugin_state", [1])
    alive = weakref.ref(instance)
    del instance
    gc.collect()
    assert alive() is None  # the record did not keep it alive
    survivor = Instance()
    assert changes.set_on(survivor, "_plugin_state", [2])
    # The dead instance's entry is gone; the survivor's is the one left.
    assert len(changes.changes(INSTANCE_TAG)) == 1
    changes.undo()
    assert "_plugin_state" not in vars(survivor)


def test_the_plugins_attributes_are_deleted_from_live_instances() -> None:
    changes = Changes()
    first, second = Instance(), Instance()
    assert changes.set_on(first, "_a", 1)
    assert changes.set_on(first, "_a", 2)  # its own: set again
    assert changes.set_on(second, "_b", 3)
    assert changes.owns(first, "_a") and changes.owns(second, "_b")
    assert changes.undo() is True
    assert vars(first) == {} and vars(second) == {}
    assert not changes.owns(first, "_a")
    assert changes.set_on(first, "_a", 4)  # a new registration may set it again
    changes.undo()


def test_an_attribute_the_plugin_did_not_set_is_never_overwritten(
    plugin_log: pytest.LogCaptureFixture,
) -> None:
    changes = Changes()
    instance = Instance()
    vars(instance)["_a"] = "theirs"
    assert changes.set_on(instance, "_a", "mine") is False
    assert changes.set_on(instance, "_a", "mine") is False
    assert vars(instance) == {"_a": "theirs"}
    changes.undo()
    assert vars(instance) == {"_a": "theirs"}  # not the plugin's, so not deleted
    refused = [w for w in _warnings(plugin_log) if "_a of a" in w]
    assert len(refused) == 1, refused  # said once
    assert "the plugin did not set it" in refused[0]


# -- register() and unregister() on the real scheduler ----------------------------------------


@pytest.fixture
def fresh_process(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No plugin, no metrics directories set, temporary files under ``tmp_path``."""
    pytest.importorskip("vllm")
    pytest.importorskip("prometheus_client")
    for name in (PROMETHEUS_DIR, METRICS_DIR_VAR, "VLLM_MAMBA_FIX", "VLLM_MAMBA_FIX_SCOPE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the private directory's parent
    vllm_mamba_fix.unregister()
    yield
    vllm_mamba_fix.unregister()


def _snapshot(classes: tuple[type, ...]) -> dict[str, Any]:
    from prometheus_client import REGISTRY

    return {
        "classes": {cls: dict(vars(cls)) for cls in classes},
        "meta_path": list(sys.meta_path),
        "collectors": set(REGISTRY._collector_to_names),
        "environ": dict(os.environ),
    }


def _differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    found = []
    for cls, was in before["classes"].items():
        now = after["classes"][cls]
        name = cls.__qualname__
        found += [f"{name}.{key} added" for key in now.keys() - was.keys()]
        found += [f"{name}.{key} removed" for key in was.keys() - now.keys()]
        replaced = [key for key in was.keys() & now.keys() if now[key] is not was[key]]
        found += [f"{name}.{key} replaced" for key in replaced]
    was, now = before["meta_path"], after["meta_path"]
    if len(was) != len(now) or any(a is not b for a, b in zip(was, now, strict=False)):
        found.append(f"sys.meta_path: {was} -> {now}")
    if before["collectors"] != after["collectors"]:
        found.append(f"REGISTRY: {before['collectors'] ^ after['collectors']}")
    if before["environ"] != after["environ"]:
        changed = before["environ"].items() ^ after["environ"].items()
        found.append(f"os.environ: {sorted(changed)}")
    return found


def _plugin_attributes(scheduler: Any) -> set[str]:
    return {name for name in vars(scheduler) if name.startswith(PLUGIN_PREFIX)}


def test_unregister_leaves_the_process_as_it_was_before_register(
    fresh_process: None, tmp_path: Any
) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from tools import scenarios as sc
    from tools import sched_harness as harness

    classes = (Scheduler, AsyncScheduler)
    modes = (harness.SYNC, harness.ASYNC)
    for mode in modes:  # vLLM's own set-up of the process (its platform's variables) first
        harness.Harness(mode.apply(sc.TWO_IMAGES.config))
    before = _snapshot(classes)
    vllm_mamba_fix.register()
    registered = _snapshot(classes)
    # What register() changed, so that the comparison after the undo can fail.
    assert harness.split_is_wrapped()
    assert registered["collectors"] - before["collectors"], "no collector on the REGISTRY"
    assert registered["environ"][METRICS_DIR_VAR].startswith(str(tmp_path))
    schedulers = []
    for mode in modes:
        h = harness.Harness(mode.apply(sc.TWO_IMAGES.config))
        h.add(*sc.TWO_IMAGES.requests)
        result = h.run()
        assert not result.stalled and result.finished == {"two-images"}, (mode, result)
        assert {BLOCK_ATTR, SPLIT_ATTR} <= _plugin_attributes(h.scheduler), mode
        schedulers.append(h.scheduler)
    assert [type(s) for s in schedulers] == [Scheduler, AsyncScheduler]
    assert vllm_mamba_fix.records()

    assert vllm_mamba_fix.unregister() is True
    assert _differences(before, _snapshot(classes)) == []
    assert [_plugin_attributes(s) for s in schedulers] == [set(), set()]
    assert vllm_mamba_fix.records() == ()
    assert vllm_mamba_fix.unregister() is False  # once

    # register() works again, and its undo again leaves nothing behind.
    vllm_mamba_fix.register()
    assert harness.split_is_wrapped()
    assert _differences(before, _snapshot(classes)) != []
    assert vllm_mamba_fix.unregister() is True
    assert _differences(before, _snapshot(classes)) == []


def test_an_inherited_metrics_directory_is_given_back(
    fresh_process: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A program that loaded the plugin and then serves: attach() names its own directory;
    unregister() gives the inherited name back."""
    inherited = str(tmp_path / "inherited")
    monkeypatch.setenv(METRICS_DIR_VAR, inherited)
    vllm_mamba_fix.register()
    assert os.environ[METRICS_DIR_VAR] not in ("", inherited)
    vllm_mamba_fix.unregister()
    assert os.environ[METRICS_DIR_VAR] == inherited


def test_the_session_logs_as_the_logger_module_does() -> None:
    """changes.py imports nothing of the plugin: its logger and field prefix are _log's."""
    assert changes._logger is _log.logger
    assert changes._FIELD_PREFIX == _log.FIELD_PREFIX
