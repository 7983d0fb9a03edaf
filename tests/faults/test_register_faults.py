"""register() under faults: it never raises, says one clear line, and leaves vLLM alone.

Each case runs the real plugin against a fake vLLM tree (see conftest); the
import-level cases that need a fresh interpreter are in test_subprocess_faults.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import pytest

from tests.active_line import parse_active
from tests.conftest import facts_of
from tests.faults.conftest import (
    BLOCK,
    FIXED_SCHEDULER,
    METHOD,
    STOCK_SCHEDULER,
    FakeRequest,
    FakeVllm,
    LogCapture,
    is_patched,
    original_function,
    scheduler_method,
    split_as_vllm,
)
from tools import sched_harness as harness
from vllm_mamba_fix import register, unregister
from vllm_mamba_fix.decide.policy import Rule
from vllm_mamba_fix.decide.scope import ScopePolicy
from vllm_mamba_fix.facts import targets, versions
from vllm_mamba_fix.install import import_hook, patch, plugin
from vllm_mamba_fix.observe import record
from vllm_mamba_fix.observe.record import MethodState
from vllm_mamba_fix.rules import split_rule

FakeFactory = Callable[..., FakeVllm]


def _active_lines(logs: LogCapture) -> list[str]:
    """The per-class active lines; vLLM building a scheduler logs its class's."""
    return [line for line in logs.visible if " active: " in line]


def _assert_one_warning(logs: LogCapture, *needles: str) -> str:
    """Exactly one visible line, a warning, containing every needle; no traceback."""
    logs.assert_no_traceback()
    assert len(logs.visible) == 1, logs.visible
    assert len(logs.warnings) == 1, logs.warnings
    line = logs.warnings[0]
    for needle in needles:
        assert needle in line, (needle, line)
    return line


# ------------------------------------------------------------------ vLLM missing


