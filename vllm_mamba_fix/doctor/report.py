"""The report the checks fill in, exit codes, and the I/O helpers they share."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from vllm_mamba_fix import _version
from vllm_mamba_fix._log import logger as plugin_logger

EXIT_OK = 0
EXIT_NOT_PROTECTED = 1
EXIT_INVALID_INPUT = 2
EXIT_CANNOT_TELL = 3

# status -> (exit code, headline)
STATUS: dict[str, tuple[int, str]] = {
    "protected": (EXIT_OK, "PROTECTED"),
    "not-needed": (EXIT_OK, "NOT NEEDED"),
    "not-protected": (EXIT_NOT_PROTECTED, "NOT PROTECTED"),
    "invalid-input": (EXIT_INVALID_INPUT, "INVALID INPUT"),
    "unknown": (EXIT_CANNOT_TELL, "CANNOT TELL"),
}
# The policy verdict in words (the verdict module's Policy.verdict is a key).
VERDICT_TEXT = {
    "needed-will-patch": "needed, will patch",
    "needed-will-not-patch": "needed, but will NOT patch",
    "installed-per-scheduler": "installed, engages per scheduler",
    "not-needed": "not needed",
    "unsupported": "unsupported",
}


def package_path() -> str:
    """The folder this interpreter imports the plugin from (``_version.py`` is at its top)."""
    return os.path.dirname(os.path.abspath(_version.__file__))


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@dataclasses.dataclass
class Report:
    """The JSON body and its two lists; the text and --report are rendered from it."""

    problems: list[str] = dataclasses.field(default_factory=list)  # why not protected
    warnings: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)  # the JSON body


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


class LogCapture(logging.Handler):
    """Collects the plugin's log records during the dry run, to show them (never to decide)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self) -> list[str]:
        return [r.getMessage().removeprefix("vllm-mamba-fix: ") for r in self.records]


@contextlib.contextmanager
def captured_plugin_log() -> Iterator[LogCapture]:
    capture = LogCapture()
    saved = plugin_logger.level, plugin_logger.propagate
    plugin_logger.addHandler(capture)
    plugin_logger.setLevel(logging.DEBUG)
    plugin_logger.propagate = False  # the report shows them instead
    try:
        yield capture
    finally:
        plugin_logger.removeHandler(capture)
        plugin_logger.level, plugin_logger.propagate = saved


def names_text(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    if len(names) <= 2:
        return " and ".join(names)
    return f"{', '.join(names[:-1])} and {names[-1]}"
