"""The plugin's ``VLLM_MAMBA_FIX*`` variables, the one module that reads the environment.

It only reads: the one variable the plugin sets (:data:`METRICS_DIR_VAR`) is set by
``observe/metrics.py`` through the record of changes. A bad value never raises: it becomes a
problem line (logged once by the caller) and the default applies.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeVar

ENV_MODE = "VLLM_MAMBA_FIX"
ENV_SCOPE = "VLLM_MAMBA_FIX_SCOPE"
ENV_STALL_SECONDS = "VLLM_MAMBA_FIX_STALL_SECONDS"
DEFAULT_STALL_SECONDS = 30.0
ENV_END_STALLS_AFTER = "VLLM_MAMBA_FIX_END_STALLS_AFTER"
# Seconds after the watchdog names a stall no rule can end: see docs/reliability.md.
DEFAULT_END_STALLS_AFTER = 60.0
# Per-rule switches (on by default); the rule table (rules/table.py) names which is whose.
ENV_SPLIT_RULE = "VLLM_MAMBA_FIX_SPLIT_RULE"
ENV_BLOCK_RULE = "VLLM_MAMBA_FIX_BLOCK_RULE"
SWITCHES = (ENV_SPLIT_RULE, ENV_BLOCK_RULE)
# vLLM's own allow-list of plugins; read only to report it (vLLM applies it).
ENV_VLLM_PLUGINS = "VLLM_PLUGINS"
PLUGIN_NAME = "mamba_fix"


class Mode(enum.Enum):
    AUTO = "auto"  # follow the version policy
    OFF = "off"
    FORCE = "force"  # patch even where the policy says no


class Scope(enum.Enum):
    MULTIMODAL = "multimodal"  # requests with encoder inputs
    ALL = "all"


def builtin_in_scope(request: Any, scope: Scope) -> bool:
    """The built-in rule (``multimodal``: requests with encoder inputs), the one copy: asked
    directly without a third-party rule, else as the hook's last impl (``scope.BuiltinScope``).
    vLLM's ``has_encoder_inputs`` is ``len(mm_features) > 0`` on every release 0.15-0.34,
    through two properties: the list is read directly (the split wrapper asks per call)."""
    return scope is Scope.ALL or bool(request.mm_features)


_MODE_VALUES: dict[str, Mode] = {
    "auto": Mode.AUTO, "1": Mode.AUTO, "true": Mode.AUTO, "on": Mode.AUTO,
    "0": Mode.OFF, "false": Mode.OFF, "off": Mode.OFF, "force": Mode.FORCE,
}  # fmt: skip
_SCOPE_VALUES: dict[str, Scope] = {scope.value: scope for scope in Scope}
_SWITCH_VALUES: dict[str, bool] = {
    "1": True, "true": True, "on": True, "0": False, "false": False, "off": False,
}  # fmt: skip


class Settings(NamedTuple):
    mode: Mode = Mode.AUTO
    scope: Scope = Scope.MULTIMODAL
    # Seconds a request may get 0 tokens before the watchdog names it; None: off.
    stall_seconds: float | None = DEFAULT_STALL_SECONDS
    # Seconds after a named, un-endable stall before its request is ended; None: never.
    end_stalls_after: float | None = DEFAULT_END_STALLS_AFTER
    # Per-rule switches turned off (their ENV_* names).
    switched_off: frozenset[str] = frozenset()
    problems: tuple[str, ...] = ()

    def switched_on(self, switch: str | None) -> bool:
        return switch is None or switch not in self.switched_off

    def changed(self) -> dict[str, str]:
        """The settings away from their defaults, by short name (the variable's name after
        ``VLLM_MAMBA_FIX_``, lower case; ``mode`` for ``VLLM_MAMBA_FIX``): the active line's."""
        seconds = (
            ("stall_seconds", self.stall_seconds, DEFAULT_STALL_SECONDS),
            ("end_stalls_after", self.end_stalls_after, DEFAULT_END_STALLS_AFTER),
        )
        changed = {"mode": self.mode.value} if self.mode is not Mode.AUTO else {}
        if self.scope is not Scope.MULTIMODAL:
            changed["scope"] = self.scope.value
        for name, value, default in seconds:
            if value != default:
                changed[name] = "off" if value is None else f"{value:g}"
        for switch in sorted(self.switched_off):
            changed[switch.removeprefix(ENV_MODE + "_").lower()] = "off"
        return changed


