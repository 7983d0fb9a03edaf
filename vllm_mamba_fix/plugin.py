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
from vllm_mamba_fix.config import ENV_MODE, Mode, Settings, load_settings
from vllm_mamba_fix.scope import ScopePolicy
from vllm_mamba_fix.versions import Family, Verdict, family_for

_lock = threading.RLock()
_patched: list[type] = []
_said: set[str] = set()  # lines logged once per process


def _say_once(level: int, message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.log(level, "vllm-mamba-fix: %s", message)


def policy(mode: Mode, family: Family, version: str) -> tuple[bool, int, str]:
    """Whether to patch, and the log level and line that say why."""
    if mode is Mode.OFF:
        return False, logging.INFO, f"disabled by {ENV_MODE}; vLLM {version} left untouched"
    if family.verdict is Verdict.PATCH:
        return True, logging.DEBUG, f"vLLM {version} is affected ({family.summary})"
    if mode is Mode.FORCE and family.verdict is not Verdict.ABSENT:
        return True, logging.INFO, f"{ENV_MODE}=force: patching vLLM {version} regardless"
    if family.verdict is Verdict.NOT_NEEDED:
        reason = f"not needed on vLLM {version}: {family.summary}; leaving the scheduler untouched"
        return False, logging.INFO, reason
    if family.verdict is Verdict.ABSENT:
        reason = f"vLLM {version} has no Scheduler.{patch.METHOD_NAME} (added in 0.15.0)"
        return False, logging.INFO, reason
    reason = (
        f"cannot read the vLLM version {version!r}; leaving vLLM untouched "
        f"(set {ENV_MODE}=force to patch anyway)"
    )
    return False, logging.WARNING, reason


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
    should_patch, level, reason = policy(settings.mode, family, version)
    _say_once(level, reason)
    if should_patch:
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
            if patch.is_wrapped(scheduler_cls):
                logger.debug("vllm-mamba-fix: already active in this process")
                return
            problem = patch.check_target(scheduler_cls)
            if problem is not None:
                _say_once(logging.WARNING, f"not patching: {problem}")
                return
            assert family.prefill_gate is not None  # policy() never patches ABSENT
            policy = ScopePolicy(settings.scope)
            policy.load()  # here, not in the first scheduling step that needs it
            options = patch.WrapOptions(family.prefill_gate, policy)
            patch.wrap(scheduler_cls, options)
            _patched.append(scheduler_cls)
            counters.register_shutdown_summary()
            logger.info(
                "vllm-mamba-fix %s active: patched Scheduler.%s (vLLM %s, family %s, scope %s, "
                "pid %d)",
                __version__,
                patch.METHOD_NAME,
                version,
                family.name,
                settings.scope.value,
                os.getpid(),
            )
            for subclass in patch.overriding_subclasses(scheduler_cls):
                _warn_override(subclass)
            patch.watch_subclasses(scheduler_cls, _warn_override)
    except Exception as exc:
        _say_once(logging.WARNING, f"not patching after an error ({type(exc).__name__}: {exc})")


def _warn_override(subclass: type) -> None:
    _say_once(
        logging.WARNING,
        f"{subclass.__module__}.{subclass.__qualname__} overrides "
        f"{patch.METHOD_NAME}; the fix does not reach that scheduler",
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
