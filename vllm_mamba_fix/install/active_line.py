"""The one line each scheduler class built logs at start-up, and what goes with it.

The active line is for an operator: at most :data:`ACTIVE_LINE_LIMIT` characters naming the
version, the class, the rules, the block and the settings changed from their defaults. Why
each rule runs or is left out, and the methods wrapped, go to a DEBUG line and to the record's
fields (``reasons``, ``wraps``); doctor reports them too. Warnings come first: a method the fix
does not reach, and split rules that stand down.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

from vllm_mamba_fix._log import fields, logger
from vllm_mamba_fix._version import __version__
from vllm_mamba_fix.changes import say_once
from vllm_mamba_fix.decide.policy import Rule
from vllm_mamba_fix.facts.blocks import BlockUnit
from vllm_mamba_fix.facts.config import Settings
from vllm_mamba_fix.facts.versions import Family
from vllm_mamba_fix.observe.record import ClassRecord, MethodState, class_name
from vllm_mamba_fix.rules import table as rules


class Installed(Protocol):
    """What the line reads of the installation (plugin.py's)."""

    base: type
    settings: Settings
    family: Family
    version: str
    unpatchable_on_base: frozenset[str]


ACTIVE_LINE_LIMIT = 300  # characters: one line an operator reads, as vLLM's own INFO lines


def _reasons_text(result: ClassRecord) -> str:
    """Why each rule runs or not, and what an inherited rule rides on: the DEBUG line's."""
    parts = [result.plan.describe(frozenset(v.rule for v in result.plan.verdicts))]
    for rule in sorted(result.inherited, key=lambda r: r.value):
        method = result.method(rules.RULE_METHOD[rule])
        parts.append(f"{rule.value} [inherited: {method.note if method else ''}]")
    return "; ".join(p for p in parts if p)


def _block_text(unit: BlockUnit | None) -> str:
    if unit is None:
        return "block unknown (dry run)"
    if unit.mamba is None:
        return "block none"
    return f"block {unit.mamba} (cache_config {unit.configured})" if unit.differs else (
        f"block {unit.mamba}"
    )  # fmt: skip


def _active_line(result: ClassRecord, installed: Installed) -> str:
    """``vllm-mamba-fix <version> active: <class> carries <rule>, ... [block N; <notes>;
    <setting>=<value>, ...] (vLLM <version>, pid N)``: the settings away from their
    defaults only; at most :data:`ACTIVE_LINE_LIMIT` characters (the class's short name,
    then a count of the settings, where the whole would be longer)."""
    cls = result.scheduler_class
    carried = ", ".join(
        f"{r.value} (inherited)" if r in result.inherited else r.value
        for r in Rule
        if r in result.rules
    )
    notes = [_block_text(result.block)] + (["split rules idle"] if result.split_idle else [])
    changed = [f"{k}={v}" for k, v in installed.settings.changed().items()]
    short = cls.rsplit(".", 1)[-1]
    counted = [f"{len(changed)} settings changed"] if changed else []
    line = ""
    for shown, settings in ((cls, changed), (short, changed), (short, counted)):
        bracket = "; ".join([*notes, ", ".join(settings)] if settings else notes)
        line = (
            f"vllm-mamba-fix {__version__} active: {shown} carries {carried} [{bracket}] "
            f"(vLLM {installed.version.strip()}, pid {os.getpid()})"
        )
        if len(line) <= ACTIVE_LINE_LIMIT:
            return line
    return line[: ACTIVE_LINE_LIMIT - 3] + "..."


def _warn_unreached(result: ClassRecord, installed: Installed) -> None:
    """One warning per method the class keeps from the fix, and where the split rules stand
    down."""
    base, cls = class_name(installed.base), result.scheduler_class
    for method in result.methods:
        if method.owner == base and method.name in installed.unpatchable_on_base:
            continue
        if method.state in (MethodState.OVERRIDDEN, MethodState.UNPATCHABLE):
            text = f"{cls}: {method.describe()}; the fix does not reach it"
            say_once(
                logging.WARNING, text, event="not-reached", scheduler_class=cls, method=method.name
            )
        elif method.state is MethodState.WRAPPED_REPLACEMENT:
            text = f"{cls}: {method.describe()}"
            say_once(logging.WARNING, text, scheduler_class=cls, method=method.name)
    unit = result.block
    runs_split = bool(result.rules & rules.SPLIT_RULES)
    if unit is not None and unit.mamba is None and not unit.no_mamba and runs_split:
        text = f"the split rules stand down for {cls}: {unit.problem}"
        say_once(
            logging.WARNING, text, event="stands-down", scheduler_class=cls, problem=unit.problem
        )


def log_record(result: ClassRecord, installed: Installed) -> None:
    """The class's one INFO line (active, or not needed); its reasons at DEBUG and in the
    records' fields."""
    _warn_unreached(result, installed)
    cls, unit = result.scheduler_class, result.block
    idle = f"; split rules idle: {result.split_idle}" if result.split_idle else ""
    # Every method wrapped for the rules: the encoder check's may carry only the split rule's ear.
    wrapped = [
        m for m in result.methods
        if m.state.carries_rules and (m.rules & result.rules or m.state is MethodState.WRAPPED)
    ]  # fmt: skip
    wraps = [m.wraps or m.name for m in wrapped]
    reasons = {v.rule.value: f"{v.basis}: {v.reason}" for v in result.plan.verdicts}
    logger.debug(
        "vllm-mamba-fix: why %s carries what it does: %s; block size %s%s; wraps %s "
        "(family %s, scope %s)",
        cls, _reasons_text(result), "unknown (dry run)" if unit is None else unit.describe(),
        idle, ", ".join(wraps) or "nothing", installed.family.name,
        installed.settings.scope.value,
        extra=fields("setup", scheduler_class=cls, wraps=wraps, reasons=reasons),
    )  # fmt: skip
    if not result.rules:
        say_once(
            logging.INFO,
            f"not needed for {cls} on vLLM {installed.version}: "
            f"{result.plan.describe()}{idle}; leaving it stock",
            event="not-needed", scheduler_class=cls, vllm_version=installed.version,
            reasons=reasons,
        )  # fmt: skip
        return
    extra = fields(
        "active", version=__version__, scheduler_class=cls,
        rules=[r.value for r in Rule if r in result.rules], wraps=wraps,
        block=None if unit is None else unit.mamba,
        configured_block=None if unit is None else unit.configured,
        vllm_version=installed.version, family=installed.family.name,
        scope=installed.settings.scope.value, reasons=reasons,
        settings=installed.settings.changed(),
    )  # fmt: skip
    logger.info("%s", _active_line(result, installed), extra=extra)
