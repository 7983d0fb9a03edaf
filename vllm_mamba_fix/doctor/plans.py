"""The plans doctor shows, taken from the records the dry run made, and the block facts.

The base class's record holds the plan the dry run ran. Two more views answer other
questions, from the same table (:func:`vllm_mamba_fix.rules.table.plan`):

- what the release data alone says (no code read), and
- what the release needs: the code first, the version second, before the settings
  that force a rule (``VLLM_MAMBA_FIX=force``) or switch one off. It is the record's
  plan itself unless the dry run ran under such a setting.

Both keep the user's other settings (stall watchdog, stall-end bound, scope).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_mamba_fix.decide.policy import Plan, Rule
from vllm_mamba_fix.facts.blocks import BlockUnit
from vllm_mamba_fix.facts.config import Mode, Settings
from vllm_mamba_fix.facts.evidence import UNREADABLE, Evidence
from vllm_mamba_fix.facts.versions import Family
from vllm_mamba_fix.observe.record import ClassRecord
from vllm_mamba_fix.rules.table import plan


def unforced(settings: Settings) -> Settings:
    """``settings`` under ``auto`` with every rule switched on."""
    return dataclasses.replace(settings, mode=Mode.AUTO, switched_off=frozenset(), problems=())


def version_plan(settings: Settings, family: Family) -> Plan:
    """What the release data alone decides (no code read), under the user's settings."""
    return plan(unforced(settings), family, Evidence())


@dataclass(frozen=True)
class Views:
    evidence: Evidence  # the base class's code, as its record read it
    recorded: Plan | None  # the base class's record: what the dry run ran (None: no record)
    decided: Plan | None  # what the plugin runs with the user's settings (None: it will not)
    by_version: Plan
    by_code: Plan  # what the release needs (see the module docstring)
    planned: frozenset[Rule]  # what the dry run meant to install on the base class
    installed: frozenset[Rule]  # what runs on the base class, by its record


def views(
    settings: Settings,
    ran_with: Settings | None,
    family: Family,
    will_patch: bool,
    base_record: ClassRecord | None,
    evidence: Evidence,
) -> Views:
    """``ran_with``: the settings the dry run used (None: no dry run)."""
    by_version = version_plan(settings, family)
    if base_record is None:
        # Nothing was read from code: the release data decides what is needed.
        planned = by_version.rules if ran_with is not None else frozenset()
        return Views(evidence, None, None, by_version, by_version, planned, frozenset())
    recorded = base_record.plan
    ran = ran_with or settings
    by_code = recorded
    if ran.mode is not Mode.AUTO or ran.switched_off:
        by_code = plan(unforced(settings), family, base_record.evidence)
    return Views(
        base_record.evidence,
        recorded,
        recorded if will_patch else None,
        by_version,
        by_code,
        recorded.rules,
        base_record.rules,
    )


def no_record_evidence(why: str) -> Evidence:
    return dataclasses.replace(UNREADABLE, problem=f"not read: {why}")


@dataclass(frozen=True)
class BlockFact:
    """What a built scheduler's record says about its block sizes."""

    scheduler_class: str
    unit: BlockUnit
    runs_block_rule: bool  # the class's wrappers carry the block-unit rule
    split_idle: str | None

    @property
    def engaged(self) -> bool:
        return self.runs_block_rule and self.unit.differs and not self.split_idle

    def to_json(self) -> dict[str, object]:
        return {
            "class": self.scheduler_class,
            "block_size": self.unit.mamba,
            "cache_config_block_size": self.unit.configured,
            "differs": self.unit.differs,
            "engaged": self.engaged,
            "split_idle": self.split_idle,
            "problem": self.unit.problem,
        }

    def describe(self) -> str:
        name = self.scheduler_class
        if self.split_idle:
            return f"idle for {name}: {self.split_idle}"
        if self.unit.mamba is None:
            return f"cannot tell for {name}: {self.unit.problem}"
        if not self.unit.differs:
            return f"not engaged for {name}: both sizes are {self.unit.mamba}"
        sizes = (
            f"the Mamba KV cache stores {self.unit.mamba}-token blocks, "
            f"cache_config.block_size is {self.unit.configured}"
        )
        return f"{'engaged' if self.engaged else 'NOT engaged'} for {name}: {sizes}"


def block_facts(records: Sequence[ClassRecord]) -> tuple[BlockFact, ...]:
    """The records of schedulers already built in this process (a dry run builds none)."""
    return tuple(
        BlockFact(r.scheduler_class, r.block, Rule.BLOCK_UNIT in r.rules, r.split_idle)
        for r in records
        if r.block is not None
    )


def mismatched(facts: Sequence[BlockFact]) -> list[str]:
    """Classes whose built scheduler calls the split with the two block sizes apart."""
    return [f.scheduler_class for f in facts if f.unit.differs and not f.split_idle]
