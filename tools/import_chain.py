"""Import cycles in the tree, and the longest import chain among the package's modules, read
with grimp.

grimp is import-linter's graph builder, so the graph is the one ``lint-imports`` checks: every
``import`` statement of a module counts, at the top or inside a function, ``TYPE_CHECKING``
blocks included; importing a submodule does not count as importing its package. No module of
the tree (:data:`TREE`: the package, ``tools`` and ``benchmarks``, and the imports between
them) imports another in a circle. A chain is a path of direct imports, counted in modules
(``a -> b -> c`` is 3); the package's longest is at most :data:`LIMIT` (CONTRIBUTING.md,
"Layout"). ``tests/unit/test_import_chain.py`` checks both.

    python -m tools.import_chain            the longest chain, and exit 1 on a cycle in the
                                            tree or a chain above the limit
    python -m tools.import_chain --all      also each module's longest chain, longest first
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping

PACKAGE = "vllm_mamba_fix"
# Every top-level package of the repository: the plugin, the harnesses, the benchmarks.
TREE: tuple[str, ...] = (PACKAGE, "tools", "benchmarks")
LIMIT = 9

Graph = Mapping[str, Iterable[str]]


def import_graph(*packages: str) -> dict[str, set[str]]:
    """Per module of ``packages`` (default: the package), the modules of ``packages`` it
    imports directly. The packages must be importable (the repository root on the path)."""
    import grimp

    graph = grimp.build_graph(
        *(packages or (PACKAGE,)), include_external_packages=False, cache_dir=None
    )
    return {
        module: set(graph.find_modules_directly_imported_by(module)) for module in graph.modules
    }


def find_cycle(graph: Graph) -> list[str] | None:
    """One import cycle (its first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                return [*path[path.index(imported) :], imported]
            if imported not in state:
                found = visit(imported)
                if found is not None:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module)
            if found is not None:
                return found
    return None


def longest_chains(graph: Graph) -> dict[str, list[str]]:
    """Per module, the longest chain of imports that starts at it. The graph has no cycle."""
    cycle = find_cycle(graph)
    if cycle is not None:
        raise ValueError("an import cycle: " + " -> ".join(cycle))
    longest: dict[str, list[str]] = {}

    def visit(module: str) -> list[str]:
        if module not in longest:
            below = [visit(imported) for imported in sorted(graph.get(module, ()))]
            longest[module] = [module, *max(below, key=len, default=[])]
        return longest[module]

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for module in sorted(graph):
        visit(module)
    return longest


def longest_chain(graph: Graph) -> list[str]:
    """The longest chain of imports in ``graph`` (the first in module order among equals)."""
    chains = longest_chains(graph)
    return max((chains[m] for m in sorted(chains)), key=len, default=[])


def short_name(module: str, package: str = PACKAGE) -> str:
    return module[len(package) + 1 :] if module.startswith(package + ".") else module


def render(chain: list[str]) -> str:
    count = f"{len(chain)} module" + ("" if len(chain) == 1 else "s")
    return f"{count}: " + " -> ".join(short_name(m) for m in chain)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.import_chain", description=__doc__)
    parser.add_argument("--all", action="store_true", help="each module's longest chain too")
    parser.add_argument("--limit", type=int, default=LIMIT, help=f"default {LIMIT}")
    args = parser.parse_args(argv)
    cycle = find_cycle(import_graph(*TREE))
    if cycle is not None:
        print("import cycle: " + " -> ".join(short_name(m) for m in cycle))
        return 1
    graph = import_graph()
    chains = longest_chains(graph)
    if args.all:
        for module in sorted(chains, key=lambda m: (-len(chains[m]), m)):
            print(f"{short_name(module):40} {render(chains[module])}")
    chain = longest_chain(graph)
    print(f"longest import chain: {render(chain)} (limit {args.limit})")
    return 0 if len(chain) <= args.limit else 1


if __name__ == "__main__":
    raise SystemExit(main())
