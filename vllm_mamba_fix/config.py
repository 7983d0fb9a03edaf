"""Configuration from environment variables; the only place that reads them.

Invalid values never raise: each becomes a problem string (logged once by the
caller) and the default applies.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

ENV_MODE = "VLLM_MAMBA_FIX"
ENV_SCOPE = "VLLM_MAMBA_FIX_SCOPE"
ENV_STALL_SECONDS = "VLLM_MAMBA_FIX_STALL_SECONDS"
DEFAULT_STALL_SECONDS = 30.0
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


_MODE_VALUES: dict[str, Mode] = {
    "auto": Mode.AUTO,
    "1": Mode.AUTO,
    "true": Mode.AUTO,
    "on": Mode.AUTO,
    "0": Mode.OFF,
    "false": Mode.OFF,
    "off": Mode.OFF,
    "force": Mode.FORCE,
}
_SCOPE_VALUES: dict[str, Scope] = {scope.value: scope for scope in Scope}


@dataclass(frozen=True)
class Settings:
    mode: Mode = Mode.AUTO
    scope: Scope = Scope.MULTIMODAL
    # Seconds a request may get 0 tokens before the watchdog names it; None: off.
    stall_seconds: float | None = DEFAULT_STALL_SECONDS
    problems: tuple[str, ...] = ()


_Choice = TypeVar("_Choice", Mode, Scope)


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
    return default, f"{name}={raw!r} is not one of {accepted}; using {default.value!r}"


def _parse_seconds(environ: Mapping[str, str]) -> tuple[float | None, str | None]:
    raw = environ.get(ENV_STALL_SECONDS)
    if raw is None or raw.strip() == "":
        return DEFAULT_STALL_SECONDS, None
    text = raw.strip().lower()
    if text == "off":
        return None, None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if 0 <= seconds < float("inf"):
        return seconds, None
    problem = (
        f"{ENV_STALL_SECONDS}={raw!r} is not a number of seconds >= 0 or 'off'; "
        f"using {DEFAULT_STALL_SECONDS:g}"
    )
    return DEFAULT_STALL_SECONDS, problem


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    mode, mode_problem = _parse(env, ENV_MODE, _MODE_VALUES, Mode.AUTO)
    scope, scope_problem = _parse(env, ENV_SCOPE, _SCOPE_VALUES, Scope.MULTIMODAL)
    stall_seconds, stall_problem = _parse_seconds(env)
    problems = tuple(p for p in (mode_problem, scope_problem, stall_problem) if p)
    return Settings(mode=mode, scope=scope, stall_seconds=stall_seconds, problems=problems)


def vllm_plugins_allows(environ: Mapping[str, str] | None = None) -> bool:
    """Whether vLLM's ``VLLM_PLUGINS`` lets it load this plugin.

    vLLM's rule: unset loads every plugin; otherwise a comma list of exact
    names, not stripped, so the empty string loads none.
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_VLLM_PLUGINS)
    return raw is None or PLUGIN_NAME in raw.split(",")
