"""The dry run: patch through ``register()``, settle each scheduler class with
``plugin.check_class(cls)`` (the engine's own check, without a built scheduler, so no block
size), read the install records it makes, verify on the live classes that every method a
record gives a rule resolves to the plugin's wrapper, undo. The plugin's log lines are
captured to show them, never to decide; :mod:`vllm_mamba_fix.doctor.core` hands the plugin over."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Protocol

from vllm_mamba_fix.decide.policy import Rule
from vllm_mamba_fix.doctor.checks.vllm_import import resolve_class
from vllm_mamba_fix.doctor.report import (
    Report,
    captured_plugin_log,
    names_text,
    stdout_to_stderr,
)
from vllm_mamba_fix.doctor.verdict import BASE_SCHEDULER, Found
from vllm_mamba_fix.facts.config import Settings
from vllm_mamba_fix.facts.targets import SCHEDULER_CLASS, SCHEDULER_MODULE
from vllm_mamba_fix.install import patch
from vllm_mamba_fix.observe import record
from vllm_mamba_fix.observe.record import ClassRecord, MethodState
from vllm_mamba_fix.rules.table import (
    ALL_WRAPPED,
    NEEDS,
    RULE_METHOD,
    RULE_METHODS,
    rules_through,
)


class Plugin(Protocol):
    """What the dry run calls of :mod:`vllm_mamba_fix.install.plugin`."""

    def register(self, settings: Settings | None = None) -> None: ...
    def unregister(self) -> bool: ...
    def check_class(self, cls: type) -> ClassRecord | None: ...


ASYNC_SCHEDULER = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"


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
    record: ClassRecord | None  # None: not loaded, not derived, or the plugin kept none
    resolves_to_wrapper: dict[str, bool]  # per rule method, checked while the patch is on


@dataclasses.dataclass(frozen=True)
class DryRun:
    classes: tuple[ClassCheck, ...]
    records: tuple[ClassRecord, ...]  # record.records() while the patch was on: the verdict's input


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
            found.append(record.class_name(cls))
    return sorted(found)


def _check_all(targets: list[Target], plugin: Plugin) -> list[ClassCheck]:
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
    base: type | None, base_record: ClassRecord | None, wrapped: tuple[str, ...]
) -> str | None:
    """Why a method the base's plan gives a rule carries no wrapper (None: none does), from
    the base's typed record."""
    if base is None:
        return f"cannot load {BASE_SCHEDULER}"
    if base_record is None:
        return (
            None
            if wrapped
            else "the plugin kept no record of the base class (its import hook never ran)"
        )
    if not wrapped and not base_record.plan.rules:
        return f"no rule to install: {base_record.plan.describe()}"
    if not wrapped:
        notes = [m.describe() for m in base_record.methods if not m.state.carries_rules]
        return "; ".join(notes) or "no wrapper was installed"
    wanted = {RULE_METHOD[rule] for rule in base_record.plan.rules}
    left = [m for m in base_record.methods if m.name in wanted and m.name not in wrapped]
    return "; ".join(m.note or m.describe() for m in left) or None


def dry_run(
    report: Report, settings: Settings | None, targets: list[Target], plugin: Plugin
) -> DryRun:
    """``settings`` None: the entry point's own call, reading the real environment.

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
        already = base_now is not None and any(patch.is_wrapped(base_now, n) for n in ALL_WRAPPED)
        plugin.register(settings)
        # Import the classes after register(), as vLLM does: exercises the import hook.
        checks = _check_all(targets, plugin)
        base = _base_or_none()
        base_record = next(
            (c.record for c in checks if c.target.qualname == BASE_SCHEDULER and c.record), None
        )
        wrapped = tuple(n for n in RULE_METHODS if base is not None and patch.is_wrapped(base, n))
        overriders = _overriding_subclasses(base) if base is not None else []
        records = record.records()
        restored = True
        if not already:
            changed = patch.changed_classes()
            plugin.unregister()  # also drops a pending import hook, if any
            restored = not patch.changed_classes() and not any(
                patch.is_wrapped(cls, name) for cls in changed for name in ALL_WRAPPED
            )
    info.update(
        patched=bool(wrapped),
        wrapped_methods=list(wrapped),
        already_active=already,
        via="import hook" if not pre_imported else "immediate",
        restored=restored,
        overriding_subclasses=overriders,
        log=capture.messages(),
    )
    info["error"] = _why_stock(base, base_record, wrapped)
    if not restored:
        report.warnings.append("the dry run could not restore the stock methods (harmless here)")
    return DryRun(tuple(checks), records)


def _method_json(check: ClassCheck, name: str) -> dict[str, Any]:
    method = check.record.method(name) if check.record else None
    overridden = None
    if method is not None and not method.state.carries_rules and method.owner != BASE_SCHEDULER:
        overridden = method.owner
    return {"overridden_by": overridden, "reached": check.resolves_to_wrapper.get(name, False)}


def scheduler_entries(
    report: Report, dry: DryRun, records: Found, needed: frozenset[Rule]
) -> list[dict[str, Any]]:
    """One JSON entry per class; each entry's ``problems`` break a needed rule (what breaks
    none is a warning)."""
    entries: list[dict[str, Any]] = []
    for check in dry.classes:
        name, role = check.target.qualname, check.target.role
        entry: dict[str, Any] = {"class": name, "role": role, "loaded": check.error is None}
        entries.append(entry)
        entry["problems"] = []  # the class's own problems: each breaks a needed rule
        if check.error is not None:
            entry.update(error=check.error, reached=False)
            continue
        methods = {m: _method_json(check, m) for m in RULE_METHODS}
        overridden = next(
            (m["overridden_by"] for m in methods.values() if m["overridden_by"]), None
        )
        own = check.record.methods if check.record else ()
        carried = [m.name for m in own if m.state.carries_rules and m.rules]
        entry.update(
            derives_from_scheduler=check.derives,
            methods=methods,
            overridden_by=overridden,
            reached=False,
            record=check.record.to_json() if check.record else None,
        )
        texts: list[tuple[str, bool]] = []
        if not check.derives:
            why = f"{name} does not derive from {BASE_SCHEDULER}; the fix cannot reach it"
            texts.append((why, bool(needed)))
        elif check.record is not None:
            own = {r for r, names in records.needed_by.items() if name in names}
            texts = _method_problems(check, records.planned | check.record.plan.rules, needed | own)
        # Reached: every method that carries a rule resolves to its wrapper, and none escapes.
        entry["reached"] = (
            bool(carried) and not texts and all(check.resolves_to_wrapper[m] for m in carried)
        )
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
        rules = names_text([r.value for r in through])
        rules += " does" if len(through) == 1 else " do"
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
