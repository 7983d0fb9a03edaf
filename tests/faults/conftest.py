"""Fixtures for fault-injection and hygiene tests.

Class-level faults run in-process against a *fake* vLLM tree: small real source
files on disk (``vllm/v1/core/sched/scheduler.py`` and friends) found through
fake parent packages installed in ``sys.modules``. The plugin's real import
hook, real checks and real wrapper run against them; nothing of the plugin is
mocked. Everything global is restored after each test, so these tests run in
the same session as tests that use the real vLLM.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from vllm_mamba_fix.changes import Changes, installation
from vllm_mamba_fix.facts import targets
from vllm_mamba_fix.install import import_hook, plugin

PLUGIN_LOGGER = "vllm.mamba_fix"
SCHEDULER_MODULE = targets.SCHEDULER_MODULE
METHOD = targets.SPLIT_METHOD
PLUGIN_ENV = ("VLLM_MAMBA_FIX", "VLLM_MAMBA_FIX_SCOPE")
BLOCK = 128

# The stock encoder method's def line; tests swap it for other signatures.
STOCK_ENCODER_DEF = """    def _try_schedule_encoder_inputs(
        self,
        request,
        num_computed_tokens,
        num_new_tokens,
        encoder_compute_budget,
        shift_computed_tokens=0,
    ):"""

# A 0.27-shaped scheduler whose split floors the chunk to whole blocks, so a
# sub-block chunk returns 0: the collapse the plugin exists to correct.
STOCK_SCHEDULER = f"""
from types import SimpleNamespace


class SchedulerInterface:
    pass


class EncoderCacheManager:
    cache_size = 1000
    num_free_slots = 0

    def get_cached_input_ids(self, request):
        return set()


class MambaSpec:
    def __init__(self, block_size):
        self.block_size = block_size


class Scheduler(SchedulerInterface):
    def __init__(self, block_size=128):
        self.cache_config = SimpleNamespace(block_size=block_size)
        # The block the Mamba cache stores, which the plugin aligns to.
        group = SimpleNamespace(kv_cache_spec=MambaSpec(block_size))
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[group])
        self.use_eagle = False
        self.encoder_cache_manager = EncoderCacheManager()
        self.encoder_blocked = False  # tests set it: no encoder input fits
        # Below FakeRequest's image: a cut at it never clears, so the split rule corrects it.
        self.max_num_encoder_input_tokens = 512

    def schedule(self):
        # The order that deadlocks (0.15-0.27): encoder budgeting, then the split.
        for request in ():
            n = self._try_schedule_encoder_inputs(request, 0, 1, 1, shift_computed_tokens=0)[1]
            self._mamba_block_aligned_split(request, n)

    def _free_request(self, request):
        return None

    def update_from_output(self, scheduler_output, model_runner_output):
        return {{}}

    def _free_encoder_inputs(self, request):
        # Deferred by the drafter's look-ahead, as 0.24-0.32 do.
        spec_lookahead = 1 if self.use_eagle else 0
        return spec_lookahead

{STOCK_ENCODER_DEF}
        if self.encoder_blocked:
            return [], 0, encoder_compute_budget, []
        # Cut before the first input the step's encoder budget cannot take, as vLLM does.
        end = num_computed_tokens + num_new_tokens + shift_computed_tokens
        for feature in getattr(request, "mm_features", ()):
            position = feature.mm_position
            if num_computed_tokens <= position.offset < end and (
                position.length > self.max_num_encoder_input_tokens
            ):
                cut = position.offset - num_computed_tokens - shift_computed_tokens
                return [], max(cut, 0), encoder_compute_budget, []
        return [], num_new_tokens, encoder_compute_budget, []

    def _mamba_block_aligned_split(
        self,
        request,
        num_new_tokens,
        num_new_local_computed_tokens=0,
        num_external_computed_tokens=0,
    ):
        block_size = self.cache_config.block_size
        return num_new_tokens // block_size * block_size
