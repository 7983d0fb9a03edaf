"""The command line's parser: ``vllm-mamba-fix [doctor] [--json | --report] [--scheduler-cls
module.Class] [--speculative-config JSON]``; :func:`vllm_mamba_fix.doctor.core.main` runs it."""

from __future__ import annotations

import argparse
import re
import sys

from vllm_mamba_fix._version import __version__
from vllm_mamba_fix.doctor.checks.speculative import parse_speculative_config


def _qualname(value: str) -> str:
    if not re.match(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$", value):
        raise argparse.ArgumentTypeError(f"expected a dotted path module.Class, got {value!r}")
    return value


def build_parser(prog: str = "vllm-mamba-fix") -> argparse.ArgumentParser:
    # The package's docstring is the description; always imported before us: read, not imported
    doctor = sys.modules[__package__ or "vllm_mamba_fix.doctor"]
    parser = argparse.ArgumentParser(
        prog=prog, description="Tools for the vllm-mamba-fix vLLM plugin."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    command = parser.add_subparsers(dest="command", metavar="{doctor}").add_parser(
        "doctor",
        help="check that the fix will be active (the default command)",
        description=(doctor.__doc__ or "").split("\n\n", 1)[-1].replace("``", "`"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    output = command.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print one JSON object")
    output.add_argument(
        "--report",
        action="store_true",
        help="print a Markdown block to paste into a bug report, next to vLLM's "
        "`python -m vllm.collect_env` (same exit code)",
    )
    command.add_argument(
        "--scheduler-cls", action="append", default=[], type=_qualname, metavar="module.Class",
        help="the --scheduler-cls given to vLLM, or a platform's scheduler (repeatable; "
        "reported per class)",
    )  # fmt: skip
    command.add_argument(
        "--speculative-config", type=parse_speculative_config, default=None, metavar="JSON",
        help="the --speculative-config given to vllm serve: says whether it is EAGLE-type",
    )  # fmt: skip
    return parser
