"""The dry run: patch through ``register()``, settle and verify each scheduler class, undo.

Each class is settled by ``plugin.check_class(cls)``, the same check the engine
runs when it builds a scheduler (without a built scheduler, so no block size);
doctor reads the :class:`~vllm_mamba_fix.record.ClassRecord` it returns, and
verifies on the live classes that every method the record says carries a rule
resolves to the plugin's wrapper. The plugin's log lines are captured to show
them, never to decide.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

from vllm_mamba_fix import patch, plugin, record
from vllm_mamba_fix.config import Settings
from vllm_mamba_fix.doctor.checks.vllm_import import resolve_class
from vllm_mamba_fix.doctor.report import (
    Report,
    captured_plugin_log,
    qualname_of,
    stdout_to_stderr,
)
from vllm_mamba_fix.evidence import Evidence, defining_class, read_evidence
from vllm_mamba_fix.policy import Plan, Rule
from vllm_mamba_fix.record import ClassRecord, MethodState
from vllm_mamba_fix.rules import RULE_METHOD, RULE_METHODS, plan
from vllm_mamba_fix.targets import (
    FREE_REQUEST_METHOD,
    INIT_METHOD,
    SCHEDULER_CLASS,
    SCHEDULER_MODULE,
    check_target,
)
from vllm_mamba_fix.versions import Family

BASE_SCHEDULER = f"{SCHEDULER_MODULE}.{SCHEDULER_CLASS}"
ASYNC_SCHEDULER = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
_ALL_WRAPPED = (*RULE_METHODS, INIT_METHOD, FREE_REQUEST_METHOD)


@dataclasses.dataclass(frozen=True)
class Target:
    qualname: str
    role: str
    custom: bool  # given with --scheduler-cls


def default_targets(custom: tuple[str, ...] | list[str]) -> list[Target]:
    return [
        Target(BASE_SCHEDULER, "vLLM default", custom=False),
        Target(ASYNC_SCHEDULER, "vLLM default with async scheduling", custom=False),
        *(Target(name, "--scheduler-cls", custom=True) for name in dict.fromkeys(custom)),
    ]


@dataclasses.dataclass(frozen=True)
class ClassCheck:
    """One scheduler class: what the plugin recorded for it, and what it really resolves."""

    target: Target
    error: str | None  # why it could not be loaded
    derives: bool  # from the base Scheduler
    record: ClassRecord | None  # None: not loaded, not derived, or the plugin did not install
    resolves_to_wrapper: dict[str, bool]  # per rule method, checked while the patch is on
    # Defines a schedule() of its own (not the base's), so its code evidence is its own.
    own_schedule: bool = False
    # Where the plugin installed nothing (no record): its plan for this class's own code.
    unsettled_plan: Plan | None = None


@dataclasses.dataclass(frozen=True)
class BaseState:
    """What the plugin decides for the base class, and why a planned rule stays stock."""

    plan: Plan
    evidence: Evidence
    problems: dict[str, str]  # per rule method that cannot carry its wrapper


@dataclasses.dataclass(frozen=True)
class DryRun:
    base: type | None
    base_record: ClassRecord | None
    # Where the plugin installed nothing (so it keeps no record), the same typed
    # decision it made: its plan and the shape checks of the methods.
    base_state: BaseState | None
    wrapped: tuple[str, ...]  # the rule methods wrapped on the base class
    classes: tuple[ClassCheck, ...]
    records: tuple[ClassRecord, ...]  # record.records() while the patch was on
    # Of a scheduler already built in this process; a dry run builds none, so None.
    block_size: int | None


def _base_or_none() -> type | None:
    module = sys.modules.get(SCHEDULER_MODULE)
    base = getattr(module, SCHEDULER_CLASS, None) if module else None
    return base if isinstance(base, type) else None


def _overriding_subclasses(base: type) -> list[str]:
    """Loaded subclasses of ``base`` that define a rule method of their own."""
    found: list[str] = []
    stack, seen = list(base.__subclasses__()), set()
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        stack.extend(cls.__subclasses__())
        if any(n in vars(cls) and not patch.is_wrapped(cls, n) for n in RULE_METHODS):
            found.append(qualname_of(cls))
    return sorted(found)


def _load(target: Target) -> type | str:
    """The class, or why it cannot be loaded."""
    try:
        return resolve_class(target.qualname)
    except LookupError as exc:
        return str(exc)


def _check_all(targets: list[Target]) -> list[ClassCheck]:
    """Import every class first (an import may replace a base method, as another platform
    plugin does), then settle each as the engine would, then verify what each resolves."""
    loaded = [(target, _load(target)) for target in targets]
    base = _base_or_none()
    settled: list[tuple[Target, type | str, bool, ClassRecord | None]] = []
    for target, cls in loaded:
        derives = isinstance(cls, type) and base is not None and issubclass(cls, base)
        # Only a Scheduler subclass is settled: the plugin must not wrap unrelated classes.
        found = plugin.check_class(cls) if derives and isinstance(cls, type) else None
        settled.append((target, cls, derives, found))
    checks: list[ClassCheck] = []
    for target, cls, derives, found in settled:
        if not isinstance(cls, type):
            checks.append(ClassCheck(target, cls, False, None, {}))
            continue
        resolves = {name: patch.resolves_to_wrapper(cls, name) for name in RULE_METHODS}
        own = derives and defining_class(cls, "schedule") not in (None, base)
        checks.append(ClassCheck(target, None, derives, found, resolves, own))
    return checks


def _base_state(base: type, settings: Settings, family: Family) -> BaseState:
    """The plugin's decision for ``base`` from the same typed functions it runs."""
    evidence = read_evidence(base)
    decided = plan(settings, family, evidence)
    methods = {RULE_METHOD[rule] for rule in decided.rules}
    problems = {name: check_target(base, name) for name in RULE_METHODS if name in methods}
    return BaseState(decided, evidence, {k: v for k, v in problems.items() if v is not None})


