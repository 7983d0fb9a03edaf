"""``register()``: the ``vllm.general_plugins`` entry point, and its undo.

vLLM calls ``register()`` in every process it starts and does not catch what
a general plugin raises, so nothing here may raise. When in doubt, vLLM is
left untouched and one log line says why.

Two steps: when the scheduler module is imported, the base ``Scheduler`` gets
the rules its own code needs; when the engine builds a scheduler, its class is
checked, settled (:func:`vllm_mamba_fix.patch.settle_method`) and recorded
(:mod:`vllm_mamba_fix.record`), and one active line per class says what runs.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_mamba_fix import __version__, counters, import_hook, patch, record
from vllm_mamba_fix._log import logger
from vllm_mamba_fix.blocks import BlockUnit, forget_warnings, set_block_unit, unit_of_scheduler
from vllm_mamba_fix.config import Settings, load_settings
from vllm_mamba_fix.encoder_wrapper import EncoderOptions
from vllm_mamba_fix.evidence import read_evidence
from vllm_mamba_fix.policy import Plan, Preflight, Rule, plan, preflight
from vllm_mamba_fix.record import ClassRecord, MethodState
from vllm_mamba_fix.scope import ScopePolicy
from vllm_mamba_fix.targets import (
    ENCODER_METHOD,
    FREE_REQUEST_METHOD,
    INIT_METHOD,
    RULE_METHODS,
    SCHEDULER_CLASS,
    SPLIT_METHOD,
)
from vllm_mamba_fix.versions import Family, PrefillGate, family_for
from vllm_mamba_fix.wrappers import WrapOptions

_lock = threading.RLock()
_said: set[str] = set()  # lines logged once per process

PREFLIGHT_LOG_LEVEL = {
    Preflight.DISABLED: logging.INFO,
    Preflight.ABSENT: logging.INFO,
    Preflight.UNREADABLE_VERSION: logging.WARNING,
    Preflight.FORCED: logging.INFO,
    Preflight.PROCEED: logging.DEBUG,
}


@dataclass(frozen=True)
class _Installed:
    base: type
    settings: Settings
    family: Family
    version: str
    policy: ScopePolicy
    # Base methods whose shape kept them stock, already said at install time.
    unpatchable_on_base: frozenset[str] = frozenset()


_installed: _Installed | None = None


def _say_once(level: int, message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.log(level, "vllm-mamba-fix: %s", message)


def _vllm_version() -> str | None:
    try:
        import vllm
    except Exception as exc:
        _say_once(logging.WARNING, f"vLLM is not importable ({type(exc).__name__}); doing nothing")
        return None
    version = getattr(vllm, "__version__", None)
    return version if isinstance(version, str) else repr(version)


def register(settings: Settings | None = None) -> None:
    """Entry point for ``vllm.general_plugins``. Idempotent; never raises.

    ``settings`` defaults to the environment; doctor passes its own for dry runs.
    """
    try:
        with _lock:
            callback = _register(load_settings() if settings is None else settings)
        if callback is not None:
            # Outside the lock: this may wait for another thread's import, whose
            # callback takes the lock.
            import_hook.when_scheduler_imported(callback)
    except Exception as exc:
        _say_once(
            logging.WARNING,
            f"disabled after an unexpected error ({type(exc).__name__}: {exc})",
        )


def _register(settings: Settings) -> Any:
    for problem in settings.problems:
        _say_once(logging.WARNING, problem)
    version = _vllm_version()
    if version is None:
        return None
    family = family_for(version)
    checked = preflight(settings.mode, family, version)
    _say_once(PREFLIGHT_LOG_LEVEL[checked.outcome], checked.reason)
    if not checked.outcome.waits_for_scheduler:
        return None
    return lambda module: _patch_scheduler(module, settings, family, version)


def _rule_options(decided: Plan, settings: Settings, family: Family, policy: ScopePolicy) -> Any:
    rules = decided.rules
    split = None
    if Rule.SPLIT in rules:
        # FORCE on an unreadable version has no gate of its own: 0.17+'s.
        split = WrapOptions(family.prefill_gate or PrefillGate.BEFORE_PREFILL_END, policy)
    encoder = None
    if rules & {Rule.SPECULATIVE_STALL, Rule.STALL_WATCHDOG}:
        encoder = EncoderOptions(
            policy,
            release_speculative_stalls=Rule.SPECULATIVE_STALL in rules,
            stall_seconds=settings.stall_seconds,
        )
    return patch.RuleOptions(split, encoder)


def _plan_for(cls: type, settings: Settings, family: Family) -> tuple[Plan, Any]:
    evidence = read_evidence(cls)
    return plan(settings.mode, family, evidence, settings.stall_seconds), evidence


def _defined_scheduler(module: ModuleType) -> Any:
    """The ``Scheduler`` class the module defines, even if a platform rebound the name.

    vllm-ascend's patch_balance_schedule.py sets ``scheduler.Scheduler`` to its subclass.
    """
    bound = getattr(module, SCHEDULER_CLASS, None)
    if not isinstance(bound, type):
        return bound
    return next(
        (
            cls
            for cls in bound.__mro__
            if cls.__module__ == module.__name__ and cls.__qualname__ == SCHEDULER_CLASS
        ),
        bound,
    )


def _patch_scheduler(module: ModuleType, settings: Settings, family: Family, version: str) -> None:
    global _installed
    try:
        with _lock:
            base = _defined_scheduler(module)
            if not isinstance(base, type):
                _say_once(
                    logging.WARNING, f"{module.__name__} has no Scheduler class; not patching"
                )
                return
            if _installed is not None or any(
                patch.is_wrapped(base, name) for name in (INIT_METHOD, *RULE_METHODS)
            ):
                logger.debug("vllm-mamba-fix: already active in this process")
                return
            policy = ScopePolicy(settings.scope)
            policy.load()  # here, not in the first scheduling step that needs it
            decided, _ = _plan_for(base, settings, family)
            options = _rule_options(decided, settings, family, policy)
            wrapped, problems = patch.install_on_base(base, options, _on_scheduler_built)
            installed = _Installed(base, settings, family, version, policy, frozenset(problems))
            for name, problem in problems.items():
                # Without _free_request only the streak cap bounds per-request state.
                level = logging.DEBUG if name == FREE_REQUEST_METHOD else logging.WARNING
                _say_once(level, _install_problem_line(name, problem, decided))
            if not wrapped:
                return
            _installed = installed
            counters.register_shutdown_summary()
            logger.debug(
                "vllm-mamba-fix %s installed on %s (%s); each scheduler vLLM builds is checked",
                __version__,
                base.__qualname__,
                ", ".join(wrapped),
            )
            if INIT_METHOD not in wrapped:
                check_class(base)  # no per-construction check: report the base now
    except Exception as exc:
        _say_once(logging.WARNING, f"not patching after an error ({type(exc).__name__}: {exc})")


def _install_problem_line(name: str, problem: str, decided: Plan) -> str:
    if name == SPLIT_METHOD:
        return f"not patching: {problem}"
    if name == ENCODER_METHOD:
        rules = decided.rules & {Rule.SPECULATIVE_STALL, Rule.STALL_WATCHDOG}
        names = " and ".join(sorted(rule.value for rule in rules))
        return f"not installing {names}: {problem}"
    if name == INIT_METHOD:
        return f"cannot check each scheduler vLLM builds: {problem}"
    return f"per-request state is bounded only by its cap: {problem}"


def _on_scheduler_built(scheduler: Any) -> None:
    """Runs at the end of ``Scheduler.__init__`` (once per construction, never per step)."""
    unit = unit_of_scheduler(scheduler)
    set_block_unit(scheduler, unit)
    counters.note_block_size(unit.size)
    check_class(type(scheduler), unit)


def check_class(cls: type, unit: BlockUnit | None = None) -> ClassRecord | None:
    """Settle ``cls`` (the class the engine builds) and record it; logs when the record changes.

    Doctor calls it without a scheduler (``unit`` None) for ``--scheduler-cls``.
    """
    with _lock:
        installed = _installed
        if installed is None:
            return None
        decided, evidence = _plan_for(cls, installed.settings, installed.family)
        options = _rule_options(decided, installed.settings, installed.family, installed.policy)
        owner_options: dict[type, Any] = {cls: options}

        def options_of(owner: type) -> Any:
            if owner not in owner_options:
                owner_plan, _ = _plan_for(owner, installed.settings, installed.family)
                owner_options[owner] = _rule_options(
                    owner_plan, installed.settings, installed.family, installed.policy
                )
            return owner_options[owner]

        methods = tuple(
            patch.settle_method(
                cls,
                installed.base,
                name,
                options.for_method(name),
                lambda owner, name=name: options_of(owner).for_method(name) is not None,
            )
            for name in RULE_METHODS
        )
        result = ClassRecord(
            f"{cls.__module__}.{cls.__qualname__}", decided, evidence, methods, unit
        )
        if record.remember(result):
            _log_record(result, installed)
        return result


def _log_record(result: ClassRecord, installed: _Installed) -> None:
    base = f"{installed.base.__module__}.{installed.base.__qualname__}"
    for method in result.methods:
        if method.owner == base and method.name in installed.unpatchable_on_base:
            continue
        if method.state in (MethodState.OVERRIDDEN, MethodState.UNPATCHABLE):
            _say_once(
                logging.WARNING,
                f"{result.scheduler_class}: {method.describe()}; the fix does not reach it",
            )
        elif method.state is MethodState.WRAPPED_REPLACEMENT:
            _say_once(logging.WARNING, f"{result.scheduler_class}: {method.describe()}")
    unit = result.block
    if unit is not None and unit.mamba is None and Rule.SPLIT in result.rules:
        _say_once(
            logging.WARNING,
            f"the split rule stands down for {result.scheduler_class}: {unit.problem}",
        )
    if not result.rules:
        _say_once(
            logging.INFO,
            f"not needed for {result.scheduler_class} on vLLM {installed.version}: "
            f"{result.plan.describe()}; leaving it stock",
        )
        return
    wrapped = [m for m in result.methods if m.state.carries_rules]
    logger.info(
        "vllm-mamba-fix %s active: %s carries %s; block size %s; wraps %s "
        "(vLLM %s, family %s, scope %s, pid %d)",
        __version__,
        result.scheduler_class,
        result.plan.describe(result.rules),
        "unknown (dry run)" if unit is None else unit.describe(),
        ", ".join(m.wraps or m.name for m in wrapped),
        installed.version,
        installed.family.name,
        installed.settings.scope.value,
        os.getpid(),
    )


def unregister() -> bool:
    """Undo :func:`register` in this process. Returns whether anything was undone."""
    global _installed
    with _lock:
        undone = import_hook.cancel_pending_hook()
        undone = patch.undo() or undone
        _installed = None
        record.forget_all()
        forget_warnings()
        _said.clear()
    if undone:
        logger.info("vllm-mamba-fix: removed; vLLM's scheduler is stock again")
    return undone