_Choice = TypeVar("_Choice", Mode, Scope, bool)


def _parse(
    environ: Mapping[str, str], name: str, values: Mapping[str, _Choice], default: _Choice
) -> tuple[_Choice, str | None]:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default, None
    value = values.get(raw.strip().lower())
    if value is not None:
        return value, None
    accepted = "|".join(values)
    shown = default if isinstance(default, bool) else default.value
    return default, f"{name}={raw!r} is not one of {accepted}; using {shown!r}"


def _parse_seconds(
    environ: Mapping[str, str], name: str, default: float, off_at_zero: bool = False
) -> tuple[float | None, str | None]:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default, None
    text = raw.strip().lower()
    if text == "off":
        return None, None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if off_at_zero and seconds == 0:
        return None, None
    if 0 <= seconds < float("inf"):
        return seconds, None
    return default, f"{name}={raw!r} is not a number of seconds >= 0 or 'off'; using {default:g}"


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    mode, mode_problem = _parse(env, ENV_MODE, _MODE_VALUES, Mode.AUTO)
    scope, scope_problem = _parse(env, ENV_SCOPE, _SCOPE_VALUES, Scope.MULTIMODAL)
    stall_seconds, stall_problem = _parse_seconds(env, ENV_STALL_SECONDS, DEFAULT_STALL_SECONDS)
    end_after, end_problem = _parse_seconds(
        env, ENV_END_STALLS_AFTER, DEFAULT_END_STALLS_AFTER, off_at_zero=True
    )
    switches = [(name, *_parse(env, name, _SWITCH_VALUES, True)) for name in SWITCHES]
    problems = (mode_problem, scope_problem, stall_problem, end_problem)
    switched_off = frozenset(name for name, on, _ in switches if not on)
    problems = tuple(p for p in (*problems, *(p for _, _, p in switches)) if p)
    return Settings(mode, scope, stall_seconds, end_after, switched_off, problems)


def raw_values(
    names: tuple[str, ...], environ: Mapping[str, str] | None = None
) -> dict[str, str | None]:
    """The raw values of ``names`` (unset: None), for doctor to show."""
    env = os.environ if environ is None else environ
    return {name: env.get(name) for name in names}


# vLLM's (and prometheus_client's) multiprocess directory, read for /metrics (observe/metrics.py).
PROMETHEUS_DIR = "PROMETHEUS_MULTIPROC_DIR"
# The private directory an API server hands to the engine cores it starts. Not ``VLLM_*``:
# vLLM warns about (or, with --fail-on-environ-validation, rejects) unknown VLLM_ variables.
METRICS_DIR_VAR = "_VLLM_MAMBA_FIX_METRICS_DIR"


def metrics_directories() -> tuple[str | None, str | None]:
    """(vLLM's ``PROMETHEUS_MULTIPROC_DIR``, the private directory an API server handed down)."""
    return os.environ.get(PROMETHEUS_DIR) or None, os.environ.get(METRICS_DIR_VAR) or None


# Every variable the plugin reads, in the order the docs list them.
ALL_VARIABLES = (
    ENV_MODE, ENV_SCOPE, ENV_STALL_SECONDS, ENV_END_STALLS_AFTER, *SWITCHES,
)  # fmt: skip


def vllm_plugins_allows(environ: Mapping[str, str] | None = None) -> bool:
    """Whether vLLM's ``VLLM_PLUGINS`` lets it load this plugin: unset loads every plugin, else
    a comma list of exact names, not stripped (the empty string loads none)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_VLLM_PLUGINS)
    return raw is None or PLUGIN_NAME in raw.split(",")


def other_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Set ``VLLM_MAMBA_FIX*`` variables the plugin does not read (a misspelt setting is
    unset to the plugin), for doctor to flag."""
    env = os.environ if environ is None else environ
    return {
        name: value
        for name, value in sorted(env.items())
        if name.startswith(ENV_MODE) and name not in ALL_VARIABLES
    }
