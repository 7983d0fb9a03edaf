"""``main()``, the command, and ``run()``: the checks in order, each filling in part of the
report's JSON body, then the verdict, whose one input is the install records the dry run made
(:func:`vllm_mamba_fix.doctor.verdict.of_records`). The one doctor module that imports
:mod:`vllm_mamba_fix.install.plugin`: it hands it to the dry run and the entry-point check."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_mamba_fix._version import __version__
from vllm_mamba_fix.decide.policy import Plan, PreflightResult, Rule, preflight
from vllm_mamba_fix.doctor import verdict
from vllm_mamba_fix.doctor.checks.entry_point import (
    check_entry_point,
    check_platform_plugins,
    check_vllm_plugins,
)
from vllm_mamba_fix.doctor.checks.rules import rule_table
from vllm_mamba_fix.doctor.checks.schedulers import (
    DryRun,
    Target,
    default_targets,
    dry_run,
    scheduler_entries,
)
from vllm_mamba_fix.doctor.checks.settings import check_settings
from vllm_mamba_fix.doctor.checks.speculative import (
    OWN_KV_GROUP_TEXT,
    check_speculative,
)
from vllm_mamba_fix.doctor.checks.support import check_metrics, check_stall_end
from vllm_mamba_fix.doctor.checks.vllm_import import import_step
from vllm_mamba_fix.doctor.cli import build_parser
from vllm_mamba_fix.doctor.render import render_output
from vllm_mamba_fix.doctor.report import (
    EXIT_CANNOT_TELL,
    EXIT_INVALID_INPUT,
    STATUS,
    Report,
    one_line,
    package_path,
)
from vllm_mamba_fix.facts.config import ENV_MODE, Mode, Settings, load_settings
from vllm_mamba_fix.facts.evidence import UNREADABLE, Evidence
from vllm_mamba_fix.facts.versions import Family, Verdict
from vllm_mamba_fix.install import plugin
from vllm_mamba_fix.rules import table as rules
from vllm_mamba_fix.rules.table import plan

_TOP_LEVEL_FLAGS = ("-h", "--help", "--version")


@dataclasses.dataclass
class _Run:
    """What the steps of one run share."""

    report: Report
    settings: Settings
    version: str
    family: Family
    checked: PreflightResult
    targets: list[Target]
    bad_input: list[str] = dataclasses.field(default_factory=list)
    dry: DryRun | None = None
    found: verdict.Found = dataclasses.field(default_factory=lambda: verdict.of_records(()))
    evidence: Evidence = UNREADABLE  # the base class's code, as its record read it

    @property
    def will_patch(self) -> bool:
        return self.checked.outcome.waits_for_scheduler

    @property
    def decided(self) -> Plan | None:
        """What the plugin runs with the user's settings (None: it will not act)."""
        return self.found.base.plan if self.will_patch and self.found.base else None

    @property
    def by_version(self) -> Plan:
        """What the release data alone says (no code read): the report's ``version`` column."""
        unforced = dataclasses.replace(
            self.settings, mode=Mode.AUTO, switched_off=frozenset(), problems=()
        )
        return plan(unforced, self.family, Evidence())


def _finish(
    report: Report, status: str, version: str | None, reason: str, bad_input: list[str]
) -> Report:
    report.data["status"] = status
    report.data["exit_code"] = STATUS[status][0]
    report.problems[:0] = bad_input
    report.data["summary"] = verdict.summary(status, version, reason, report.problems)
    report.data["problems"] = report.problems
    report.data["warnings"] = report.warnings
    return report


def _delivery_checks(report: Report, settings: Settings) -> verdict.Delivery:
    """Entry point, VLLM_PLUGINS and the plugin's settings: will vLLM load and run it?"""
    ep_ok = check_entry_point(report, plugin.register)
    allowed = check_vllm_plugins(report)
    check_settings(report, settings)
    return verdict.Delivery(
        settings.mode,
        report.data["settings"]["env"][ENV_MODE],
        None if ep_ok else report.data["entry_point"].get("error", "entry point missing"),
        allowed,
        report.data["vllm_plugins"]["value"],
    )


