"""The report the checks fill in, the exit codes, and the I/O helpers the checks share."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import logging.handlers
import os
import sys
from collections.abc import Iterator
from typing import Any

from vllm_mamba_fix import _version
from vllm_mamba_fix._log import logger as plugin_logger

EXIT_OK, EXIT_NOT_PROTECTED, EXIT_INVALID_INPUT, EXIT_CANNOT_TELL = 0, 1, 2, 3
# status -> (exit code, headline)
STATUS: dict[str, tuple[int, str]] = {
    "protected": (EXIT_OK, "PROTECTED"),
    "not-needed": (EXIT_OK, "NOT NEEDED"),
    "not-protected": (EXIT_NOT_PROTECTED, "NOT PROTECTED"),
    "invalid-input": (EXIT_INVALID_INPUT, "INVALID INPUT"),
    "unknown": (EXIT_CANNOT_TELL, "CANNOT TELL"),
}
# The policy verdict (verdict.Policy.verdict) in words.
VERDICT_TEXT = {
    "needed-will-patch": "needed, will patch",
    "needed-will-not-patch": "needed, but will NOT patch",
    "installed-per-scheduler": "installed, engages per scheduler",
    "not-needed": "not needed",
    "unsupported": "unsupported",
}


def package_path() -> str:  # where this interpreter imports the plugin from
    return os.path.dirname(os.path.abspath(_version.__file__))


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def names_text(names: list[str]) -> str:  # a; a and b; a, b and c
    return " and ".join(names) if len(names) <= 2 else f"{', '.join(names[:-1])} and {names[-1]}"


@dataclasses.dataclass
class Report:  # the JSON body, and its two lists
    problems: list[str] = dataclasses.field(default_factory=list)  # why not protected
    warnings: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """vLLM logs to stdout by default; keep stdout for the report (and --json)."""
    sys.stdout.flush()
    try:
        fd, err_fd = sys.stdout.fileno(), sys.stderr.fileno()
        saved = os.dup(fd)
    except (AttributeError, OSError, ValueError):  # not a real file (embedded use)
        saved = None
    if saved is not None:
        os.dup2(err_fd, fd)
    try:
        # Python-level too: vLLM resolves ext://sys.stdout when it configures logging.
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        if saved is not None:
            os.dup2(saved, fd)
            os.close(saved)


class LogCapture(logging.handlers.BufferingHandler):  # the dry run's records: shown, never decide
    def messages(self) -> list[str]:
        return [r.getMessage().removeprefix("vllm-mamba-fix: ") for r in self.buffer]


@contextlib.contextmanager
def captured_plugin_log() -> Iterator[LogCapture]:
    capture, saved = LogCapture(sys.maxsize), (plugin_logger.level, plugin_logger.propagate)
    plugin_logger.addHandler(capture)
    plugin_logger.setLevel(logging.DEBUG)
    plugin_logger.propagate = False  # the report shows them instead
    try:
        yield capture
    finally:
        plugin_logger.removeHandler(capture)
        plugin_logger.level, plugin_logger.propagate = saved
