"""The rule table names every counter once, and each counter has its /metrics series."""

from __future__ import annotations

from vllm_mamba_fix.observe import counters, metrics
from vllm_mamba_fix.rules import table as rules


def test_every_counter_belongs_to_a_rule_and_every_rule_key_is_counted() -> None:
    rule_keys = {key for spec in rules.RULES for key in spec.stats_keys}
    assert rule_keys == set(counters.KEYS)
    assert set(metrics.SERIES) == set(counters.KEYS)


def test_the_running_totals_name_every_counter() -> None:
    counts = {key: index + 1 for index, key in enumerate(counters.KEYS)}
    text = counters.totals_text(counts)
    # stalls_resolved rides only on the shutdown summary ("moved again");
    # encoder_references_dropped only on stats() and /metrics (the line's format stays).
    hidden = {"stalls_resolved", "encoder_references_dropped"}
    shown = [key for key in counters.KEYS if key not in hidden]
    assert all(f"{counts[key]} " in text for key in shown)


def test_each_rule_is_one_module_with_its_header_and_a_mirrored_test_file() -> None:
    """A rule is one module of rules/ that opens with its header, named by the table, and
    tests/rules/test_<module>.py mirrors it (CONTRIBUTING.md, "Layout")."""
    import importlib
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    modules = [spec.module for spec in rules.RULES]
    assert len(set(modules)) == len(modules)  # one module per rule
    for spec in rules.RULES:
        module = importlib.import_module(f"vllm_mamba_fix.rules.{spec.module}")
        first = Path(module.__file__ or "").read_text().splitlines()[0]
        assert first.startswith(f"# Rule:     {spec.rule.value} (Rule.{spec.rule.name} "), first
        assert (repo / "tests" / "rules" / f"test_{spec.module}.py").is_file(), spec.module
