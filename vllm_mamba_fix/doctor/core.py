"""``main()``, the command, and ``run()``: the checks in order, then the verdict from the install
records the dry run made; it hands ``install.plugin`` to the dry run and the entry-point check."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_mamba_fix._version import __version__
from vllm_mamba_fix.decide.policy import Rule, preflight
from vllm_mamba_fix.doctor import verdict
from vllm_mamba_fix.doctor.checks import delivery, schedulers, speculative, vllm_import
from vllm_mamba_fix.doctor.cli import build_parser
from vllm_mamba_fix.doctor.render import render_output
from vllm_mamba_fix.doctor.report import STATUS, Report, one_line, package_path
from vllm_mamba_fix.facts.config import Mode, Settings, load_settings
from vllm_mamba_fix.facts.evidence import UNREADABLE, Evidence
from vllm_mamba_fix.facts.versions import Verdict
from vllm_mamba_fix.install import plugin
from vllm_mamba_fix.rules.table import plan


@dataclasses.dataclass
class _Run:  # what the steps of one run share
    report: Report
    settings: Settings
    setup: verdict.Setup
    bad_input: list[str] = dataclasses.field(default_factory=list)
    dry: schedulers.DryRun | None = None
    found: verdict.Found = dataclasses.field(default_factory=lambda: verdict.of_records(()))
    evidence: Evidence = UNREADABLE  # the base class's code, as its record read it


def _finish(
    report: Report, status: str, version: str | None, reason: str, bad: list[str]
) -> Report:
    report.problems[:0] = bad
    report.data.update(status=status, exit_code=STATUS[status][0])
    report.data["summary"] = verdict.summary(status, version, reason, report.problems)
    report.data.update(problems=report.problems, warnings=report.warnings)
    return report


def _dry_run_step(state: _Run, targets: list[schedulers.Target]) -> None:
    """The dry run of ``register()``, and the install records it made: the verdict's input."""
    report, family = state.report, state.setup.family
    if family.verdict is Verdict.ABSENT:
        report.data["dry_run"] = {"ran": False}
        state.evidence = Evidence(problem="not read: this release has nothing to patch")
    else:
        forced: Settings | None = None
        if not state.setup.should_patch:  # disabled, or an unreadable version: as enabling it
            mode = Mode.AUTO if family.verdict is not Verdict.UNKNOWN else Mode.FORCE
            forced = state.settings._replace(mode=mode, problems=())
        started = time.perf_counter()
        state.dry = schedulers.dry_run(report, forced, targets, plugin)
        report.data["timings_seconds"]["dry_run"] = round(time.perf_counter() - started, 3)
        state.found = verdict.of_records(state.dry.records)
        why = report.data["dry_run"].get("error") or "no record"  # cannot load it, ...
        state.evidence = UNREADABLE._replace(problem=f"not read: {why}")
    base = state.found.base
    state.evidence = base.evidence if base is not None else state.evidence
    report.data["evidence"] = {
        "read_from": verdict.BASE_SCHEDULER if base is not None else None,
        "split_after_encoder": state.evidence.split_after_encoder,
        "deferred_encoder_free": state.evidence.deferred_encoder_free,
        "problem": state.evidence.problem,
    }


def _speculative_step(state: _Run, config: Mapping[str, Any] | None) -> None:
    """The --speculative-config: what the verdict needs of it beyond the records."""
    found, setup = state.found, state.setup
    decided = found.decided(setup.should_patch)
    spec = speculative.check_speculative(
        config, setup.version, setup.family, decided, found.installed
    )
    state.report.data["speculative"] = spec.data
    state.bad_input += [spec.invalid] if spec.invalid else []
    state.report.warnings.extend(spec.warnings)
    method, foreseen = spec.data.get("resolved_method"), {}
    release = found.release or setup.by_version
    if release.verdict(Rule.BLOCK_UNIT).active and spec.data.get("drafter_kv_group"):
        foreseen[Rule.BLOCK_UNIT] = (
            f"--speculative-config {method}: {speculative.OWN_KV_GROUP_TEXT}"
        )
    not_eagle = method if spec.eagle is False else ""
    state.setup = dataclasses.replace(setup, not_eagle=not_eagle, foreseen=foreseen)


