"""The dry run: ``register()``, settle each scheduler class as the engine does (no scheduler is
built, so no block size), read the install records, verify that every method a record gives a
rule resolves to the wrapper, undo. The plugin's log is captured to show, never to decide."""

from __future__ import annotations

import dataclasses
import sys
from types import ModuleType
from typing import Any

from vllm_mamba_fix.decide.policy import Rule
from vllm_mamba_fix.doctor.checks.vllm_import import resolve_class
from vllm_mamba_fix.doctor.report import Report, captured_plugin_log, names_text, stdout_to_stderr
from vllm_mamba_fix.doctor.verdict import BASE_SCHEDULER, Found
from vllm_mamba_fix.facts.config import Settings
from vllm_mamba_fix.facts.targets import SCHEDULER_CLASS, SCHEDULER_MODULE
from vllm_mamba_fix.install import patch
from vllm_mamba_fix.observe import record
from vllm_mamba_fix.observe.record import ClassRecord, MethodState
from vllm_mamba_fix.rules.table import ALL_WRAPPED, NEEDS, RULE_METHOD, RULE_METHODS, rules_through


@dataclasses.dataclass(frozen=True)
class Target:
    qualname: str
    role: str
    custom: bool  # given with --scheduler-cls


def default_targets(custom: list[str]) -> list[Target]:
    asynchronous = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
    return [
        Target(BASE_SCHEDULER, "vLLM default", False),
        Target(asynchronous, "vLLM default with async scheduling", False),
        *(Target(name, "--scheduler-cls", custom=True) for name in dict.fromkeys(custom)),
    ]


@dataclasses.dataclass(frozen=True)
class ClassCheck:  # one scheduler class: what the plugin recorded, and what it really resolves
    target: Target
    error: str | None  # why it could not be loaded
    derives: bool  # from the base Scheduler
    record: ClassRecord | None  # None: not loaded, not derived, or the plugin kept none
    resolves_to_wrapper: dict[str, bool]  # per rule method, checked while the patch is on


@dataclasses.dataclass(frozen=True)
class DryRun:
    classes: tuple[ClassCheck, ...]
    records: tuple[ClassRecord, ...]  # record.records() while the patch was on: the verdict's input


def _base_or_none() -> type | None:
    base = getattr(sys.modules.get(SCHEDULER_MODULE), SCHEDULER_CLASS, None)
    return base if isinstance(base, type) else None


def _overriding_subclasses(base: type) -> list[str]:
    found: list[str] = []
    stack, seen = list(base.__subclasses__()), set()
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen.add(cls)
            stack.extend(cls.__subclasses__())
            if any(n in vars(cls) and not patch.is_wrapped(cls, n) for n in RULE_METHODS):
                found.append(record.class_name(cls))
    return sorted(found)


def _check_all(targets: list[Target], plugin: ModuleType) -> list[ClassCheck]:
    """Import every class first (an import may replace a base method, as another platform
    plugin does), then settle each as the engine would, then verify what each resolves."""
    loaded: list[type | str] = []  # the class, or why it cannot be loaded
    for target in targets:
        try:
            loaded.append(resolve_class(target.qualname))
        except LookupError as exc:
            loaded.append(str(exc))
    base = _base_or_none()
    derives = [isinstance(c, type) and base is not None and issubclass(c, base) for c in loaded]
    # Only a Scheduler subclass is settled: the plugin must not wrap unrelated classes.
    settled = [plugin.check_class(c) if d and isinstance(c, type) else None
               for c, d in zip(loaded, derives, strict=True)]  # fmt: skip
    checks: list[ClassCheck] = []
    for target, cls, derived, found in zip(targets, loaded, derives, settled, strict=True):
        if isinstance(cls, str):
            checks.append(ClassCheck(target, cls, False, None, {}))
            continue
        resolves = {name: patch.resolves_to_wrapper(cls, name) for name in RULE_METHODS}
        # The record as it stands now: settling a later class may have put a wrapper on a
        # base of this one, and the plugin re-describes the classes settled before.
        found = found and (record.recorded(found.scheduler_class) or found)
        checks.append(ClassCheck(target, None, derived, found, resolves))
    return checks


def _why_stock(
    base: type | None, base_record: ClassRecord | None, wrapped: list[str]
) -> str | None:
    """Why a method the base's plan gives a rule carries no wrapper (None: none does)."""
    if base is None:
        return f"cannot load {BASE_SCHEDULER}"
    if base_record is None:
        why = "the plugin kept no record of the base class (its import hook never ran)"
        return None if wrapped else why
    if not wrapped and not base_record.plan.rules:
        return f"no rule to install: {base_record.plan.describe()}"
    if not wrapped:
        notes = [m.describe() for m in base_record.methods if not m.state.carries_rules]
        return "; ".join(notes) or "no wrapper was installed"
    wanted = {RULE_METHOD[rule] for rule in base_record.plan.rules}
    left = [m for m in base_record.methods if m.name in wanted and m.name not in wrapped]
    return "; ".join(m.note or m.describe() for m in left) or None


