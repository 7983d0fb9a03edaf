"""``register()``: the ``vllm.general_plugins`` entry point, and its undo.

vLLM calls ``register()`` in every process it starts and does not catch what a general plugin
raises, so nothing here may raise: when in doubt, vLLM is left untouched and one line says why.
The patch itself waits for the scheduler module (install/patch.py); every change goes through
``changes.installation``, which :func:`unregister` closes.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import TYPE_CHECKING, Any

from vllm_mamba_fix._log import fields, logger
from vllm_mamba_fix.changes import installation, say_once
from vllm_mamba_fix.decide.policy import Preflight, preflight
from vllm_mamba_fix.facts.config import Settings, load_settings
from vllm_mamba_fix.facts.versions import Family, family_for
from vllm_mamba_fix.install import import_hook
from vllm_mamba_fix.install.import_hook import lock as _lock
from vllm_mamba_fix.observe import counters, metrics

# The patcher (install/patch.py: the rules, the record, the active line) is imported when the
# scheduler module is, not here: register() runs in every process vLLM starts, and most never
# build a scheduler (the front end, workers; tests/install/test_startup_work.py).
if TYPE_CHECKING:
    from vllm_mamba_fix.observe.record import ClassRecord

_SETUP = fields("setup")  # the log fields of a line with no facts but its event

PREFLIGHT_LOG_LEVEL = {
    Preflight.DISABLED: logging.INFO, Preflight.ABSENT: logging.INFO,
    Preflight.UNREADABLE_VERSION: logging.WARNING, Preflight.FORCED: logging.INFO,
    Preflight.PROCEED: logging.DEBUG,
}  # fmt: skip


def _vllm_version() -> str | None:
    try:
        import vllm
    except Exception as exc:
        say_once(logging.WARNING, f"vLLM is not importable ({type(exc).__name__}); doing nothing")
        return None
    version = getattr(vllm, "__version__", None)
    return version if isinstance(version, str) else repr(version)


def register(settings: Settings | None = None) -> None:
    """Entry point for ``vllm.general_plugins``. Idempotent; never raises. ``settings``
    defaults to the environment; doctor passes its own for dry runs."""
    try:
        with _lock:
            callback = _register(load_settings() if settings is None else settings)
        if callback is not None:
            # Outside the lock: this may wait for another thread's import, whose
            # callback takes the lock.
            import_hook.when_scheduler_imported(callback)
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
        say_once(logging.WARNING, f"disabled after an unexpected error ({problem})")


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


def _patch_scheduler(module: ModuleType, settings: Settings, family: Family, version: str) -> None:
    try:  # the import too: this runs inside vLLM's import of the scheduler module
        from vllm_mamba_fix.install import patch

        patch.install(module, settings, family, version)
    except Exception as exc:
        say_once(logging.WARNING, f"not patching after an error ({type(exc).__name__}: {exc})")


def check_class(cls: type) -> ClassRecord | None:
    """Settle and record ``cls`` as the engine's check does, without a built scheduler (doctor's
    ``--scheduler-cls``); None before the patch."""
    from vllm_mamba_fix.install import patch

    return patch.check_class(cls)


def unregister() -> bool:
    """Undo :func:`register` (the session's close: every change reverted, newest first, then
    everything remembered forgotten). Returns whether anything was undone."""
    with _lock:
        undone = installation.close()
    if undone:
        logger.info("vllm-mamba-fix: removed; vLLM's scheduler is stock again", extra=_SETUP)
    return undone