def _unsettled(check: ClassCheck, settings: Settings, family: Family) -> ClassCheck:
    """A subclass the plugin never checks (it installed nothing): what its own code needs."""
    if check.record is not None or not check.own_schedule:
        return check  # settled, or it runs the base's schedule() and so the base's plan
    evidence = read_evidence(resolve_class(check.target.qualname))
    decided = plan(settings, family, evidence)
    return dataclasses.replace(check, unsettled_plan=decided)


def _not_installed(
    base: type | None, base_record: ClassRecord | None, state: BaseState | None
) -> str:
    """Why no rule wrapper is on the base class, from the typed record or decision."""
    if base is None:
        return f"cannot load {BASE_SCHEDULER}"
    if base_record is not None:
        if not base_record.plan.rules:
            return f"no rule to install: {base_record.plan.describe()}"
        notes = [m.describe() for m in base_record.methods if not m.state.carries_rules]
        return "; ".join(notes) or "no wrapper was installed"
    if state is None:
        return "the plugin did not install (its import hook never ran)"
    if not state.plan.rules:
        return f"no rule to install: {state.plan.describe()}"
    return "; ".join(state.problems.values()) or "no wrapper was installed"


def dry_run(
    report: Report,
    settings: Settings | None,
    targets: list[Target],
    effective: Settings,
    family: Family,
) -> DryRun:
    """``settings`` None: the entry point's own call, reading the real environment
    (``effective`` is what it reads).

    Otherwise the same code path runs with the settings given (``auto`` when
    disabled, ``force`` for an unreadable version) to tell whether the patch
    would apply if enabled.
    """
    info: dict[str, Any] = {"ran": True, "forced": settings is not None}
    if settings is not None:
        info["mode"] = settings.mode.value
    report.data["dry_run"] = info
    pre_imported = SCHEDULER_MODULE in sys.modules
    with captured_plugin_log() as capture, stdout_to_stderr():
        base_now = _base_or_none() if pre_imported else None
        already = base_now is not None and any(patch.is_wrapped(base_now, n) for n in _ALL_WRAPPED)
        plugin.register(settings)
        # Import the classes after register(), as vLLM does: exercises the import hook.
        checks = _check_all(targets)
        base = _base_or_none()
        base_record = next(
            (c.record for c in checks if c.target.qualname == BASE_SCHEDULER and c.record), None
        )
        if base_record is None and base is not None:
            base_record = plugin.check_class(base)
        state = None
        if base_record is None and base is not None:
            state = _base_state(base, settings or effective, family)
            checks = [_unsettled(check, settings or effective, family) for check in checks]
        wrapped = tuple(n for n in RULE_METHODS if base is not None and patch.is_wrapped(base, n))
        overriders = _overriding_subclasses(base) if base is not None else []
        records = record.records()
        restored = True
        if not already:
            changed = patch.changed_classes()
            plugin.unregister()  # also drops a pending import hook, if any
            restored = not patch.changed_classes() and not any(
                patch.is_wrapped(cls, name) for cls in changed for name in _ALL_WRAPPED
            )
    info.update(
        patched=bool(wrapped),
        wrapped_methods=list(wrapped),
        already_active=already,
        via="import hook" if not pre_imported else "immediate",
        restored=restored,
        overriding_subclasses=overriders,
        log=capture.messages(logging.DEBUG),
    )
    if not wrapped:
        info["error"] = _not_installed(base, base_record, state)
    if not restored:
        report.warnings.append("the dry run could not restore the stock methods (harmless here)")
    block = next((r.block.mamba for r in records if r.block is not None), None)
    return DryRun(base, base_record, state, wrapped, tuple(checks), records, block)


