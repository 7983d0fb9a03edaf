"""The one line each scheduler class built logs at start-up (at most :data:`ACTIVE_LINE_LIMIT`
characters), the warnings before it, and the reasons at DEBUG and in the record's fields."""

from __future__ import annotations

import logging
import os
from typing import Protocol

from vllm_mamba_fix._log import fields, logger
from vllm_mamba_fix._version import __version__
from vllm_mamba_fix.changes import say_once
from vllm_mamba_fix.decide.policy import Rule
from vllm_mamba_fix.facts.config import Settings
from vllm_mamba_fix.facts.targets import SPLIT_METHOD
from vllm_mamba_fix.facts.versions import Family
from vllm_mamba_fix.observe.record import ClassRecord, MethodState, class_name


class Installed(Protocol):  # what the line reads of plugin.py's installation
    base: type
    settings: Settings
    family: Family
    version: str
    unpatchable_on_base: frozenset[str]


ACTIVE_LINE_LIMIT = 300  # characters: one line an operator reads, as vLLM's own INFO lines


def _active_line(result: ClassRecord, installed: Installed) -> str:
    """``vllm-mamba-fix <version> active: <class> carries <rule>, ... [block N; <notes>;
    <setting>=<value>, ...] (vLLM <version>, pid N)``; where longer than the limit, the
    class's short name, then a count of the settings."""
    cls = result.scheduler_class
    carried = ", ".join(
        f"{r.value} (inherited)" if r in result.inherited else r.value
        for r in Rule
        if r in result.rules
    )
    unit = result.block
    block = "block unknown (dry run)" if unit is None else f"block {unit.mamba or 'none'}"
    if unit is not None and unit.differs:
        block += f" (cache_config {unit.configured})"
    notes = [block] + (["split rules idle"] if result.split_idle else [])
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
    """One warning per method the class keeps from the fix, and where the split rules stand down."""
    base, cls = class_name(installed.base), result.scheduler_class
    for method in result.methods:
        if method.owner == base and method.name in installed.unpatchable_on_base:
            continue
        if method.state in (MethodState.OVERRIDDEN, MethodState.UNPATCHABLE):
            text = f"{cls}: {method.describe()}; the fix does not reach it"
            where = {"event": "not-reached", "scheduler_class": cls, "method": method.name}
            say_once(logging.WARNING, text, **where)
        elif method.state is MethodState.WRAPPED_REPLACEMENT:
            text = f"{cls}: {method.describe()}"
            say_once(logging.WARNING, text, scheduler_class=cls, method=method.name)
    unit = result.block
    split = result.method(SPLIT_METHOD)
    runs_split = split is not None and bool(result.rules & split.rules)
    if unit is not None and unit.mamba is None and not unit.no_mamba and runs_split:
        text = f"the split rules stand down for {cls}: {unit.problem}"
        say_once(
            logging.WARNING, text, event="stands-down", scheduler_class=cls, problem=unit.problem
        )


def log_record(result: ClassRecord, installed: Installed) -> None:
    """The class's one INFO line (active, or not needed); its reasons at DEBUG and in fields."""
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
    why = [result.plan.describe(frozenset(v.rule for v in result.plan.verdicts))]
    for rule in sorted(result.inherited, key=lambda r: r.value):  # and what it rides on
        method = next((m for m in result.methods if rule in m.rules), None)
        why.append(f"{rule.value} [inherited: {method.note if method else ''}]")
    why_text = "; ".join(p for p in why if p)
    logger.debug(
        "vllm-mamba-fix: why %s carries what it does: %s; block size %s%s; wraps %s "
        "(family %s, scope %s)",
        cls, why_text, "unknown (dry run)" if unit is None else unit.describe(),
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