"""


# The same scheduler with upstream's fixes (0.33): split before encoder
# budgeting, and encoder inputs freed without a look-ahead delay.
FIXED_SCHEDULER = (
    STOCK_SCHEDULER.replace(
        """        for request in ():
            n = self._try_schedule_encoder_inputs(request, 0, 1, 1, shift_computed_tokens=0)[1]
            self._mamba_block_aligned_split(request, n)""",
        """        for request in ():
            n = self._mamba_block_aligned_split(request, 1)
            self._try_schedule_encoder_inputs(request, 0, n, 1, shift_computed_tokens=0)""",
    )
    .replace("spec_lookahead = 1 if self.use_eagle else 0", "delay = 0")
    .replace("return spec_lookahead", "return delay")
)
assert "n = self._mamba" in FIXED_SCHEDULER and "spec_lookahead =" not in FIXED_SCHEDULER


IMAGE_AT_100 = types.SimpleNamespace(
    identifier="img-100", mm_position=types.SimpleNamespace(offset=100, length=900, is_embed=None)
)


class FakeRequest:
    """The attributes the wrapper reads from ``vllm.v1.request.Request``."""

    def __init__(
        self,
        request_id: str = "req-0",
        num_computed_tokens: int = 0,
        num_prompt_tokens: int = 1000,
        has_encoder_inputs: bool = True,
    ) -> None:
        self.request_id = request_id
        self.num_computed_tokens = num_computed_tokens
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = num_prompt_tokens
        self.num_output_tokens = 0
        self.has_encoder_inputs = has_encoder_inputs
        # An image at token 100, larger than one step's encoder budget (the fake schedulers'
        # 512): a chunk cut there is the deadlock the split rule corrects.
        self.mm_features: list[Any] = [IMAGE_AT_100] if has_encoder_inputs else []


# --------------------------------------------------------------------------- logs


def split_as_vllm(scheduler: Any, request: Any, num_new_tokens: int, *args: Any) -> int:
    """The split as vLLM's own ``schedule()`` (0.15-0.27) reaches it: a request with encoder
    inputs has its encoder check first, which may cut the chunk before an input."""
    if request.has_encoder_inputs:
        num_new_tokens = scheduler._try_schedule_encoder_inputs(
            request, request.num_computed_tokens, num_new_tokens, 1
        )[1]
    return scheduler._mamba_block_aligned_split(request, num_new_tokens, *args)


@dataclass
class LogCapture:
    records: list[logging.LogRecord] = field(default_factory=list)

    def at_least(self, level: int) -> list[logging.LogRecord]:
        return [r for r in self.records if r.levelno >= level]

    @property
    def visible(self) -> list[str]:
        """Lines an operator sees at vLLM's default level (INFO)."""
        return [r.getMessage() for r in self.at_least(logging.INFO)]

    @property
    def warnings(self) -> list[str]:
        return [r.getMessage() for r in self.at_least(logging.WARNING)]

    @property
    def text(self) -> str:
        return "\n".join(r.getMessage() for r in self.records)

    def assert_no_traceback(self) -> None:
        assert not [r for r in self.records if r.exc_info or r.stack_info], self.text

    def clear(self) -> None:
        self.records.clear()


class _ListHandler(logging.Handler):
    def __init__(self, sink: LogCapture) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.records.append(record)


@pytest.fixture
def logs() -> Iterator[LogCapture]:
    """Every record of the plugin's logger, at every level.

    A handler on ``vllm.mamba_fix`` itself: vLLM's logging config may stop
    ``vllm.*`` records from reaching the root logger that ``caplog`` watches.
    """
    capture = LogCapture()
    handler = _ListHandler(capture)
    log = logging.getLogger(PLUGIN_LOGGER)
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield capture
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


# ------------------------------------------------------------------ global state


