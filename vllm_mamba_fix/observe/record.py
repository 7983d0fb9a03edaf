"""The typed record of what the plugin installed, per scheduler class, so neither the active
line, :func:`vllm_mamba_fix.stats` nor doctor parses log text."""

from __future__ import annotations

import enum
import threading
from typing import Any, NamedTuple

from vllm_mamba_fix.changes import installation
from vllm_mamba_fix.decide.plan import Plan, Rule
from vllm_mamba_fix.facts.blocks import BlockUnit
from vllm_mamba_fix.facts.evidence import Evidence
from vllm_mamba_fix.facts.targets import SPLIT_METHOD
from vllm_mamba_fix.observe import counters


class MethodState(enum.Enum):
    WRAPPED = "wrapped"  # the class resolves the method to the plugin's wrapper
    # Another plugin assigned its own method over our wrapper; we wrapped theirs.
    WRAPPED_REPLACEMENT = "wrapped-replacement"
    STOCK = "stock"  # no rule needs it for this class
    # A subclass's own method: not wrapped, as the rule re-asks stock and cannot vouch for it.
    OVERRIDDEN = "overridden"
    UNPATCHABLE = "unpatchable"  # its shape is not one the wrapper knows

    @property
    def carries_rules(self) -> bool:  # the plugin's wrapper runs, on the method or its replacement
        return self in (MethodState.WRAPPED, MethodState.WRAPPED_REPLACEMENT)


class MethodRecord(NamedTuple):
    name: str
    state: MethodState
    owner: str  # the class whose namespace holds what the class resolves
    wraps: str | None = None  # module.qualname of what the plugin's wrapper calls
    note: str = ""  # why it was left stock, or who replaced it
    rules: frozenset[Rule] = frozenset()  # what the resolved wrapper carries (own or inherited)

    def describe(self) -> str:
        text = f"{self.name} {self.state.value} on {self.owner}"
        text += f" (wraps {self.wraps})" if self.wraps else ""
        return f"{text}: {self.note}" if self.note else text


class ClassRecord(NamedTuple):
    scheduler_class: str  # module.qualname
    plan: Plan
    evidence: Evidence
    methods: tuple[MethodRecord, ...]
    block: BlockUnit | None = None  # of the scheduler built last; None in a dry run
    # Why vLLM never calls the last built scheduler's split (no Mamba group, no align mode), or None
    split_idle: str | None = None

    def method(self, name: str) -> MethodRecord | None:
        return next((m for m in self.methods if m.name == name), None)

    @property
    def rules(self) -> frozenset[Rule]:
        """The rules that really run: what the wrappers this class resolves to carry."""
        carried: set[Rule] = set()
        for m in self.methods:
            if m.state.carries_rules and not (m.name == SPLIT_METHOD and self.split_idle):
                carried |= m.rules
        return frozenset(carried)

    @property
    def left_out(self) -> frozenset[Rule]:  # planned, but overridden, unpatchable or never called
        return self.plan.rules - self.rules

    @property
    def inherited(self) -> frozenset[Rule]:  # run on a base's wrapper, not in this class's plan
        return self.rules - self.plan.rules

    def to_json(self) -> dict[str, Any]:
        return {
            "scheduler_class": self.scheduler_class,
            "rules": sorted(rule.value for rule in self.rules),
            "left_out": sorted(rule.value for rule in self.left_out),
            "inherited": sorted(rule.value for rule in self.inherited),
            "block_size": None if self.block is None else self.block.mamba,
            "cache_config_block_size": None if self.block is None else self.block.configured,
            "block_rule_engaged": bool(self.block and self.block.differs)
            and Rule.BLOCK_UNIT in self.rules,
            "split_idle": self.split_idle,
            "methods": [
                {"name": m.name, "state": m.state.value, "owner": m.owner, "wraps": m.wraps,
                 "note": m.note, "rules": sorted(r.value for r in m.rules)}
                for m in self.methods
            ],
        }  # fmt: skip


_lock = threading.Lock()


class Records(dict[str, ClassRecord]):
    """The session's memory: each scheduler class's record, by its name."""


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def remember(record: ClassRecord) -> None:
    with _lock:
        installation.memory[Records][record.scheduler_class] = record


def recorded(name: str) -> ClassRecord | None:
    with _lock:
        return installation.memory[Records].get(name)


def note_block_unit(cls: type, unit: BlockUnit) -> None:  # settled at a scheduler's first split
    with _lock:
        known = installation.memory[Records]
        found = known.get(class_name(cls))
        if found is not None:
            known[found.scheduler_class] = found._replace(block=unit)
    counters.record_block_unit(unit.mamba, unit.configured)  # the block-size gauges


def records() -> tuple[ClassRecord, ...]:
    with _lock:
        return tuple(installation.memory[Records].values())