def test_vllm_not_importable_in_process(
    monkeypatch: pytest.MonkeyPatch, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    register()
    _assert_one_warning(logs, "vLLM is not importable (ModuleNotFoundError)", "doing nothing")
    assert import_hook.pending_hook() is None
    assert not any(isinstance(f, import_hook.PostImportHook) for f in sys.meta_path)


# ------------------------------------------------------- scheduler import fails


class VllmOwnError(RuntimeError):
    pass


def test_scheduler_import_error_propagates_unchanged(
    monkeypatch: pytest.MonkeyPatch, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    """vLLM's own import error reaches vLLM as the very same object, unwrapped."""
    holder = types.ModuleType("fault_holder")
    holder.exc = VllmOwnError("scheduler.py: something vLLM-internal broke")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fault_holder", holder)
    fake = fake_vllm(scheduler="import fault_holder\nraise fault_holder.exc\n")

    register()  # deferred: installs the import hook, must not raise
    assert isinstance(import_hook.pending_hook(), import_hook.PostImportHook)

    with pytest.raises(VllmOwnError) as excinfo:
        fake.import_scheduler()
    assert excinfo.value is holder.exc  # type: ignore[attr-defined]
    assert excinfo.value.__cause__ is None and excinfo.value.__context__ is None
    assert targets.SCHEDULER_MODULE not in sys.modules
    # The plugin adds nothing: no warning, no traceback, no "active" line.
    assert logs.visible == []
    logs.assert_no_traceback()


# ------------------------------------------------------------ unpatchable shapes

MISSING = """
class Scheduler:
    def schedule(self):
        return None
"""

RENAMED_PARAMETERS = """
class Scheduler:
    def _mamba_block_aligned_split(self, req, n, num_new_local_computed_tokens=0):
        return n
"""

SWAPPED_PARAMETERS = """
class Scheduler:
    def _mamba_block_aligned_split(self, num_new_tokens, request):
        return num_new_tokens
"""

VARARGS = """
class Scheduler:
    def _mamba_block_aligned_split(self, *args, **kwargs):
        return args[1]
"""

STATIC = """
class Scheduler:
    @staticmethod
    def _mamba_block_aligned_split(request, num_new_tokens):
        return num_new_tokens
"""

NOT_CALLABLE = """
class Scheduler:
    _mamba_block_aligned_split = 0
"""

WRAPPED_BY_OTHER = """
import functools


def traced(fn):
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        return fn(*args, **kwargs)
    return inner


class Scheduler:
    @traced
    def _mamba_block_aligned_split(self, request, num_new_tokens):
        return num_new_tokens
"""

NO_SCHEDULER_CLASS = """
SchedulerFactory = None
"""

UNPATCHABLE = {
    "missing": (MISSING, ("Scheduler._mamba_block_aligned_split does not exist",)),
    "renamed-parameters": (RENAMED_PARAMETERS, ("unexpected signature", "req, n")),
    "swapped-parameters": (SWAPPED_PARAMETERS, ("unexpected signature", "request, num_new")),
    "varargs": (VARARGS, ("unexpected signature",)),
    "staticmethod": (STATIC, ("staticmethod", "not a plain method")),
    "not-callable": (NOT_CALLABLE, ("not a plain method",)),
    "wrapped-by-another-library": (WRAPPED_BY_OTHER, ("already wrapped by another library",)),
    "no-scheduler-class": (NO_SCHEDULER_CLASS, ("has no Scheduler class",)),
}


@pytest.mark.parametrize("deferred", [False, True], ids=["imported-first", "imported-later"])
@pytest.mark.parametrize("case", sorted(UNPATCHABLE))
def test_unpatchable_target_is_left_alone(
    case: str,
    deferred: bool,
    logs: LogCapture,
    fake_vllm: FakeFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The split alone: no encoder rule on 0.23 with the watchdog off (the
    # encoder method's own faults: test_encoder_rule_faults.py).
    monkeypatch.setenv("VLLM_MAMBA_FIX_STALL_SECONDS", "off")
    source, needles = UNPATCHABLE[case]
    fake = fake_vllm(version="0.23.0", scheduler=source)
    if deferred:
        register()
        module = fake.import_module()
    else:
        module = fake.import_module()
        register()
    _assert_one_warning(logs, "not patching", *needles)
    scheduler = getattr(module, "Scheduler", None)
    if isinstance(scheduler, type):
        before = types.ModuleType("again")
        exec(compile(source, "again", "exec"), before.__dict__)
        assert not is_patched(scheduler)
        assert type(scheduler_method(scheduler)) is type(before.Scheduler.__dict__.get(METHOD))
    assert patch.changed_classes() == []
    # Asking again neither patches nor repeats the line.
    register()
    assert len(logs.visible) == 1, logs.visible


def test_already_patched_by_us_is_not_wrapped_again(
    logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    """A wrapper left by another copy of the plugin (say, a reloaded module)."""
    scheduler = fake_vllm().import_scheduler()
    original = scheduler_method(scheduler)
    options = split_rule.WrapOptions(
        prefill_gate=versions.PrefillGate.BEFORE_PREFILL_END,
        scope=ScopePolicy(plugin.load_settings().scope),
    )
    harness.wrap_split(scheduler, options)
    ours = scheduler_method(scheduler)

    register()
    assert scheduler_method(scheduler) is ours
    assert original_function(scheduler) is original
    logs.assert_no_traceback()
    assert logs.warnings == []
    assert [r for r in logs.records if "already active" in r.getMessage()], logs.text
    patch.undo(scheduler)


# -------------------------------------------------------- overriding subclasses

HPU_SCHEDULER = """
from vllm.v1.core.sched.scheduler import Scheduler


class AsyncScheduler(Scheduler):  # like vLLM's own: inherits the method
    pass


class HPUAsyncScheduler(AsyncScheduler):  # like vllm-gaudi's: overrides it
    def _mamba_block_aligned_split(
        self, request, num_new_tokens, num_new_local_computed_tokens=0,
        num_external_computed_tokens=0,
    ):
        return num_new_tokens
"""
HPU_NAME = "vllm.v1.core.sched.hpu_scheduler.HPUAsyncScheduler"


@pytest.mark.parametrize(
    "order",
    ["subclass-loaded-before-register", "register-then-subclass", "register-scheduler-subclass"],
)
def test_overriding_subclass_is_named(order: str, logs: LogCapture, fake_vllm: FakeFactory) -> None:
    """The base patch cannot reach an override: when vLLM builds it, say so, naming the class.

    In vLLM the platform's scheduler module is imported when the engine
    resolves the scheduler class, i.e. after register() and after the base
    scheduler module: the last two orders are the realistic ones.
    """
    fake = fake_vllm()
    fake.write("hpu_scheduler", HPU_SCHEDULER)
    if order == "subclass-loaded-before-register":
        fake.import_module("hpu_scheduler")
        register()
    elif order == "register-then-subclass":
        register()
        fake.import_module("hpu_scheduler")
    else:
        register()
        fake.import_module("scheduler")
        fake.import_module("hpu_scheduler")
    hpu = fake.import_module("hpu_scheduler")
    assert logs.warnings == []  # nothing is said about a class vLLM has not built
    hpu.HPUAsyncScheduler(BLOCK)
    hpu.HPUAsyncScheduler(BLOCK)

    logs.assert_no_traceback()
    assert len(logs.warnings) == 1, logs.visible
    assert HPU_NAME in logs.warnings[0] and METHOD in logs.warnings[0]
    assert "overridden" in logs.warnings[0]
    (active,) = _active_lines(logs)  # the encoder rules still reach it
    parsed = parse_active(active)
    assert parsed is not None and parsed.scheduler_class == HPU_NAME, active
    assert "split" not in parsed.rules, active
    (hpu_record,) = [r for r in record.records() if r.scheduler_class == HPU_NAME]
    assert hpu_record.method(METHOD).state is MethodState.OVERRIDDEN
    assert Rule.SPLIT in hpu_record.left_out
    assert is_patched(hpu.Scheduler)
    assert not is_patched(hpu.HPUAsyncScheduler)  # vllm-gaudi's own method is untouched
    assert hpu.AsyncScheduler.__dict__.get(METHOD) is None
    # Building vLLM's own subclass: it inherits the wrapper, no warning.
    hpu.AsyncScheduler(BLOCK)
    assert len(logs.warnings) == 1
    assert len(_active_lines(logs)) == 2


def test_unregister_restores_every_class(logs: LogCapture, fake_vllm: FakeFactory) -> None:
    fake = fake_vllm()
    fake.write("hpu_scheduler", HPU_SCHEDULER)
    scheduler = fake.import_scheduler()
    hpu = fake.import_module("hpu_scheduler")
    before = {cls: dict(vars(cls)) for cls in (scheduler, hpu.AsyncScheduler)}
    register()
    hpu.AsyncScheduler(BLOCK)
    assert record.records()
    unregister()
    assert {cls: dict(vars(cls)) for cls in before} == before
    assert record.records() == ()
    logs.clear()
    hpu.HPUAsyncScheduler(BLOCK)  # no check runs any more
    assert logs.visible == []


# --------------------------------------------------------------------- versions


@pytest.mark.parametrize("version", ["dev", "", "garbage", "0.27.x", "v0.27.1-cpu", None])
def test_unreadable_version_is_left_alone(
    version: object, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    fake = fake_vllm()
    fake.set_version(version)
    scheduler = fake.import_scheduler()
    register()
    _assert_one_warning(logs, "cannot read the vLLM version", "VLLM_MAMBA_FIX=force")
    assert not is_patched(scheduler)
    assert import_hook.pending_hook() is None


def test_missing_version_attribute(logs: LogCapture, fake_vllm: FakeFactory) -> None:
    fake = fake_vllm(version=None)
    scheduler = fake.import_scheduler()
    register()
    _assert_one_warning(logs, "cannot read the vLLM version")
    assert not is_patched(scheduler)


@pytest.mark.parametrize(
    ("version", "family"),
    [
        ("0.27.2.dev12+gabc1234", "0.27"),
        ("0.26.0+cpu", "0.26"),
        ("0.27.1", "0.27"),
        ("0.25.1+rocm631", "0.24"),
        ("0.15.0rc1", "0.15"),
        (" 0.19.1 ", "0.17"),
        ("0.15.0.dev0", "0.15"),  # judged by its release, as the policy says
    ],
)
def test_dev_and_local_versions_judged_by_release(
    version: str, family: str, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    fake = fake_vllm(version=version)
    scheduler = fake.import_scheduler()
    register()
    scheduler(BLOCK)
    logs.assert_no_traceback()
    assert logs.warnings == []
    (active,) = logs.at_least(logging.INFO)
    assert parse_active(active.getMessage()) is not None, active.getMessage()
    assert facts_of(active)["family"] == family  # in the fields, off the line
    assert is_patched(scheduler)


def _build_fixed(version: str, logs: LogCapture, fake_vllm: FakeFactory) -> type:
    """A fixed scheduler on ``version``, registered and built; no traceback, no warning."""
    scheduler = fake_vllm(version=version, scheduler=FIXED_SCHEDULER).import_scheduler()
    register()
    scheduler(BLOCK)
    logs.assert_no_traceback()
    assert logs.warnings == []
    return scheduler


UPSTREAM_FIXED = ["0.28.0", "0.28.0.dev5+g1234", "0.33.0+cpu", "1.0.0"]


@pytest.mark.parametrize("version", UPSTREAM_FIXED)
def test_fixed_versions_get_only_the_block_unit_rule(
    version: str, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    """Every release's split floors to cache_config.block_size (vLLM #54076): the block-unit
    rule is installed there too, and nothing else on a fixed scheduler."""
    scheduler = _build_fixed(version, logs, fake_vllm)
    (line,) = logs.visible
    parsed = parse_active(line)
    assert parsed is not None and parsed.rules == ("block-unit",), line
    assert is_patched(scheduler)


@pytest.mark.parametrize(
    ("version", "needle", "env"),
    [
        *((v, "not needed", {"VLLM_MAMBA_FIX_BLOCK_RULE": "0"}) for v in UPSTREAM_FIXED),
        ("0.14.1", "has no Scheduler._mamba_block_aligned_split", {}),
    ],
)
def test_unaffected_versions_are_left_alone(
    version: str,
    needle: str,
    env: dict[str, str],
    logs: LogCapture,
    fake_vllm: FakeFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    scheduler = _build_fixed(version, logs, fake_vllm)
    assert len(logs.visible) == 1 and needle in logs.visible[0], logs.visible
    assert not is_patched(scheduler)


def test_force_patches_an_unreadable_version_when_the_shape_fits(
    monkeypatch: pytest.MonkeyPatch, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    monkeypatch.setenv("VLLM_MAMBA_FIX", "force")
    fake = fake_vllm(version="garbage")
    scheduler = fake.import_scheduler()
    register()
    scheduler(BLOCK)
    logs.assert_no_traceback()
    assert logs.warnings == []
    assert len(_active_lines(logs)) == 1
    assert is_patched(scheduler)


# ------------------------------------------------------------------ environment


@pytest.mark.parametrize("value", ["bogus", "yes", "2", "of f", "autoo"])
def test_invalid_mode_warns_once_then_uses_auto(
    value: str, monkeypatch: pytest.MonkeyPatch, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    monkeypatch.setenv("VLLM_MAMBA_FIX", value)
    scheduler = fake_vllm().import_scheduler()
    register()
    register()
    scheduler(BLOCK)
    logs.assert_no_traceback()
    assert len(logs.warnings) == 1, logs.warnings
    warning = logs.warnings[0]
    assert "VLLM_MAMBA_FIX=" in warning and repr(value) in warning
    for accepted in ("auto", "0", "1", "off", "on", "true", "false", "force"):
        assert accepted in warning
    assert "'auto'" in warning
    # The default (auto) applies: 0.27.1 is affected, so it is patched.
    assert is_patched(scheduler)
    assert len(_active_lines(logs)) == 1


@pytest.mark.parametrize("value", ["everything", "text", "multi-modal", "ALL!"])
def test_invalid_scope_warns_once_then_uses_multimodal(
    value: str, monkeypatch: pytest.MonkeyPatch, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    monkeypatch.setenv("VLLM_MAMBA_FIX_SCOPE", value)
    scheduler = fake_vllm().import_scheduler()
    register()
    sched = scheduler(BLOCK)
    logs.assert_no_traceback()
    assert len(logs.warnings) == 1, logs.warnings
    warning = logs.warnings[0]
    assert "VLLM_MAMBA_FIX_SCOPE=" in warning and repr(value) in warning
    assert "multimodal" in warning and "all" in warning
    (active,) = _active_lines(logs)
    parsed = parse_active(active)
    assert parsed is not None and "scope" not in parsed.settings, active  # the default: unsaid
    # Behaviour of the default scope: text-only chunks stay stock, image ones are corrected.
    assert split_as_vllm(sched, FakeRequest(has_encoder_inputs=False), 100) == 0
    assert split_as_vllm(sched, FakeRequest(has_encoder_inputs=True), 256) == 100


@pytest.mark.parametrize("value", ["0", "off", "FALSE", " Off "])
def test_disabled_says_so_once(
    value: str, monkeypatch: pytest.MonkeyPatch, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    monkeypatch.setenv("VLLM_MAMBA_FIX", value)
    scheduler = fake_vllm().import_scheduler()
    register()
    register()
    logs.assert_no_traceback()
    assert logs.warnings == []
    assert len(logs.visible) == 1 and "disabled by VLLM_MAMBA_FIX" in logs.visible[0]
    assert not is_patched(scheduler)


# ---------------------------------------------------------- repeated / threaded


@pytest.mark.parametrize("deferred", [False, True], ids=["imported-first", "imported-later"])
def test_register_twice_wraps_once(
    deferred: bool, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    fake = fake_vllm()
    if deferred:
        register()
        register()
        scheduler = fake.import_scheduler()
    else:
        scheduler = fake.import_scheduler()
        original = scheduler_method(scheduler)
        register()
        register()
        assert original_function(scheduler) is original
    assert is_patched(scheduler)
    original_function(scheduler)  # asserts a single layer
    scheduler(BLOCK)
    scheduler(BLOCK)  # one active line per class, however many are built
    assert len(_active_lines(logs)) == 1
    assert logs.visible == _active_lines(logs)
    assert patch.changed_classes() == [scheduler]
    logs.assert_no_traceback()


def test_register_unregister_register(logs: LogCapture, fake_vllm: FakeFactory) -> None:
    scheduler = fake_vllm().import_scheduler()
    original = scheduler_method(scheduler)
    register()
    assert unregister() is True
    assert scheduler_method(scheduler) is original
    assert unregister() is False
    register()
    assert is_patched(scheduler)
    assert original_function(scheduler) is original
    logs.assert_no_traceback()
    assert logs.warnings == []


@pytest.mark.parametrize("deferred", [False, True], ids=["imported-first", "imported-later"])
def test_concurrent_register_wraps_once(
    deferred: bool, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    fake = fake_vllm()
    original = None
    if not deferred:
        scheduler = fake.import_scheduler()
        original = scheduler_method(scheduler)
    threads_n = 32
    barrier = threading.Barrier(threads_n)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait()
            for _ in range(5):
                register()
        except BaseException as exc:  # pragma: no cover - the assertion shows it
            errors.append(exc)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave as much as possible
    try:
        threads = [threading.Thread(target=worker) for _ in range(threads_n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    if deferred:
        assert sum(isinstance(f, import_hook.PostImportHook) for f in sys.meta_path) == 1
        scheduler = fake.import_scheduler()
    assert is_patched(scheduler)
    inner = original_function(scheduler)  # a single layer
    if original is not None:
        assert inner is original
    assert patch.changed_classes() == [scheduler]
    scheduler(BLOCK)
    assert len(_active_lines(logs)) == 1, logs.visible
    assert logs.visible == _active_lines(logs)
    logs.assert_no_traceback()
    # The patched method works.
    assert split_as_vllm(scheduler(BLOCK), FakeRequest(), 256) == 100


class _Gate(importlib.abc.MetaPathFinder):
    """Holds an import of the scheduler inside the meta-path scan."""

    def __init__(self) -> None:
        self.passed = threading.Event()
        self.go = threading.Event()

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == targets.SCHEDULER_MODULE and not self.passed.is_set():
            self.passed.set()
            self.go.wait(10)


def test_register_racing_a_first_import_in_another_thread(
    logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    fake = fake_vllm()
    gate = _Gate()
    sys.meta_path.insert(0, gate)
    imported: list[type] = []
    importer = threading.Thread(target=lambda: imported.append(fake.import_scheduler()))
    importer.start()
    assert gate.passed.wait(10)
    registering = threading.Thread(target=register)  # the import has walked past the hook
    registering.start()
    registering.join(0.5)
    assert registering.is_alive()  # it waits for the import in progress
    gate.go.set()
    importer.join(10)
    registering.join(10)
    logs.assert_no_traceback()
    assert is_patched(imported[0])
    imported[0](BLOCK)
    assert len(_active_lines(logs)) == 1


def test_unregister_restores_meta_path(fake_vllm: FakeFactory) -> None:
    fake_vllm()
    before = list(sys.meta_path)
    register()
    assert len(sys.meta_path) == len(before) + 1
    unregister()
    assert sys.meta_path == before
    assert import_hook.pending_hook() is None


@pytest.mark.parametrize(
    ("module", "function", "error", "needle"),
    [
        (plugin, "load_settings", RuntimeError("settings"), "disabled after an unexpected error"),
        (patch, "check_target", KeyError("internal"), "not patching after an error"),
    ],
    ids=["before-patching", "while-patching"],
)
def test_register_never_raises_on_internal_error(
    module: types.ModuleType,
    function: str,
    error: Exception,
    needle: str,
    monkeypatch: pytest.MonkeyPatch,
    logs: LogCapture,
    fake_vllm: FakeFactory,
) -> None:
    """An unexpected error in the plugin: one warning, even for register() twice; vLLM as is."""
    scheduler = fake_vllm().import_scheduler()

    def explode(*_args: object, **_kwargs: object) -> None:
        raise error

    monkeypatch.setattr(module, function, explode)
    register()
    register()
    _assert_one_warning(logs, needle, type(error).__name__)
    assert not is_patched(scheduler)


FAILS_ONCE = (
    "import os\n"
    "if not os.environ.get('MAMBA_FIX_TEST_FAILED_ONCE'):\n"
    "    os.environ['MAMBA_FIX_TEST_FAILED_ONCE'] = '1'\n"
    "    raise ImportError('the first import of the scheduler fails')\n"
) + STOCK_SCHEDULER


def test_failed_first_import_patches_on_the_import_that_succeeds(
    logs: LogCapture, fake_vllm: FakeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MAMBA_FIX_TEST_FAILED_ONCE", raising=False)
    fake = fake_vllm(scheduler=FAILS_ONCE)
    register()
    with pytest.raises(ImportError, match="first import"):
        fake.import_scheduler()
    assert isinstance(import_hook.pending_hook(), import_hook.PostImportHook)
    scheduler = fake.import_scheduler()
    assert is_patched(scheduler)
    assert import_hook.pending_hook() is None
    assert not any(isinstance(f, import_hook.PostImportHook) for f in sys.meta_path)
    scheduler(BLOCK)
    assert len(_active_lines(logs)) == 1
    logs.assert_no_traceback()


def test_a_probing_find_spec_leaves_the_hook_armed(
    logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    fake = fake_vllm()
    register()
    assert importlib.util.find_spec(targets.SCHEDULER_MODULE) is not None  # a probe, no import
    scheduler = fake.import_scheduler()
    assert is_patched(scheduler)


# ------------------------------------------- a scheduler's own namespace is never the plugin's


@pytest.mark.parametrize("version", ["0.27.1", "0.33.0"])
def test_a_split_bound_on_the_scheduler_by_another_party_is_left_alone(
    version: str, fake_vllm: FakeFactory
) -> None:
    """A profiler, a test monkeypatch or another plugin binds its own split on a scheduler
    instance: registering, re-wrapping the class and unregistering never overwrite or pop
    it, and every call of the scheduler reaches it."""
    fake = fake_vllm(version) if version != "0.33.0" else fake_vllm(version, FIXED_SCHEDULER)
    scheduler_cls = fake.import_scheduler()
    register()
    sched = scheduler_cls(BLOCK)
    seen: list[int] = []

    def observer(request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> int:
        seen.append(num_new_tokens)  # then whatever the class resolves now
        return getattr(scheduler_cls, METHOD)(sched, request, num_new_tokens, *args, **kwargs)

    vars(sched)[METHOD] = observer
    text = FakeRequest("text", has_encoder_inputs=False)
    image = FakeRequest(has_encoder_inputs=True)
    for request in (text, image, text, image):
        split_as_vllm(sched, request, 100)
    harness.wrap_split(scheduler_cls, scheduler_method(scheduler_cls).__vllm_mamba_fix__)
    split_as_vllm(sched, text, 100)
    unregister()
    split_as_vllm(sched, image, 100)
    assert vars(sched)[METHOD] is observer
    assert seen == [100] * 6
