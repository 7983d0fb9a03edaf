"""``register()``: the ``vllm.general_plugins`` entry point, and its undo.

vLLM calls ``register()`` in every process it starts and does not catch what
a general plugin raises, so nothing here may raise. When in doubt, vLLM is
left untouched and one log line says why.
"""

from __future__ import annotations

import logging
import os
import threading
from types import ModuleType

from vllm_mamba_fix import __version__, counters, patch
from vllm_mamba_fix._log import logger
from vllm_mamba_fix.config import Settings, load_settings
from vllm_mamba_fix.evidence import read_evidence
from vllm_mamba_fix.scope import ScopePolicy
from vllm_mamba_fix.versions import (
    Family,
    Plan,
    PrefillGate,
    Rule,
    family_for,
    plan,
    preflight,
)

_lock = threading.RLock()
_patched: list[type] = []
_said: set[str] = set()  # lines logged once per process


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
            _register(load_settings() if settings is None else settings)
    except Exception as exc:
        _say_once(
            logging.WARNING,
            f"disabled after an unexpected error ({type(exc).__name__}: {exc})",
        )


def _register(settings: Settings) -> None:
    for problem in settings.problems:
        _say_once(logging.WARNING, problem)
    version = _vllm_version()
    if version is None:
        return
    family = family_for(version)
    should_wait, level, reason = preflight(settings.mode, family, version)
    _say_once(level, reason)
    if should_wait:
        patch.when_scheduler_imported(
            lambda module: _patch_scheduler(module, settings, family, version)
        )


def _patch_scheduler(module: ModuleType, settings: Settings, family: Family, version: str) -> None:
    try:
        with _lock:
            scheduler_cls = getattr(module, patch.SCHEDULER_CLASS, None)
            if not isinstance(scheduler_cls, type):
                _say_once(
                    logging.WARNING, f"{module.__name__} has no Scheduler class; not patching"
                )
                return
            if any(patch.is_wrapped(scheduler_cls, name) for name in patch.WRAPPED_METHODS):
                logger.debug("vllm-mamba-fix: already active in this process")
                return
            decided = plan(
                settings.mode, family, read_evidence(scheduler_cls), settings.stall_seconds
            )
            if not decided.rules:
                _say_once(
                    logging.INFO,
                    f"not needed on vLLM {version}: {decided.describe()}; "
                    "leaving the scheduler untouched",
                )
                return
            installed, rules = _install(scheduler_cls, decided, settings, family)
            if not installed:
                return
            _patched.append(scheduler_cls)
            counters.register_shutdown_summary()
            logger.info(
                "vllm-mamba-fix %s active: patched %s; %s (vLLM %s, family %s, scope %s, pid %d)",
                __version__,
                " and ".join(f"Scheduler.{name}" for name in installed),
                decided.describe(rules),
                version,
                family.name,
                settings.scope.value,
                os.getpid(),
            )
            for subclass in patch.overriding_subclasses(scheduler_cls, installed):
                _warn_override(subclass, installed)
            patch.watch_subclasses(
                scheduler_cls, lambda subclass: _warn_override(subclass, installed), installed
            )
    except Exception as exc:
        _say_once(logging.WARNING, f"not patching after an error ({type(exc).__name__}: {exc})")


def _install(
    scheduler_cls: type, decided: Plan, settings: Settings, family: Family
) -> tuple[tuple[str, ...], frozenset[Rule]]:
    """Wrap what the plan asks for; a method whose shape is unexpected is left stock.

    Returns the wrapped methods and the rules they carry.
    """
    policy = ScopePolicy(settings.scope)
    policy.load()  # here, not in the first scheduling step that needs it
    installed: list[str] = []
    rules: set[Rule] = set()
    if Rule.SPLIT in decided.rules:
        problem = patch.check_target(scheduler_cls, patch.METHOD_NAME)
        if problem is not None:
            _say_once(logging.WARNING, f"not patching: {problem}")
        else:
            # FORCE on an unreadable version has no gate of its own: 0.17+'s.
            gate = family.prefill_gate or PrefillGate.BEFORE_PREFILL_END
            patch.wrap(scheduler_cls, patch.WrapOptions(gate, policy))
            installed.append(patch.METHOD_NAME)
            rules.add(Rule.SPLIT)
    encoder_rules = decided.rules & {Rule.SPECULATIVE_STALL, Rule.STALL_WATCHDOG}
    if encoder_rules:
        problem = patch.check_target(scheduler_cls, patch.ENCODER_METHOD_NAME)
        if problem is not None:
            names = " and ".join(sorted(rule.value for rule in encoder_rules))
            _say_once(logging.WARNING, f"not installing {names}: {problem}")
        else:
            options = patch.EncoderOptions(
                policy,
                release_speculative_stalls=Rule.SPECULATIVE_STALL in decided.rules,
                stall_seconds=settings.stall_seconds,
            )
            patch.wrap_encoder(scheduler_cls, options)
            installed.append(patch.ENCODER_METHOD_NAME)
            rules |= encoder_rules
    return tuple(installed), frozenset(rules)


def _warn_override(subclass: type, installed: tuple[str, ...]) -> None:
    overridden = " and ".join(patch.overridden_methods(subclass, installed))
    _say_once(
        logging.WARNING,
        f"{subclass.__module__}.{subclass.__qualname__} overrides "
        f"{overridden}; the fix does not reach that scheduler",
    )


def unregister() -> bool:
    """Undo :func:`register` in this process. Returns whether anything was undone."""
    with _lock:
        undone = patch.cancel_pending_hook()
        for scheduler_cls in _patched:
            undone = patch.unwrap(scheduler_cls) or undone
        _patched.clear()
        _said.clear()
    if undone:
        logger.info("vllm-mamba-fix: removed; vLLM's scheduler is stock again")
    return undone
