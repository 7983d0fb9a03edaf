"""The typed record of what the plugin installed, per scheduler class.

Written when a scheduler is built (and by doctor's dry run); the active line,
:func:`vllm_mamba_fix.stats` and doctor all read it, so none of them parses log text.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Any

from vllm_mamba_fix.blocks import BlockUnit
from vllm_mamba_fix.evidence import Evidence
from vllm_mamba_fix.policy import Plan, Rule
from vllm_mamba_fix.targets import ENCODER_METHOD, SPLIT_METHOD

# The method that carries each rule.
RULE_METHOD: dict[Rule, str] = {
    Rule.SPLIT: SPLIT_METHOD,
    Rule.SPECULATIVE_STALL: ENCODER_METHOD,
    Rule.STALL_WATCHDOG: ENCODER_METHOD,
}


class MethodState(enum.Enum):
    WRAPPED = "wrapped"  # the class resolves the method to the plugin's wrapper
    # Another plugin assigned its own method over our wrapper; we wrapped theirs.
    WRAPPED_REPLACEMENT = "wrapped-replacement"
    STOCK = "stock"  # no rule needs it for this class
    # A subclass defines its own method: not wrapped, since the rule re-asks the
    # stock method and cannot vouch for another's contract.
    OVERRIDDEN = "overridden"
    UNPATCHABLE = "unpatchable"  # its shape is not one the wrapper knows

    @property
    def carries_rules(self) -> bool:
        return self in (MethodState.WRAPPED, MethodState.WRAPPED_REPLACEMENT)


@dataclass(frozen=True)
class MethodRecord:
    name: str
    state: MethodState
    owner: str  # the class whose namespace holds what the class resolves
    wraps: str | None = None  # module.qualname of what the plugin's wrapper calls
    note: str = ""  # why it was left stock, or who replaced it

    def describe(self) -> str:
        text = f"{self.name} {self.state.value} on {self.owner}"
        if self.wraps:
            text += f" (wraps {self.wraps})"
        return f"{text}: {self.note}" if self.note else text


@dataclass(frozen=True)
class ClassRecord:
    scheduler_class: str  # module.qualname
    plan: Plan
    evidence: Evidence
    methods: tuple[MethodRecord, ...]
    block: BlockUnit | None = None  # of the scheduler built last; None in a dry run

    def method(self, name: str) -> MethodRecord | None:
        return next((m for m in self.methods if m.name == name), None)

    @property
    def rules(self) -> frozenset[Rule]:
        """The planned rules whose method really carries the plugin's wrapper."""
        carried = {m.name for m in self.methods if m.state.carries_rules}
        return frozenset(rule for rule in self.plan.rules if RULE_METHOD[rule] in carried)

    @property
    def left_out(self) -> frozenset[Rule]:
        """Planned rules that do not run: their method is overridden or unpatchable."""
        return self.plan.rules - self.rules

    def to_json(self) -> dict[str, Any]:
        return {
            "scheduler_class": self.scheduler_class,
            "rules": sorted(rule.value for rule in self.rules),
            "left_out": sorted(rule.value for rule in self.left_out),
            "block_size": None if self.block is None else self.block.mamba,
            "cache_config_block_size": None if self.block is None else self.block.configured,
            "methods": [
                {"name": m.name, "state": m.state.value, "owner": m.owner, "wraps": m.wraps,
                 "note": m.note}
                for m in self.methods
            ],
        }  # fmt: skip


_lock = threading.Lock()
_records: dict[str, ClassRecord] = {}


def remember(record: ClassRecord) -> bool:
    """Store ``record``; returns whether it differs from the one stored for its class."""
    with _lock:
        changed = _records.get(record.scheduler_class) != record
        _records[record.scheduler_class] = record
        return changed


def records() -> tuple[ClassRecord, ...]:
    """What the plugin installed for each scheduler class built in this process."""
    with _lock:
        return tuple(_records.values())


def forget_all() -> None:
    with _lock:
        _records.clear()