def dry_run(
    report: Report, settings: Settings | None, targets: list[Target], plugin: ModuleType
) -> DryRun:
    """``settings`` None: the entry point's own call; else the same path with the settings given
    (``auto`` where disabled, ``force`` for an unreadable version): would it apply if enabled."""
    info: dict[str, Any] = {"ran": True, "forced": settings is not None}
    if settings is not None:
        info["mode"] = settings.mode.value
    report.data["dry_run"] = info
    pre_imported = SCHEDULER_MODULE in sys.modules
    with captured_plugin_log() as capture, stdout_to_stderr():
        base_now = _base_or_none() if pre_imported else None
        already = base_now is not None and any(patch.is_wrapped(base_now, n) for n in ALL_WRAPPED)
        plugin.register(settings)
        # Import the classes after register(), as vLLM does: exercises the import hook.
        checks = _check_all(targets, plugin)
        base = _base_or_none()
        base_record = next(
            (c.record for c in checks if c.target.qualname == BASE_SCHEDULER and c.record), None
        )
        wrapped = [n for n in RULE_METHODS if base is not None and patch.is_wrapped(base, n)]
        overriders = _overriding_subclasses(base) if base is not None else []
        records, restored = record.records(), True
        if not already:
            changed = patch.changed_classes()
            plugin.unregister()  # also drops a pending import hook, if any
            restored = not patch.changed_classes() and not any(
                patch.is_wrapped(cls, name) for cls in changed for name in ALL_WRAPPED
            )
    info.update(patched=bool(wrapped), wrapped_methods=wrapped, already_active=already,
                via="import hook" if not pre_imported else "immediate", restored=restored,
                overriding_subclasses=overriders, log=capture.messages(),
                error=_why_stock(base, base_record, wrapped))  # fmt: skip
    if not restored:
        report.warnings.append("the dry run could not restore the stock methods (harmless here)")
    return DryRun(tuple(checks), records)


def _methods(check: ClassCheck) -> dict[str, dict[str, Any]]:
    """Per rule method: the class overriding it (neither the plugin nor the base), reached."""
    found: dict[str, dict[str, Any]] = {}
    for name in RULE_METHODS:
        state = check.record.method(name) if check.record else None
        other = state is not None and not state.state.carries_rules
        by = state.owner if other and state.owner != BASE_SCHEDULER else None
        found[name] = {"overridden_by": by, "reached": check.resolves_to_wrapper.get(name, False)}
    return found


def scheduler_entries(
    report: Report, dry: DryRun, found: Found, needed: frozenset[Rule]
) -> list[dict[str, Any]]:
    """One JSON entry per class; its ``problems`` break a needed rule (others are warnings)."""
    entries: list[dict[str, Any]] = []
    for check in dry.classes:
        name, own = check.target.qualname, check.record
        entry: dict[str, Any] = {"class": name, "role": check.target.role, "problems": [],
                                 "loaded": check.error is None, "reached": False}  # fmt: skip
        entries.append(entry)
        if check.error is not None:
            entry["error"] = check.error
            continue
        methods = _methods(check)
        overridden = next(
            (m["overridden_by"] for m in methods.values() if m["overridden_by"]), None
        )
        entry.update(derives_from_scheduler=check.derives, methods=methods,
                     overridden_by=overridden, record=own.to_json() if own else None)  # fmt: skip
        texts: list[tuple[str, bool]] = []
        if not check.derives:
            why = f"{name} does not derive from {BASE_SCHEDULER}; the fix cannot reach it"
            texts.append((why, bool(needed)))
        elif own is not None:
            mine = {r for r, names in found.needed_by.items() if name in names}
            texts = _method_problems(check, found.planned | own.plan.rules, needed | mine)
        # Reached: every method that carries a rule resolves to its wrapper, and none escapes.
        carried = [m.name for m in own.methods if m.state.carries_rules and m.rules] if own else []
        resolved = all(check.resolves_to_wrapper[m] for m in carried)
        entry["reached"] = bool(carried) and not texts and resolved
        entry["problems"] = [text for text, breaks in texts if breaks]
        report.warnings.extend(text for text, breaks in texts if not breaks)
    return entries


def _method_problems(
    check: ClassCheck, planned: frozenset[Rule], needed: frozenset[Rule]
) -> list[tuple[str, bool]]:
    """Each method that does not carry a planned rule: why, and whether a needed rule breaks."""
    name, role = check.target.qualname, check.target.role
    found: list[tuple[str, bool]] = []
    for method in RULE_METHODS:
        through = rules_through(method, planned)
        state = check.record.method(method) if check.record else None
        if method in NEEDS or not through or state is None:
            continue  # NEEDS: its rules are named with the method they act through
        rules = names_text([r.value for r in through]) + (" does" if len(through) == 1 else " do")
        if state.state is MethodState.OVERRIDDEN:
            text = f"{name} ({role}) overrides {method} in {state.owner}; {rules} not reach it"
        elif state.state is MethodState.UNPATCHABLE and state.owner != BASE_SCHEDULER:
            text = f"{name} ({role}): {state.describe()}; {rules} not reach it"  # the base's:
        elif state.state.carries_rules and not check.resolves_to_wrapper[method]:  # its rule's
            text = f"{name} ({role}) does not see the patched {method}"  # problem says it
        else:
            continue
        found.append((text, any(r in needed for r in through)))
    return found
