"""vLLM's logging config for the e2e runs that check the plugin's log fields.

vLLM's own text handler, as vLLM configures it by default (the other e2e tests read that text),
and beside it the JSON formatter of ``examples/vllm_json_logging.json`` writing to a file, so
what a user gets from that example is what the test reads. Every process of the run (the
worker and its engine cores) appends its records to the same file, one JSON object a line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "vllm_json_logging.json"
# vLLM's default text format (vllm/logger.py, 0.27.1), without VLLM_LOGGING_PREFIX.
TEXT_FORMAT = "%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
JSON_LOG = "vllm-log.jsonl"  # in the run's directory


def config(json_log: Path) -> dict[str, Any]:
    """The dictConfig: vLLM's text lines on stdout, the example's JSON lines in ``json_log``."""
    example = json.loads(EXAMPLE.read_text())
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {
                "class": "vllm.logging_utils.NewLineFormatter",
                "datefmt": DATE_FORMAT,
                "format": TEXT_FORMAT,
            },
            "json": example["formatters"]["json"],
        },
        "handlers": {
            "vllm": {
                "class": "logging.StreamHandler",
                "formatter": "vllm",
                "level": "INFO",
                "stream": "ext://sys.stdout",
            },
            "json": {
                "class": "logging.FileHandler",
                "formatter": "json",
                "filename": str(json_log),
            },
        },
        "loggers": {
            "vllm": {"handlers": ["vllm", "json"], "level": "INFO", "propagate": False},
        },
    }


def write_config(directory: Path) -> tuple[Path, Path]:
    """Write the config into ``directory``: (the config for VLLM_LOGGING_CONFIG_PATH, the JSON
    log it names)."""
    json_log = directory / JSON_LOG
    path = directory / "logging-config.json"
    path.write_text(json.dumps(config(json_log), indent=1))
    return path, json_log


def records(json_log: Path) -> list[dict[str, Any]]:
    """The JSON log's records (a line cut short by a killed process is skipped)."""
    found = []
    for line in json_log.read_text(errors="replace").splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found
