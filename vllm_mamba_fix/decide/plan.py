"""The rules' names, a verdict on one, and a plan of them: plain values, no imports of ours
(the install record keeps plans without the deciding, :mod:`vllm_mamba_fix.decide.policy`)."""

from __future__ import annotations

import enum
from typing import NamedTuple


class Rule(enum.Enum):  # what the plugin may install; rules/table.py says how
    SPLIT = "split"
    BLOCK_UNIT = "block-unit"
    SPECULATIVE_STALL = "speculative-stall"
    STALL_WATCHDOG = "stall-watchdog"
    STALL_END = "stall-end"


class RuleVerdict(NamedTuple):
    rule: Rule
    active: bool
    basis: str  # what decided: "code", "version" or "setting"
    reason: str
    # Where a setting decided (a switch off, force): what the code or version says, so the
    # install record holds what the release needs too (doctor reads it from there).
    unset: RuleVerdict | None = None

    @property
    def by_release(self) -> RuleVerdict:
        return self.unset or self


class Plan(NamedTuple):
    verdicts: tuple[RuleVerdict, ...]

    @property
    def rules(self) -> frozenset[Rule]:
        return frozenset(v.rule for v in self.verdicts if v.active)

    def verdict(self, rule: Rule) -> RuleVerdict:
        return next(v for v in self.verdicts if v.rule is rule)

    def describe(self, rules: frozenset[Rule] | None = None) -> str:
        """The verdicts on ``rules`` (default: the inactive ones), for a log line."""
        chosen = [
            v for v in self.verdicts if (v.rule in rules if rules is not None else not v.active)
        ]
        return "; ".join(f"{v.rule.value} [{v.basis}: {v.reason}]" for v in chosen)