def _dry_run_step(state: _Run) -> None:
    if state.family.verdict is Verdict.ABSENT:
        state.report.data["dry_run"] = {"ran": False}
        return
    forced: Settings | None = None
    if not state.will_patch:
        # Disabled, or an unreadable version: run the same path as enabling it would.
        mode = Mode.AUTO if state.family.verdict is not Verdict.UNKNOWN else Mode.FORCE
        forced = dataclasses.replace(state.settings, mode=mode, problems=())
    started = time.perf_counter()
    state.dry = dry_run(state.report, forced, state.targets, plugin)
    state.report.data["timings_seconds"]["dry_run"] = round(time.perf_counter() - started, 3)


def _records_step(state: _Run) -> None:
    """Read the install records the dry run made: the verdict's one input."""
    dry = state.dry
    state.found = verdict.of_records(dry.records if dry is not None else ())
    base = state.found.base
    if dry is None:
        state.evidence = Evidence(problem="not read: this release has nothing to patch")
    elif base is not None:
        state.evidence = base.evidence
    else:
        why = state.report.data["dry_run"].get("error") or "no record"  # cannot load it, ...
        state.evidence = dataclasses.replace(UNREADABLE, problem=f"not read: {why}")
    read_from = verdict.BASE_SCHEDULER if base is not None else None
    state.report.data["evidence"] = {
        "read_from": read_from,
        "split_after_encoder": state.evidence.split_after_encoder,
        "deferred_encoder_free": state.evidence.deferred_encoder_free,
        "problem": state.evidence.problem,
    }


def _speculative_step(state: _Run, speculative_config: Mapping[str, Any] | None) -> verdict.Setup:
    """The --speculative-config, and what the verdict needs beyond the records."""
    found = state.found
    spec = check_speculative(
        speculative_config, state.version, state.family, state.decided, found.installed
    )
    state.report.data["speculative"] = spec.data
    if spec.invalid:
        state.bad_input.append(spec.invalid)
    state.report.warnings.extend(spec.warnings)
    release = found.release or state.by_version
    foreseen: dict[Rule, str] = {}
    if release.verdict(Rule.BLOCK_UNIT).active and spec.data.get("drafter_kv_group"):
        method = spec.data["resolved_method"]
        foreseen[Rule.BLOCK_UNIT] = f"--speculative-config {method}: {OWN_KV_GROUP_TEXT}"
    not_eagle = spec.data["resolved_method"] if spec.eagle is False else ""
    setup = verdict.Setup(
        state.family, state.version, state.will_patch, state.checked.reason,
        state.by_version, not_eagle, foreseen,
    )  # fmt: skip
    return setup


def _rule_entries_step(
    state: _Run, setup: verdict.Setup, needed: frozenset[Rule]
) -> tuple[list[dict[str, Any]], dict[Rule, str]]:
    found = state.found
    inactive = ("setting" if state.settings.mode is Mode.OFF else "version", setup.preflight_reason)
    release = found.release or state.by_version
    entries = rule_table(state.evidence, state.by_version, release, state.decided, inactive)
    rule_problems = verdict.rule_problems(found, state.report.data["dry_run"].get("error"))
    for entry in entries:
        rule = Rule(entry["rule"])
        fixes = rule in rules.FIX_RULES
        entry["needed"] = rule in needed if fixes else None
        entry["installs"] = rule in found.installed
        entry["needed_by_classes"] = list(found.needed_by.get(rule, ()))
        entry["problem"] = rule_problems.get(rule)
        if rule in verdict.PER_SCHEDULER:
            # Only a built scheduler's record tells (a dry run builds none), or a set-up
            # that makes the sizes differ (a drafter with its own KV cache group).
            entry["needed"] = entry["needed"] if found.facts or rule in setup.foreseen else None
            entry["block_facts"] = [fact.to_json() for fact in found.facts]
            entry["foreseen"] = setup.foreseen.get(rule)
    state.report.data["rules"] = entries
    return entries, rule_problems


