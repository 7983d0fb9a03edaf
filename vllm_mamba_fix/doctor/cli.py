"""The command line: ``vllm-mamba-fix [doctor] [--json] [--scheduler-cls module.Class] ...``."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Sequence

from vllm_mamba_fix._version import __version__
from vllm_mamba_fix.doctor.checks.speculative import parse_speculative_config
from vllm_mamba_fix.doctor.core import run
from vllm_mamba_fix.doctor.render import render_json, render_text
from vllm_mamba_fix.doctor.report import EXIT_CANNOT_TELL, EXIT_INVALID_INPUT, one_line

_QUALNAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
_TOP_LEVEL_FLAGS = ("-h", "--help", "--version")


def _qualname(value: str) -> str:
    if not _QUALNAME.match(value):
        raise argparse.ArgumentTypeError(f"expected a dotted path module.Class, got {value!r}")
    return value


def build_parser(prog: str = "vllm-mamba-fix") -> argparse.ArgumentParser:
    # The package's docstring is the command's description; the package is always imported
    # before this submodule, so it is read from sys.modules rather than imported back.
    doctor = sys.modules[__package__ or "vllm_mamba_fix.doctor"]
    parser = argparse.ArgumentParser(
        prog=prog, description="Tools for the vllm-mamba-fix vLLM plugin."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{doctor}")
    command = sub.add_parser(
        "doctor",
        help="check that the fix will be active (the default command)",
        description=(doctor.__doc__ or "").split("\n\n", 1)[-1].replace("``", "`"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument("--json", action="store_true", help="print one JSON object")
    command.add_argument(
        "--scheduler-cls",
        action="append",
        default=[],
        type=_qualname,
        metavar="module.Class",
        help="the --scheduler-cls given to vLLM, or a platform's scheduler (repeatable; "
        "reported per class)",
    )
    command.add_argument(
        "--speculative-config",
        type=parse_speculative_config,
        default=None,
        metavar="JSON",
        help="the --speculative-config given to vllm serve: says whether it is EAGLE-type",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0].startswith("-") and args_list[0] not in _TOP_LEVEL_FLAGS):
        args_list.insert(0, "doctor")  # doctor is the default command
    try:
        args = build_parser().parse_args(args_list)
    except SystemExit as exc:  # argparse: usage error (2) or --help (0)
        return exc.code if isinstance(exc.code, int) else EXIT_INVALID_INPUT
    started = time.perf_counter()
    try:
        report = run(args.scheduler_cls, args.speculative_config)
    except KeyboardInterrupt:
        print("vllm-mamba-fix doctor: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"vllm-mamba-fix doctor: internal error: {one_line(exc)}", file=sys.stderr)
        return EXIT_CANNOT_TELL
    elapsed = time.perf_counter() - started
    report.data["elapsed_seconds"] = round(elapsed, 3)
    text = render_json(report) if args.json else render_text(report, elapsed)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. piped into `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return int(report.data["exit_code"])