@pytest.fixture(autouse=True)
def clean_plugin_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fresh plugin per test; whatever another test suite left is put back after."""
    for name in PLUGIN_ENV:
        monkeypatch.delenv(name, raising=False)
    meta_path = list(sys.meta_path)
    # Another suite's session (its changes, pending hook and memory) is set aside, not undone.
    saved = dict(vars(installation))
    Changes.__init__(installation)
    # A pending hook left by another suite would fire on our fake scheduler.
    sys.meta_path[:] = [f for f in meta_path if not isinstance(f, import_hook.PostImportHook)]
    try:
        yield
    finally:
        plugin.unregister()  # unwraps our fake classes, cancels our pending hook
        sys.meta_path[:] = meta_path
        vars(installation).clear()
        vars(installation).update(saved)


# ------------------------------------------------------------------- fake vLLM


class FakeVllm:
    """A fake ``vllm`` package tree; modules are real files imported for real."""

    PARENTS = ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched")

    def __init__(self, root: Path, version: str | None) -> None:
        self.root = root
        self.package: types.ModuleType | None = None
        self._version = version

    def install(self) -> None:
        for name in self.PARENTS:
            directory = self.root.joinpath(*name.split("."))
            directory.mkdir(parents=True, exist_ok=True)
            module = types.ModuleType(name)
            module.__path__ = [str(directory)]
            module.__package__ = name
            sys.modules[name] = module
            if name == "vllm":
                self.package = module
                if self._version is not None:
                    module.__version__ = self._version  # type: ignore[attr-defined]

    def set_version(self, version: object) -> None:
        assert self.package is not None
        self.package.__version__ = version  # type: ignore[attr-defined]

    def write(self, module: str, source: str) -> None:
        """Write ``vllm.v1.core.sched.<module>`` (not imported yet)."""
        path = self.root.joinpath(*self.PARENTS[-1].split("."), f"{module}.py")
        path.write_text(textwrap.dedent(source))

    def write_scheduler(self, source: str = STOCK_SCHEDULER) -> None:
        self.write("scheduler", source)

    def import_module(self, module: str = "scheduler") -> types.ModuleType:
        importlib.invalidate_caches()
        return importlib.import_module(f"{self.PARENTS[-1]}.{module}")

    def import_scheduler(self) -> type:
        return self.import_module("scheduler").Scheduler  # type: ignore[no-any-return]


def _vllm_modules() -> dict[str, Any]:
    return {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}


@pytest.fixture
def fake_vllm(tmp_path: Path) -> Iterator[Callable[..., FakeVllm]]:
    """Factory: ``fake_vllm(version="0.27.1", scheduler=STOCK_SCHEDULER)``.

    ``scheduler=None`` writes no scheduler module. Any real vLLM modules in
    ``sys.modules`` are shadowed for the test and restored after it.
    """
    saved = _vllm_modules()
    for name in saved:
        del sys.modules[name]

    def make(version: str | None = "0.27.1", scheduler: str | None = STOCK_SCHEDULER) -> FakeVllm:
        fake = FakeVllm(tmp_path / "fake_vllm", version)
        fake.install()
        if scheduler is not None:
            fake.write_scheduler(scheduler)
        return fake

    try:
        yield make
    finally:
        for name in _vllm_modules():
            del sys.modules[name]
        sys.modules.update(saved)
        # Imports during the test may have unbound submodules from their packages.
        for name, module in saved.items():
            parent, _, child = name.rpartition(".")
            if parent in saved:
                setattr(saved[parent], child, module)


def scheduler_method(cls: type) -> Any:
    return cls.__dict__.get(METHOD)


def is_patched(cls: type) -> bool:
    return hasattr(scheduler_method(cls), targets.MARKER)


def original_function(cls: type) -> Any:
    """The method under any wrappers of ours; asserts there is exactly one layer."""
    method = scheduler_method(cls)
    if not hasattr(method, targets.MARKER):
        return method
    inner = method.__wrapped__
    assert not hasattr(inner, targets.MARKER), "wrapped twice"
    return inner


# ------------------------------------------------------------- real vLLM probe

PROBE = Path(__file__).with_name("_real_vllm_probe.py")
PROBE_EXCLUDE = "some_other_plugin"


class ProbeRun:
    """The real-vLLM probe, started in the background when the session needs it."""

    def __init__(self, tmp: Path) -> None:
        import subprocess

        self.out = tmp / "probe.out"
        env = {k: v for k, v in os.environ.items() if k not in PLUGIN_ENV}
        env.update(
            VLLM_PLUGINS=PROBE_EXCLUDE,
            PROBE_EXCLUDE=PROBE_EXCLUDE,
            PYTHONDONTWRITEBYTECODE="1",  # no .pyc writes to confuse the file audit
            VLLM_LOGGING_LEVEL="INFO",
            # The engine-core child builds a scheduler with the harness.
            PYTHONPATH=os.pathsep.join(
                filter(None, [str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH")])
            ),
        )
        with self.out.open("wb") as sink:
            self.process = subprocess.Popen(
                [sys.executable, str(PROBE)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=tmp,
            )
        self._output: str | None = None

    def output(self, timeout: float = 400) -> str:
        if self._output is None:
            self.process.wait(timeout)
            self._output = self.out.read_text(errors="replace")
        return self._output

    def results(self) -> dict[str, Any]:
        import json

        found = {}
        for line in self.output().splitlines():
            if line.startswith("RESULT "):
                _, name, payload = line.split(" ", 2)
                found[name] = json.loads(payload)
        return found

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


_probe: ProbeRun | None = None


@pytest.fixture(scope="session", autouse=True)
def _start_probe_early(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Start the slow real-vLLM probe at the first faults test, if any test needs it."""
    global _probe
    if any(
        "real_vllm_probe" in getattr(item, "fixturenames", ()) for item in request.session.items
    ):
        _probe = ProbeRun(tmp_path_factory.mktemp("probe"))
    try:
        yield
    finally:
        if _probe is not None:
            _probe.stop()
            _probe = None


@pytest.fixture
def real_vllm_probe() -> ProbeRun:
    assert _probe is not None
    return _probe