def _scheduler_step(state: _Run, needed: frozenset[Rule]) -> list[str]:
    """The dry run's lines and one entry per class; returns the classes' problems."""
    report, dry = state.report, state.dry
    class_problems: list[str] = []
    # Of a scheduler already built in this process; a dry run builds none.
    report.data["block_size"] = next((f.unit.mamba for f in state.found.facts), None)
    if dry is None:
        return class_problems
    entries = scheduler_entries(report, dry, state.found, needed)
    report.data["schedulers"] = entries
    report.data["install_records"] = [r.to_json() for r in dry.records]
    for entry, check in zip(entries, dry.classes, strict=True):
        if check.error is not None and check.target.custom:
            state.bad_input.append(f"--scheduler-cls {check.target.qualname}: {check.error}")
        elif check.error is not None:
            class_problems.append(check.error)
        else:
            class_problems.extend(entry["problems"])
    seen = {entry["class"] for entry in entries}
    for name in report.data["dry_run"]["overriding_subclasses"]:
        if name not in seen:
            report.warnings.append(
                f"loaded subclass {name} overrides a patched method; if vLLM uses it, "
                "the fix does not reach it"
            )
    return class_problems


def run(
    scheduler_cls: Sequence[str] = (), speculative_config: Mapping[str, Any] | None = None
) -> Report:
    report, settings = Report(), load_settings()
    report.data["tool"] = {"name": "vllm-mamba-fix", "version": __version__,
                           "package_path": package_path(), "python": sys.executable}  # fmt: skip
    version, family = import_step(report)
    report.data["schedulers"] = []
    if family is None or version is None:
        _delivery_checks(report, settings)
        report.data["dry_run"] = {"ran": False}
        return _finish(report, "unknown", version, "", [])
    state = _Run(
        report,
        settings,
        version,
        family,
        preflight(settings.mode, family, version),
        default_targets(list(scheduler_cls)),
    )
    _dry_run_step(state)
    _records_step(state)
    setup = _speculative_step(state, speculative_config)
    delivery = _delivery_checks(report, settings)  # a rule vLLM will not load does not run
    delivered = delivery.entry_point_error is None and delivery.vllm_plugins_allows
    setup = dataclasses.replace(setup, delivered=delivered)
    chosen = verdict.policy(state.found, setup)
    entries, rule_problems = _rule_entries_step(state, setup, chosen.needed)
    report.data["policy"] = chosen.to_json()
    if state.dry is not None:  # what two other modules say this release supports
        check_stall_end(report, [c.target.qualname for c in state.dry.classes if c.derives])
        check_metrics(report)
    class_problems = _scheduler_step(state, chosen.needed)
    rule_problems.update(verdict.switched_off(state.decided, chosen.needed, settings))
    report.problems.extend(verdict.problems(chosen, delivery, rule_problems, tuple(class_problems)))
    report.warnings.extend(verdict.rule_warnings(entries))
    check_platform_plugins(report)
    status = verdict.status(chosen, state.bad_input, report.problems)
    return _finish(report, status, version, chosen.reason, state.bad_input)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0].startswith("-") and args_list[0] not in _TOP_LEVEL_FLAGS):
        args_list.insert(0, "doctor")  # doctor is the default command
    try:
        args = build_parser().parse_args(args_list)
    except SystemExit as exc:  # argparse: usage error (2) or --help (0)
        return exc.code if isinstance(exc.code, int) else EXIT_INVALID_INPUT
    started = time.perf_counter()
    try:
        report = run(args.scheduler_cls, args.speculative_config)
    except KeyboardInterrupt:
        print("vllm-mamba-fix doctor: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"vllm-mamba-fix doctor: internal error: {one_line(exc)}", file=sys.stderr)
        return EXIT_CANNOT_TELL
    elapsed = time.perf_counter() - started
    report.data["elapsed_seconds"] = round(elapsed, 3)
    text = render_output(report, elapsed, args.json, args.report)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. piped into `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return int(report.data["exit_code"])


__all__ = ["main", "run"]
