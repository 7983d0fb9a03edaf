"""The rule table: every rule the plugin can install, and every method that carries rules.

One :class:`RuleSpec` per rule (its module, the method whose wrapper carries it, its verdict in
:mod:`vllm_mamba_fix.decide.policy`, its switch, its ``stats()`` keys) and one
:class:`MethodSpec` per wrapped method (how its wrapper is built, which rules it carries).
Patch, plugin, doctor and the docs read them (CONTRIBUTING.md, "Adding a rule").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from vllm_mamba_fix.decide.policy import (
    Earlier,
    Facts,
    Plan,
    Rule,
    RuleVerdict,
    block_unit_verdict,
    speculative_verdict,
    split_verdict,
    stall_end_verdict,
    watchdog_verdict,
)
from vllm_mamba_fix.decide.scope import ScopePolicy
from vllm_mamba_fix.facts.config import (
    ENV_BLOCK_RULE,
    ENV_END_STALLS_AFTER,
    ENV_MODE,
    ENV_SPLIT_RULE,
    ENV_STALL_SECONDS,
    Settings,
)
from vllm_mamba_fix.facts.evidence import Evidence
from vllm_mamba_fix.facts.targets import (
    ENCODER_METHOD,
    FREE_REQUEST_METHOD,
    INIT_METHOD,
    MARKER,
    SPLIT_METHOD,
    UPDATE_METHOD,
)
from vllm_mamba_fix.facts.versions import Family, PrefillGate
from vllm_mamba_fix.rules.encoder_wrapper import EncoderOptions, make_encoder_wrapper
from vllm_mamba_fix.rules.split_rule import WrapOptions, make_wrapper
from vllm_mamba_fix.rules.stall_end import EndOptions, make_update_from_output_wrapper


# NamedTuples, not frozen dataclasses: built at every patch, a tenth of the cost (start-up).
class RuleSpec(NamedTuple):
    rule: Rule
    module: str  # its module in this folder: header, when it applies, what it does per call
    method: str  # the Scheduler method whose wrapper carries it
    decide: Callable[[Facts, Earlier], RuleVerdict]  # decided in table order
    switch: str  # the variable that turns it off (config.ALL_VARIABLES)
    stats_keys: tuple[str, ...]  # its counters in stats()
    fixes: bool  # ends a hang or a wrong token (doctor: "needed"), not only reports


class MethodSpec(NamedTuple):
    name: str
    # The wrapper's options for the rules a plan gives this method; None: not wrapped.
    options: Callable[[frozenset[Rule], Facts, ScopePolicy], Any]
    wrap: Callable[[Callable[..., Any], Any], Callable[..., Any]]
    # The rules a built wrapper's options carry.
    carried: Callable[[Any], frozenset[Rule]]


RULES: tuple[RuleSpec, ...] = (
    RuleSpec(
        Rule.SPLIT, "split_rule", SPLIT_METHOD, split_verdict, ENV_SPLIT_RULE,
        ("collapses_prevented", "chunks_realigned", "chunks_stopped_at_encoder_input",
         "encoder_references_dropped"),
        fixes=True,
    ),
    RuleSpec(
        Rule.BLOCK_UNIT, "block_unit", SPLIT_METHOD, block_unit_verdict, ENV_BLOCK_RULE,
        ("block_rule_chunks", "chunks_realigned"), fixes=True,
    ),
    RuleSpec(
        Rule.SPECULATIVE_STALL, "speculative_stall", ENCODER_METHOD, speculative_verdict,
        ENV_MODE, ("speculative_stalls_released",), fixes=True,
    ),
    RuleSpec(
        Rule.STALL_WATCHDOG, "stall_watch", UPDATE_METHOD, watchdog_verdict, ENV_STALL_SECONDS,
        ("stalls_detected", "stalls_resolved"), fixes=False,
    ),
    RuleSpec(
        Rule.STALL_END, "stall_end", UPDATE_METHOD, stall_end_verdict, ENV_END_STALLS_AFTER,
        ("stalls_ended",), fixes=False,
    ),
)  # fmt: skip


def _split_options(rules: frozenset[Rule], facts: Facts, scope: ScopePolicy) -> WrapOptions | None:
    if not rules & {Rule.SPLIT, Rule.BLOCK_UNIT}:
        return None
    family = facts.family
    # FORCE on an unreadable version has no gate of its own: 0.17+'s.
    gate = family.prefill_gate or PrefillGate.BEFORE_PREFILL_END
    return WrapOptions(
        gate,
        scope,
        deadlock_rules=Rule.SPLIT in rules,
        block_rule=Rule.BLOCK_UNIT in rules,
        # From 0.27 vLLM's split stops every mid-block chunk at the next boundary itself.
        realign_others=not family.stops_mid_block,
        absolute_end=family.absolute_end,
        advances_sub_block=family.advances_sub_block,
    )


def _split_carried(options: WrapOptions) -> frozenset[Rule]:
    on = ((Rule.SPLIT, options.deadlock_rules), (Rule.BLOCK_UNIT, options.block_rule))
    return frozenset(rule for rule, carried in on if carried)


def _encoder_options(
    rules: frozenset[Rule], facts: Facts, scope: ScopePolicy
) -> EncoderOptions | None:
    # Wrapped wherever the split rule runs too: its ear (encoder_cut.py).
    if not rules & {Rule.SPLIT, Rule.SPECULATIVE_STALL}:
        return None
    return EncoderOptions(scope, release_speculative_stalls=Rule.SPECULATIVE_STALL in rules)


def _encoder_carried(options: EncoderOptions) -> frozenset[Rule]:
    return frozenset({Rule.SPECULATIVE_STALL} if options.release_speculative_stalls else ())


def _update_options(rules: frozenset[Rule], facts: Facts, scope: ScopePolicy) -> EndOptions | None:
    settings = facts.settings
    seconds = settings.stall_seconds if Rule.STALL_WATCHDOG in rules else None
    after = settings.end_stalls_after if Rule.STALL_END in rules else None
    if seconds is None and after is None:
        return None
    return EndOptions(seconds, after)


def _update_carried(options: EndOptions) -> frozenset[Rule]:
    on = ((Rule.STALL_WATCHDOG, options.stall_seconds), (Rule.STALL_END, options.end_stalls_after))
    return frozenset(rule for rule, seconds in on if seconds is not None)


METHODS: tuple[MethodSpec, ...] = (
    MethodSpec(SPLIT_METHOD, _split_options, make_wrapper, _split_carried),
    MethodSpec(ENCODER_METHOD, _encoder_options, make_encoder_wrapper, _encoder_carried),
    # The watchdog's per-step look and the stall end: the watchdog orders, at one step, the
    # ends this wrapper carries out at the next.
    MethodSpec(UPDATE_METHOD, _update_options, make_update_from_output_wrapper, _update_carried),
)

# The rule-carrying methods, in the order the log names them.
RULE_METHODS: tuple[str, ...] = tuple(spec.name for spec in METHODS)
# Every method the plugin wraps: the rule carriers, __init__ and _free_request.
ALL_WRAPPED: tuple[str, ...] = (*RULE_METHODS, INIT_METHOD, FREE_REQUEST_METHOD)
# Per method, the method whose wrapper its rules act through: none does (each carries its own).
NEEDS: dict[str, str] = {}
RULE_METHOD: dict[Rule, str] = {spec.rule: spec.method for spec in RULES}
FIX_RULES: tuple[Rule, ...] = tuple(spec.rule for spec in RULES if spec.fixes)
# Rules of the split method, which do nothing where vLLM never calls it.
SPLIT_RULES: frozenset[Rule] = frozenset(r for r, m in RULE_METHOD.items() if m == SPLIT_METHOD)


def method_spec(name: str) -> MethodSpec:
    return next(spec for spec in METHODS if spec.name == name)


def rules_through(name: str, chosen: frozenset[Rule]) -> list[Rule]:
    """The ``chosen`` rules that act through method ``name``'s wrapper, in table order."""
    return [spec.rule for spec in RULES if spec.rule in chosen and spec.method == name]


def plan(settings: Settings, family: Family, evidence: Evidence) -> Plan:
    """Which rules to install, in table order; code first, version second, per rule."""
    facts = Facts(settings, family, evidence)
    decided: dict[Rule, RuleVerdict] = {}
    for spec in RULES:
        decided[spec.rule] = spec.decide(facts, decided)
    return Plan(tuple(decided.values()))


def options_for(decided: Plan, facts: Facts, scope: ScopePolicy) -> dict[str, Any]:
    """Per rule-carrying method, its wrapper's options under ``decided`` (None: not wrapped)."""
    return {spec.name: spec.options(decided.rules, facts, scope) for spec in METHODS}


def carried_by(function: Any, name: str) -> frozenset[Rule]:
    """The rules the plugin's wrapper ``function`` of method ``name`` carries."""
    options = getattr(function, MARKER, None)
    if options is None or name not in RULE_METHODS:
        return frozenset()
    return method_spec(name).carried(options)
