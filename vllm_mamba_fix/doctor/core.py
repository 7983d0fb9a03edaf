"""``run()``: the checks in order, the verdict, and the report they fill in."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import vllm_mamba_fix
from vllm_mamba_fix import __version__, record
from vllm_mamba_fix.config import ENV_MODE, ENV_VLLM_PLUGINS, Mode, Settings, load_settings
from vllm_mamba_fix.doctor import verdict
from vllm_mamba_fix.doctor.checks.entry_point import check_entry_point
from vllm_mamba_fix.doctor.checks.rules import (
    evidence_json,
    evidence_text,
    rule_lines,
    rule_table,
    version_plan,
)
from vllm_mamba_fix.doctor.checks.schedulers import (
    BASE_SCHEDULER,
    DryRun,
    default_targets,
    dry_run,
    own_needs,
    scheduler_entries,
)
from vllm_mamba_fix.doctor.checks.settings import check_settings
from vllm_mamba_fix.doctor.checks.speculative import check_speculative
from vllm_mamba_fix.doctor.checks.vllm_import import import_vllm
from vllm_mamba_fix.doctor.checks.vllm_plugins import check_platform_plugins, check_vllm_plugins
from vllm_mamba_fix.doctor.report import STATUS, Report
from vllm_mamba_fix.evidence import UNREADABLE, Evidence
from vllm_mamba_fix.policy import Plan, Rule, preflight
from vllm_mamba_fix.record import ClassRecord
from vllm_mamba_fix.rules import RULE_METHOD, plan
from vllm_mamba_fix.versions import Family, Verdict, family_for


def _family_json(family: Family | None) -> dict[str, Any] | None:
    if family is None:
        return None
    return {"name": family.name, "verdict": family.verdict.value, "summary": family.summary}


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


def _rule_problems(
    planned: frozenset[Rule], base_record: ClassRecord | None, dry: DryRun | None, report: Report
) -> dict[Rule, str]:
    """Why each planned rule would not install on the base class, from the typed record."""
    found: dict[Rule, str] = {}
    installed = base_record.rules if base_record else frozenset()
    for rule in planned - installed:
        method = base_record.method(RULE_METHOD[rule]) if base_record else None
        if method is not None and method.note:
            why = method.note
        elif method is not None:
            why = method.describe()
        else:
            why = report.data["dry_run"].get("error", "no scheduler")
        found[rule] = f"{rule.value} would not apply: {why}"
    return found


def _dry_run_lines(
    report: Report,
    base_record: ClassRecord | None,
    planned: frozenset[Rule],
    needed: frozenset[Rule],
) -> None:
    info = report.data["dry_run"]
    label = "dry run"
    wrapped = info["wrapped_methods"]
    how = f"register() with {ENV_MODE}={info['mode']}" if info["forced"] else "register()"
    if wrapped:
        hook = "on import of the scheduler module" if info["via"] == "import hook" else "at once"
        undo = "undone" if info["restored"] else "NOT undone"
        names = " and ".join(f"Scheduler.{m}" for m in wrapped)
        plural = "s" if len(wrapped) > 1 else ""
        text = f"{how} patched {names} {hook}; wrapper{plural} verified; {undo}"
        if info["forced"]:
            text += " (would apply if enabled)"
        report.add("ok", label, text)
        if base_record is not None and base_record.rules and not info["forced"]:
            report.add(
                "info", "",
                f"expect one line per scheduler class built in each engine core's log: "
                f"vllm-mamba-fix {__version__} active: {base_record.scheduler_class} carries "
                f"{', '.join(r.value for r in Rule if r in base_record.rules)} ...",
            )  # fmt: skip
    elif not planned:
        report.add("info", label, f"{how} left the scheduler stock: no rule to install")
    else:
        bad = "fail" if needed else "info"
        report.add(bad, label, f"the patch did not apply: {info['error']}")


def run(
    scheduler_cls: Sequence[str] = (), speculative_config: Mapping[str, Any] | None = None
) -> Report:
    report = Report()
    settings = load_settings()
    report.data["tool"] = {
        "name": "vllm-mamba-fix",
        "version": __version__,
        "package_path": os.path.dirname(os.path.abspath(vllm_mamba_fix.__file__)),
        "python": sys.executable,
    }
    started = time.perf_counter()
    version = import_vllm(report)
    timings = {"import_vllm": round(time.perf_counter() - started, 3)}
    report.data["timings_seconds"] = timings
    family = family_for(version) if version is not None else None
    report.data["family"] = _family_json(family)
    targets = default_targets(list(scheduler_cls))
    bad_input: list[str] = []
    report.data["schedulers"] = []
    if family is None or version is None:
        check_entry_point(report)
        check_vllm_plugins(report)
        check_settings(report, settings)
        report.data["dry_run"] = {"ran": False}
        return _finish(report, "unknown", version, "", bad_input)

    checked = preflight(settings.mode, family, version)
    should_patch = checked.outcome.waits_for_scheduler
    dry: DryRun | None = None
    dry_settings: Settings | None = None
    base_record: ClassRecord | None = None
    evidence = Evidence(problem="not read: this release has nothing to patch")
    if family.verdict is not Verdict.ABSENT:
        # Disabled, or an unreadable version: run the same path as enabling it would.
        if not should_patch:
            mode = Mode.AUTO if family.verdict is not Verdict.UNKNOWN else Mode.FORCE
            dry_settings = dataclasses.replace(settings, mode=mode, problems=())
        started = time.perf_counter()
        dry = dry_run(report, dry_settings, targets, settings, family)
        timings["dry_run"] = round(time.perf_counter() - started, 3)
        base_record = dry.base_record
        if base_record is not None:
            evidence = base_record.evidence
        elif dry.base_state is not None:
            evidence = dry.base_state.evidence
        else:
            evidence = dataclasses.replace(UNREADABLE, problem=f"cannot load {BASE_SCHEDULER}")
    else:
        report.data["dry_run"] = {"ran": False}
    read_from = BASE_SCHEDULER if dry is not None and dry.base is not None else None
    report.data["evidence"] = evidence_json(evidence, read_from)

    # The plan the dry run ran (the record's, or the plugin's decision where it kept none).
    dry_plan: Plan | None = None
    if base_record is not None:
        dry_plan = base_record.plan
    elif dry is not None and dry.base_state is not None:
        dry_plan = dry.base_state.plan
    elif dry is not None:  # the base class could not be loaded
        dry_mode = dry_settings.mode if dry_settings is not None else settings.mode
        dry_plan = plan(dataclasses.replace(settings, mode=dry_mode), family, evidence)
    planned = dry_plan.rules if dry_plan else frozenset()
    installed = base_record.rules if base_record else frozenset()
    decided = dry_plan if should_patch else None  # then the dry run used the real settings
    by_version = version_plan(family, settings.stall_seconds)
    # What the code says under auto: the dry run's plan when it ran under auto.
    ran_auto = dry_plan is not None and (dry_settings or settings).mode is Mode.AUTO
    by_code = (
        dry_plan
        if ran_auto and dry_plan
        else plan(dataclasses.replace(settings, mode=Mode.AUTO), family, evidence)
    )

    spec = check_speculative(speculative_config, version, family, decided, installed)
    report.data["speculative"] = spec.data
    if spec.invalid:
        bad_input.append(spec.invalid)
    if spec.warning:
        report.warnings.append(spec.warning)
    # Rules a --scheduler-cls needs by its own schedule(), though the base does not.
    needed_by: dict[Rule, list[str]] = {}
    for check in dry.classes if dry else ():
        for rule in own_needs(check, verdict.FIX_RULES):
            needed_by.setdefault(rule, []).append(check.target.qualname)
    not_eagle = spec.eagle is False
    needed = verdict.needed_rules(family, settings.mode, by_code, not_eagle, frozenset(needed_by))
    spared = ""
    if not_eagle and by_code.verdict(Rule.SPECULATIVE_STALL).active:
        method = spec.data["resolved_method"]
        spared = f"speculative-stall [--speculative-config: {method} is not EAGLE-type]"

    rules = rule_table(family, evidence, settings, by_version, by_code, decided, checked.reason)
    rule_problems = _rule_problems(planned, base_record, dry, report)
    for entry in rules:
        rule = Rule(entry["rule"])
        entry["needed"] = rule in needed if rule in verdict.FIX_RULES else None
        entry["installs"] = rule in installed
        entry["needed_by_classes"] = needed_by.get(rule, [])
        entry["problem"] = rule_problems.get(rule)
    report.data["rules"] = rules
    chosen = verdict.policy(
        family, version, needed, should_patch, checked.reason, by_code, spared, needed_by
    )
    report.data["policy"] = chosen.to_json()

    # The human report, in reading order.
    report.add("info", "family", f"{family.name}: {family.summary}")
    label = verdict.VERDICT_TEXT[chosen.verdict]
    mark = "fail" if chosen.verdict in ("needed-will-not-patch", "unsupported") else "ok"
    reason = chosen.reason
    report.add(mark, "policy", reason if reason.startswith(label) else f"{label}: {reason}")
    if dry is not None:
        report.add("info", "code", evidence_text(evidence))
    rule_lines(report, rules, family, settings)
    report.add(spec.mark, "speculative", spec.text)
    ep_ok = check_entry_point(report)
    allowed = check_vllm_plugins(report)
    check_settings(report, settings)

    class_problems: list[str] = []
    if dry is not None:
        _dry_run_lines(report, base_record, planned, needed)
        entries = scheduler_entries(report, dry, planned, needed)
        report.data["schedulers"] = entries
        report.data["install_records"] = [r.to_json() for r in dry.records]
        for entry, check in zip(entries, dry.classes, strict=True):
            if check.error is not None and check.target.custom:
                bad_input.append(f"--scheduler-cls {check.target.qualname}: {check.error}")
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
    else:
        report.add("skip", "dry run", "skipped: this release has nothing to patch")
    report.data["block_size"] = dry.block_size if dry else None

    delivery = verdict.Delivery(
        settings.mode,
        os.environ.get(ENV_MODE),
        None if ep_ok else report.data["entry_point"].get("error", "entry point missing"),
        allowed,
        os.environ.get(ENV_VLLM_PLUGINS),
    )
    report.problems.extend(verdict.problems(chosen, delivery, rule_problems, tuple(class_problems)))
    for entry in rules:
        if entry["problem"] and not entry["needed"] and entry["active"]:
            report.warnings.append(entry["problem"])
    check_platform_plugins(report)
    status = verdict.status(chosen, bad_input, report.problems)
    return _finish(report, status, version, reason, bad_input)


__all__ = ["record", "run"]
