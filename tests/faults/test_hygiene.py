"""Hygiene: the plugin reads only its own env variables and logs no prompt content.

Files and sockets are audited in a real vLLM process (test_subprocess_faults).
"""

from __future__ import annotations

import ast
import os
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path

import pytest

import vllm_mamba_fix
from tests.faults.conftest import BLOCK, FakeRequest, FakeVllm, LogCapture, split_as_vllm
from vllm_mamba_fix import register, unregister

FakeFactory = Callable[..., FakeVllm]
OWN_VARIABLES = {
    "VLLM_MAMBA_FIX", "VLLM_MAMBA_FIX_SCOPE", "VLLM_MAMBA_FIX_STALL_SECONDS",
    "VLLM_MAMBA_FIX_END_STALLS_AFTER", "VLLM_MAMBA_FIX_SPLIT_RULE", "VLLM_MAMBA_FIX_BLOCK_RULE",
}  # fmt: skip
# /metrics: vLLM's multiprocess directory, and the plugin's private hand-down (config.py).
METRICS_VARIABLES = {
    "PROMETHEUS_MULTIPROC_DIR", "_VLLM_MAMBA_FIX_METRICS_DIR",
    # The API server names its private directory to the engine cores it starts, and
    # unregister() takes the name back.
    "<write _VLLM_MAMBA_FIX_METRICS_DIR>", "<delete _VLLM_MAMBA_FIX_METRICS_DIR>",
}  # fmt: skip
OWN_VARIABLES |= METRICS_VARIABLES
# Modules allowed to touch the environment: configuration reads it (doctor through
# config.raw_values), the record of changes writes the one variable the plugin sets (and
# undoes it). Paths relative to the package; subpackages are scanned too.
ENV_MODULES = {"facts/config.py", "changes.py"}


class RecordingEnviron(MutableMapping[str, str]):
    """``os.environ`` that records every variable read, and whole-environment reads."""

    def __init__(self, real: MutableMapping[str, str]) -> None:
        self.real = real
        self.read: list[str] = []

    def __getitem__(self, key: str) -> str:
        self.read.append(key)
        return self.real[key]

    def __contains__(self, key: object) -> bool:
        self.read.append(str(key))
        return key in self.real

    def __iter__(self) -> Iterator[str]:
        self.read.append("<whole environment>")
        return iter(self.real)

    def __len__(self) -> int:
        self.read.append("<whole environment>")
        return len(self.real)

    def __setitem__(self, key: str, value: str) -> None:
        self.read.append(f"<write {key}>")
        self.real[key] = value

    def __delitem__(self, key: str) -> None:
        self.read.append(f"<delete {key}>")
        del self.real[key]

    def copy(self) -> dict[str, str]:
        self.read.append("<whole environment>")
        return dict(self.real)