def _scheduler_step(state: _Run, needed: frozenset[Rule]) -> list[str]:
    """The dry run's lines and one entry per class; returns the classes' problems."""
    report, dry = state.report, state.dry
    # Of a scheduler already built in this process; a dry run builds none.
    report.data["block_size"] = next((r.block.mamba for r in state.found.facts if r.block), None)
    if dry is None:
        return []
    entries = schedulers.scheduler_entries(report, dry, state.found, needed)
    report.data.update(schedulers=entries, install_records=[r.to_json() for r in dry.records])
    class_problems: list[str] = []
    for entry, check in zip(entries, dry.classes, strict=True):
        if check.error is not None and check.target.custom:
            state.bad_input.append(f"--scheduler-cls {check.target.qualname}: {check.error}")
        else:
            class_problems += [check.error] if check.error is not None else entry["problems"]
    seen = {entry["class"] for entry in entries}
    report.warnings.extend(
        f"loaded subclass {name} overrides a patched method; if vLLM uses it, the fix does not "
        "reach it"
        for name in report.data["dry_run"]["overriding_subclasses"]
        if name not in seen
    )
    return class_problems


def _verdict_step(state: _Run) -> tuple[verdict.Policy, list[str]]:
    """The verdict from the records and the set-up, the rule entries, and what breaks it."""
    report, settings, found, dry = state.report, state.settings, state.found, state.dry
    dlv = delivery.check_delivery(report, settings, plugin.register)  # not loaded: nothing runs
    delivered = dlv.entry_point_error is None and dlv.vllm_plugins_allows
    setup = state.setup = dataclasses.replace(state.setup, delivered=delivered)
    chosen, decided = verdict.policy(found, setup), found.decided(setup.should_patch)
    rule_problems = verdict.rule_problems(found, report.data["dry_run"].get("error"))
    inactive = ("setting" if settings.mode is Mode.OFF else "version", setup.preflight_reason)
    entries = verdict.rule_entries(
        found, setup, state.evidence, chosen.needed, inactive, rule_problems
    )
    report.data.update(rules=entries, policy=chosen.to_json())
    if dry is not None:  # what two other modules say this release supports
        vllm_import.check_stall_end(report, [c.target.qualname for c in dry.classes if c.derives])
        vllm_import.check_metrics(report)
    class_problems = _scheduler_step(state, chosen.needed)
    rule_problems.update(verdict.switched_off(decided, chosen.needed, settings))
    found_problems = verdict.problems(chosen, dlv, rule_problems, class_problems)
    report.problems.extend(found_problems)
    report.warnings.extend(verdict.rule_warnings(entries))
    return chosen, found_problems


def run(
    scheduler_cls: Sequence[str] = (), speculative_config: Mapping[str, Any] | None = None
) -> Report:
    report, settings = Report(), load_settings()
    report.data["tool"] = {"name": "vllm-mamba-fix", "version": __version__,
                           "package_path": package_path(), "python": sys.executable}  # fmt: skip
    version, family = vllm_import.import_step(report)
    report.data["schedulers"] = []
    if family is None or version is None:
        delivery.check_delivery(report, settings, plugin.register)
        report.data["dry_run"] = {"ran": False}
        return _finish(report, "unknown", version, "", [])
    checked = preflight(settings.mode, family, version)
    # What the release data alone says (no code read): the report's ``version`` column.
    unforced = settings._replace(mode=Mode.AUTO, switched_off=frozenset(), problems=())
    setup = verdict.Setup(family, version, checked.outcome.waits_for_scheduler, checked.reason,
                          plan(unforced, family, Evidence()))  # fmt: skip
    state = _Run(report, settings, setup)
    _dry_run_step(state, schedulers.default_targets(list(scheduler_cls)))
    _speculative_step(state, speculative_config)
    chosen, found_problems = _verdict_step(state)
    delivery.check_platform_plugins(report)
    status = verdict.status(chosen, state.bad_input, found_problems)
    return _finish(report, status, version, chosen.reason, state.bad_input)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (
        args_list[0].startswith("-") and args_list[0] not in ("-h", "--help", "--version")
    ):
        args_list.insert(0, "doctor")  # doctor is the default command
    try:
        args = build_parser().parse_args(args_list)
    except SystemExit as exc:  # argparse: usage error (2) or --help (0)
        return exc.code if isinstance(exc.code, int) else STATUS["invalid-input"][0]
    started = time.perf_counter()
    try:
        report = run(args.scheduler_cls, args.speculative_config)
    except KeyboardInterrupt:
        print("vllm-mamba-fix doctor: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"vllm-mamba-fix doctor: internal error: {one_line(exc)}", file=sys.stderr)
        return STATUS["unknown"][0]
    elapsed = time.perf_counter() - started
    report.data["elapsed_seconds"] = round(elapsed, 3)
    text = render_output(report, elapsed, args.json, args.report)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. piped into `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return int(report.data["exit_code"])