def own_needs(check: ClassCheck, fix_rules: tuple[Rule, ...]) -> frozenset[Rule]:
    """Fix rules a class needs by its own ``schedule()`` (not the base's)."""
    if not check.own_schedule:
        return frozenset()
    decided = check.record.plan if check.record is not None else check.unsettled_plan
    return frozenset(r for r in decided.rules if r in fix_rules) if decided else frozenset()


def _method_json(check: ClassCheck, name: str) -> dict[str, Any]:
    method = check.record.method(name) if check.record else None
    overridden = None
    if method is not None and not method.state.carries_rules and method.owner != BASE_SCHEDULER:
        overridden = method.owner
    return {"overridden_by": overridden, "reached": check.resolves_to_wrapper.get(name, False)}


def scheduler_entries(
    report: Report, dry: DryRun, planned: frozenset[Rule], needed: frozenset[Rule]
) -> list[dict[str, Any]]:
    """One JSON entry and one line per class; each entry's ``problems`` break a needed rule."""
    label = "scheduler"
    entries: list[dict[str, Any]] = []
    for check in dry.classes:
        name, role = check.target.qualname, check.target.role
        entry: dict[str, Any] = {"class": name, "role": role, "loaded": check.error is None}
        entries.append(entry)
        entry["problems"] = []
        if check.error is not None:
            entry.update(error=check.error, reached=False)
            report.add("fail", label, f"{name} ({role}): {check.error}")
            continue
        methods = {m: _method_json(check, m) for m in RULE_METHODS}
        entry.update(
            derives_from_scheduler=check.derives,
            methods=methods,
            overridden_by=next(
                (m["overridden_by"] for m in methods.values() if m["overridden_by"]), None
            ),
            reached=False,
            record=check.record.to_json() if check.record else None,
        )
        if not check.derives:
            text = f"{name} does not derive from {BASE_SCHEDULER}; the fix cannot reach it"
            report.add("fail" if needed else "warn", label, text)
            if needed:
                entry["problems"].append(text)
            continue
        found = check.record
        unsettled = own_needs(check, tuple(Rule)) if found is None else frozenset()
        if unsettled:
            rules = " and ".join(r.value for r in Rule if r in unsettled)
            text = (
                f"{name} ({role}) needs {rules} by its own schedule(), but the plugin installs "
                "nothing on this release, so it never checks this class"
            )
            report.add("fail", label, text)
            entry["problems"].append(text)
            continue
        class_planned = planned | (found.plan.rules if found else frozenset())
        class_needed = needed | own_needs(check, tuple(needed | class_planned))
        clean = _method_lines(report, entry, check, class_planned, class_needed)
        if not clean:
            continue
        carried = sorted(m.name for m in found.methods if m.state.carries_rules) if found else []
        if carried:
            entry["reached"] = all(check.resolves_to_wrapper[m] for m in carried)
            rules = ", ".join(r.value for r in Rule if r in found.rules) if found else ""
            report.add("ok", label, f"{name} ({role}) resolves the plugin's {' and '.join(carried)}"
                       f" ({rules})")  # fmt: skip
        elif class_planned:
            methods_text = " and ".join(sorted({RULE_METHOD[r] for r in class_planned}))
            report.add("info", label, f"{name} ({role}) inherits {methods_text}")
        else:
            report.add("info", label, f"{name} ({role}): nothing to patch")
        for method in found.methods if found else ():
            if method.state is MethodState.WRAPPED_REPLACEMENT or method.note:
                report.add("info", "", method.describe())
    return entries


def _method_lines(
    report: Report,
    entry: dict[str, Any],
    check: ClassCheck,
    planned: frozenset[Rule],
    needed: frozenset[Rule],
) -> bool:
    """Lines for the methods that do not carry a planned rule; False if there is any."""
    name, role = check.target.qualname, check.target.role
    clean = True
    for method in RULE_METHODS:
        rules = sorted(r.value for r in planned if RULE_METHOD[r] == method)
        if not rules:
            continue
        breaks = any(RULE_METHOD[r] == method for r in needed)
        found = check.record.method(method) if check.record else None
        overridden = entry["methods"][method]["overridden_by"]
        if found is not None and found.state is MethodState.OVERRIDDEN:
            text = f"{name} ({role}) overrides {method} in {overridden or found.owner}; "
            text += f"{' and '.join(rules)} do not reach it"
        elif (
            found is not None
            and found.state is MethodState.UNPATCHABLE
            and found.owner != BASE_SCHEDULER  # the base's own: the rule's problem says it
        ):
            text = f"{name} ({role}): {found.describe()}; {' and '.join(rules)} do not reach it"
        elif (
            found is not None
            and found.state.carries_rules
            and not check.resolves_to_wrapper[method]
        ):
            text = f"{name} ({role}) does not see the patched {method}"
        else:
            continue
        clean = False
        report.add("fail" if breaks else "warn", "scheduler", text)
        if breaks:
            entry["problems"].append(text)
    return clean