def test_reads_only_its_own_variables(
    monkeypatch: pytest.MonkeyPatch, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    # prometheus_client reads its own variables when first imported (metrics.py imports it
    # lazily): those are the library's, so it is imported before the recording starts.
    pytest.importorskip("prometheus_client.multiprocess")
    monkeypatch.setenv("VLLM_MAMBA_FIX_SCOPE", "all")
    monkeypatch.setenv("VLLM_PLUGINS", "mamba_fix")
    monkeypatch.setenv("HF_TOKEN", "hf_do_not_read_me")
    # 0.25: a split that floors every chunk of a block wider than its longest to 0.
    scheduler_cls = fake_vllm("0.25.1").import_scheduler()
    recorder = RecordingEnviron(os.environ)
    monkeypatch.setattr(os, "environ", recorder)

    register()
    register()
    scheduler = scheduler_cls(BLOCK)
    scheduler.max_num_scheduled_tokens = 100  # below the block: a text 0 never clears
    # Corrections: a collapse at an image the encoder budget can never take (the first one
    # loads the scope hooks), a text request in scope 'all' whose 0 never clears.
    assert split_as_vllm(scheduler, FakeRequest(), 256) == 100
    text = FakeRequest("text", has_encoder_inputs=False)
    assert scheduler._mamba_block_aligned_split(text, 50) == 50
    assert scheduler._mamba_block_aligned_split(Exception(), 100) == 0  # failure path
    unregister()

    monkeypatch.undo()  # restore os.environ before asserting
    assert set(recorder.read) <= OWN_VARIABLES, recorder.read
    # The recorder sees the plugin's reads (the /metrics directories only where a scheduler is
    # built, which this in-process run does not do).
    assert set(recorder.read) >= OWN_VARIABLES - METRICS_VARIABLES
    assert "active" in " ".join(logs.visible)


def test_only_config_and_the_record_of_changes_touch_the_environment() -> None:
    """No other module reaches ``os.environ``/``getenv``/``putenv``, even in dead code."""
    package = Path(vllm_mamba_fix.__file__).parent
    names = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
    offenders = []
    for source in sorted(package.rglob("*.py")):
        tree = ast.parse(source.read_text(), str(source))
        for node in ast.walk(tree):
            hit = (isinstance(node, ast.Attribute) and node.attr in names) or (
                isinstance(node, ast.ImportFrom)
                and node.module == "os"
                and any(alias.name in names for alias in node.names)
            )
            where = source.relative_to(package).as_posix()
            if hit and where not in ENV_MODULES:
                offenders.append(f"{where}:{node.lineno}")
    assert offenders == []


ENVIRON_WRITES = {"setdefault", "pop", "popitem", "update", "clear"}


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _writes_environ(node: ast.AST) -> bool:
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
        return _is_environ(node.value)
    if isinstance(node, ast.Attribute):
        return node.attr in ("putenv", "unsetenv") or (
            node.attr in ENVIRON_WRITES and _is_environ(node.value)
        )
    return False


def test_facts_only_read_the_environment() -> None:
    """config.py reads; the one variable the plugin sets goes through changes.py, which
    undoes it (no item assignment or deletion, mutating method or putenv under facts/)."""
    package = Path(vllm_mamba_fix.__file__).parent
    offenders = [
        f"{source.relative_to(package).as_posix()}:{node.lineno}"
        for source in sorted((package / "facts").rglob("*.py"))
        for node in ast.walk(ast.parse(source.read_text(), str(source)))
        if _writes_environ(node)
    ]
    assert offenders == []


SENTINEL_TEXT = "SENTINEL-prompt-7f3a"
SENTINEL_TOKEN = 48151623


class PromptRequest(FakeRequest):
    """A request that carries prompt content the way vLLM's does."""

    def __init__(self, request_id: str, **kwargs: object) -> None:
        super().__init__(request_id=request_id, **kwargs)  # type: ignore[arg-type]
        self.prompt = f"describe {SENTINEL_TEXT} please"
        self.prompt_token_ids = [SENTINEL_TOKEN] * self.num_prompt_tokens
        self.all_token_ids = self.prompt_token_ids
        self.cache_salt = f"salt-{SENTINEL_TEXT}"

    def __repr__(self) -> str:
        return f"PromptRequest(prompt={self.prompt!r}, ids={self.prompt_token_ids[:4]})"

    def __str__(self) -> str:
        return self.__repr__()


def test_logs_carry_no_prompt_content(
    monkeypatch: pytest.MonkeyPatch, logs: LogCapture, fake_vllm: FakeFactory
) -> None:
    scheduler_cls = fake_vllm().import_scheduler()
    register()
    scheduler = scheduler_cls(BLOCK)
    corrected = 0
    for step, request_id in enumerate(["req-a", "req-a", "req-b"]):
        request = PromptRequest(request_id, num_computed_tokens=step * 40)
        # Each chunk is cut at FakeRequest's image (token 100), which never fits.
        corrected += split_as_vllm(scheduler, request, 256) > 0
    broken = PromptRequest("req-broken")
    del broken.num_prompt_tokens
    split_as_vllm(scheduler, broken, 100, 40)  # failure path
    from vllm_mamba_fix.observe import counters

    counters.log_summary()
    unregister()

    assert corrected == 3
    text = logs.text
    assert "req-a" in text and "req-b" in text  # ids and counts are logged ...
    assert "correction failed" in text  # ... the failure too ...
    assert SENTINEL_TEXT not in text  # ... but never the prompt
    assert str(SENTINEL_TOKEN) not in text
    for record in logs.records:
        for arg in record.args if isinstance(record.args, tuple) else ():
            # Numbers, ids and our own words; an exception only by its message.
            assert isinstance(arg, (int, str, BaseException)), (record.msg, type(arg))
