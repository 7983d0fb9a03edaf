"""No function of the package longer than :data:`LIMIT` lines (issue 38), nested ones included.

ruff holds complexity, branches and statements (pyproject.toml); it has no rule for length,
so the lint phase runs this too. A function's length runs from its ``def`` line to its last
line, docstring and nested functions included.

    python -m tools.function_length            exit 1 and one line per function over the limit
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "vllm_mamba_fix"
LIMIT = 60


def long_functions(source: str, limit: int = LIMIT) -> Iterator[tuple[str, int, int]]:
    """(qualified name, first line, length) of each function in ``source`` over ``limit``."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > limit:
                    yield name, child.lineno, length
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(ast.parse(source), "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, default=[PACKAGE])
    parser.add_argument("--limit", type=int, default=LIMIT)
    args = parser.parse_args(argv)
    found = 0
    for root in args.paths:
        files = sorted(root.rglob("*.py")) if root.is_dir() else [root]
        for path in files:
            for name, line, length in long_functions(path.read_text(), args.limit):
                found += 1
                shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                print(f"{shown}:{line}: {name} is {length} lines (limit {args.limit})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
