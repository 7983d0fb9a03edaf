"""The tree's imports: no cycle in the package, tools/ or benchmarks/ (nor between them), and
no chain of the package longer than tools/import_chain.LIMIT modules.

The graph is grimp's (import-linter's), so function-level imports count as ``lint-imports``
counts them. The layers themselves are pyproject.toml's contracts.
"""

from __future__ import annotations

import pytest

from tools import import_chain
from tools.import_chain import find_cycle, longest_chain, longest_chains, render


def test_the_longest_chain_of_a_small_graph() -> None:
    graph = {"a": {"b", "c"}, "b": {"d"}, "c": {"b"}, "d": set(), "e": {"d"}}
    assert longest_chain(graph) == ["a", "c", "b", "d"]
    chains = longest_chains(graph)
    assert chains["e"] == ["e", "d"] and chains["d"] == ["d"]
    assert render(["x.y", "z"]) == "2 modules: x.y -> z"
    assert longest_chain({}) == []


def test_a_cycle_is_found_and_has_no_longest_chain() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    with pytest.raises(ValueError, match="import cycle"):
        longest_chains(graph)


def test_the_tree_has_no_cycle() -> None:
    pytest.importorskip("grimp")
    graph = import_chain.import_graph(*import_chain.TREE)
    for module in ("vllm_mamba_fix.install.plugin", "tools.matrix", "benchmarks.run"):
        assert module in graph  # grimp read each package
    # Function-level imports and imports between the packages are edges too.
    assert "tools.releases" in graph["tools.sched_harness"]
    assert "tools.sched_harness" in graph["benchmarks.worker"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_package_has_no_cycle_and_no_chain_over_the_limit() -> None:
    pytest.importorskip("grimp")
    graph = import_chain.import_graph()
    assert "vllm_mamba_fix.install.plugin" in graph  # grimp read the package
    # Function-level imports are edges too (scope.py imports hookspecs inside a function).
    assert "vllm_mamba_fix.hookspecs" in graph["vllm_mamba_fix.decide.scope"]
    assert find_cycle(graph) is None
    chain = longest_chain(graph)
    assert len(chain) <= import_chain.LIMIT, render(chain)
    assert import_chain.main([]) == 0
