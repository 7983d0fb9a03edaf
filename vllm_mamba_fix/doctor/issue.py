"""The one renderer of doctor's JSON body (``Report.data``) into rows: the text report prints
them, ``--report`` fences them to paste into a bug report next to ``python -m
vllm.collect_env``. Only what ``collect_env`` does not show (torch, Python, the OS, the CPU and
the GPUs are its): the plugin, the vLLM build, the rules and why, the block sizes, the dry run,
the scheduler classes, every ``VLLM_MAMBA_FIX*`` setting and ``VLLM_PLUGINS``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from vllm_mamba_fix.doctor.report import STATUS, VERDICT_TEXT
from vllm_mamba_fix.facts.config import (
    ENV_END_STALLS_AFTER,
    ENV_MODE,
    ENV_SCOPE,
    ENV_STALL_SECONDS,
    ENV_VLLM_PLUGINS,
    PLUGIN_NAME,
)

TITLE = "vllm-mamba-fix doctor --report"
UNKNOWN_BLOCKS = (
    "unknown until the engine starts: each engine core's active line names the Mamba KV "
    "cache's block (block size ...), and where it differs from cache_config.block_size the "
    "block-unit line names both"
)
_WIDTH = 17  # the label column


def _row(label: str, text: str) -> str:
    return f"{label:<{_WIDTH}} {text}".rstrip()


def _plugin_rows(data: Mapping[str, Any]) -> list[str]:
    tool = data.get("tool", {})
    ep = data.get("entry_point", {})
    if ep.get("found"):
        dist = f"{ep.get('distribution')} {ep.get('distribution_version')}"
        where = f"entry point {ep.get('name')} -> {ep.get('value')} ({dist})"
    else:
        where = f"entry point NOT usable: {ep.get('error', 'not checked')}"
    status = data.get("status", "unknown")
    code, headline = STATUS.get(status, (data.get("exit_code"), status))
    rows = [
        _row("vllm-mamba-fix", f"{tool.get('version')} at {tool.get('package_path')}; {where}"),
        _row("doctor", f"{headline} (exit {code}): {data.get('summary', '')}"),
    ]
    vllm = data.get("vllm", {})
    text = f"not importable ({vllm.get('error', 'unknown')})"
    if vllm.get("importable"):
        build = vllm.get("distribution") or {}
        built = f" ({build['name']} {build['version']})" if build else ""
        family = (data.get("family") or {}).get("name")
        text = f"{vllm.get('version')}{built}, family {family}, at {vllm.get('path')}"
    rows.append(_row("vLLM", text))
    if "policy" in data:
        policy = data["policy"]
        rows.append(_row("policy", f"{VERDICT_TEXT[policy['verdict']]}: {policy['reason']}"))
    return rows


def _dry_run_rows(data: Mapping[str, Any]) -> list[str]:
    """What the dry run of ``register()`` did (the plugin's own lines are in the JSON)."""
    info = data.get("dry_run") or {}
    if not info.get("ran"):
        return [_row("dry run", "not run")]
    how = f"register() with {ENV_MODE}={info['mode']}" if info.get("forced") else "register()"
    if info.get("wrapped_methods"):
        undo = "undone" if info.get("restored") else "NOT undone"
        if info.get("already_active"):
            undo = "already active in this process, so left in place"
        names = " and ".join(f"Scheduler.{m}" for m in info["wrapped_methods"])
        hook = "on import of the scheduler module" if info["via"] == "import hook" else "at once"
        text = f"{how} patched {names} {hook}; wrappers verified; {undo}"
    else:
        text = f"{how} patched nothing: {info.get('error')}"
    return [_row("dry run", text)]


def _support_rows(data: Mapping[str, Any]) -> list[str]:
    """Whether the counters reach /metrics and a stall no rule can end can be ended."""
    rows: list[str] = []
    metrics = data.get("metrics")
    if metrics:
        state = {True: "available", False: "NOT available", None: "not checked"}
        rows.append(_row("metrics", f"{state[metrics['available']]}: {metrics['reason']}"))
    stall_end = data.get("stall_end")
    if stall_end and not stall_end["checked"]:
        rows.append(_row("ending stalls", f"not checked: {stall_end.get('error')}"))
    for name, why in (stall_end or {}).get("classes", {}).items():
        text = "vLLM's own finish reaches the client" if why is None else f"only named: {why}"
        rows.append(_row("ending stalls", f"{name}: {text}"))
    return rows


def _delivered(data: Mapping[str, Any]) -> bool:
    """vLLM will load the plugin: the entry point is found and ``VLLM_PLUGINS`` allows it."""
    return bool(data.get("entry_point", {}).get("found")) and bool(
        data.get("vllm_plugins", {}).get("allows")
    )


def _rule_rows(data: Mapping[str, Any]) -> list[str]:
    entries = data.get("rules")
    if not entries:
        return [_row("rules", "not checked (vLLM is not importable)")]
    delivered = _delivered(data)
    rows = [_row("rules", "what will run in the engine core, and why")]
    width = max(len(e["rule"]) for e in entries)
    for entry in entries:
        runs = entry["active"] and entry.get("installs") and delivered
        why = f"by {entry['decided_by']}: {entry['reason']}"
        if entry.get("needed"):
            why = f"needed; {why}"
        if entry["active"] and not delivered:
            why = f"vLLM will not load the plugin; {why}"
        if entry.get("problem"):
            why = f"{why}; {entry['problem']}"
        state = "runs" if runs else "does not run"
        rows.append(f"  {entry['rule']:<{width}}  {state:<12} {why}")
    speculative = data.get("speculative", {})
    if speculative.get("visible"):
        eagle = "EAGLE-type" if speculative.get("eagle_type") else "not EAGLE-type"
        how = "" if speculative.get("how") == "method given" else f" ({speculative.get('how')})"
        rows.append(_row("speculative", f"{speculative.get('resolved_method')}: {eagle}{how}"))
    elif speculative:
        text = f"set by the engine at start (not given to doctor); {speculative['plugin_text']}"
        rows.append(_row("speculative", text))
    return rows


def _block_rows(data: Mapping[str, Any]) -> list[str]:
    entry = next((e for e in data.get("rules") or () if e["rule"] == "block-unit"), {})
    facts = entry.get("block_facts") or []
    if not facts:
        text = UNKNOWN_BLOCKS
        if entry.get("foreseen"):
            text = f"{text}; {entry['foreseen']}"
        return [_row("block sizes", text)]
    rows = [_row("block sizes", "of the schedulers built in this process")]
    for fact in facts:
        state = "differ" if fact.get("differs") else "equal"
        if fact.get("split_idle"):
            state = f"split idle: {fact['split_idle']}"
        elif fact.get("differs"):
            state += ", block-unit " + ("engaged" if fact.get("engaged") else "NOT engaged")
        rows.append(
            f"  {fact['class']}: Mamba KV cache {fact.get('block_size')}, "
            f"cache_config.block_size {fact.get('cache_config_block_size')} ({state})"
        )
    return rows


def _scheduler_rows(data: Mapping[str, Any]) -> list[str]:
    rows = [_row("scheduler classes", "checked (vLLM builds one; --scheduler-cls adds yours)")]
    verb = "runs"
    if data.get("dry_run", {}).get("forced"):  # the plugin is off: the dry run forced it on
        verb = "would run if enabled:"
    elif not _delivered(data):
        verb = "would run if vLLM loaded the plugin:"
    for entry in data.get("schedulers") or ():
        record = entry.get("record") or {}
        runs = ", ".join(record.get("rules") or []) or "no rule"
        text = f"  {entry['class']} ({entry.get('role')}): {verb} {runs}"
        if not entry.get("loaded", True):
            text = f"  {entry['class']} ({entry.get('role')}): cannot be loaded"
        for rule in record.get("inherited") or ():
            owners = [m["owner"] for m in record["methods"] if rule in m["rules"]]
            text += f"; inherits {rule} from {(owners or ['a base class'])[0]}'s wrapper"
        if record.get("split_idle"):
            text += f"; split rules idle: {record['split_idle']}"
        rows.append(text + "".join(f"; {p}" for p in entry.get("problems") or []))
    return rows


def _effective(name: str, settings: Mapping[str, Any]) -> str:
    switch = settings.get("switches", {}).get(name)
    if switch is not None:
        return f"{'on' if switch['on'] else 'off'} ({switch['rule']} rule)"
    stall, end = settings.get("stall_seconds"), settings.get("end_stalls_after")
    return {
        ENV_MODE: str(settings.get("mode")),
        ENV_SCOPE: str(settings.get("scope")),
        ENV_STALL_SECONDS: "stall watchdog off"
        if stall is None
        else f"stall watchdog after {stall:g} s",
        ENV_END_STALLS_AFTER: "stalls no rule can end are never ended"
        if end is None
        else f"a stall no rule can end is ended {end:g} s after it is named",
    }.get(name, "?")


def _settings_rows(data: Mapping[str, Any]) -> list[str]:
    settings = data.get("settings", {})
    env: Mapping[str, str | None] = settings.get("env", {})
    problems: list[str] = settings.get("problems", [])
    other: Mapping[str, str] = settings.get("other_env", {})
    width = max([len(name) for name in (*env, *other)] or [0])
    rows = [_row("settings", "every VLLM_MAMBA_FIX* variable: its value -> what applies")]
    for name, raw in env.items():
        shown = "unset" if raw is None else repr(raw)
        bad = [p for p in problems if p.startswith(f"{name}=")]
        flag = f"  INVALID: {bad[0]}" if bad else ""
        rows.append(f"  {name:<{width}}  {shown} -> {_effective(name, settings)}{flag}")
    for name, raw in other.items():
        rows.append(f"  {name:<{width}}  {raw!r} -> UNKNOWN: the plugin reads no such variable")
    plugins = data.get("vllm_plugins", {})
    if "value" in plugins:
        value = plugins["value"]
        allows = "loads" if plugins.get("allows") else "does NOT load"
        shown = "unset" if value is None else repr(value)
        rows.append(_row(ENV_VLLM_PLUGINS, f"{shown}: vLLM {allows} {PLUGIN_NAME!r}"))
    return rows


def issue_body(data: Mapping[str, Any]) -> str:
    """The report's facts, one row each: the text report and ``--report`` both print it."""
    body: list[str] = [*_plugin_rows(data), ""]
    body += [*_rule_rows(data), *_block_rows(data), *_support_rows(data), ""]
    body += [*_dry_run_rows(data), *_scheduler_rows(data), ""]
    body += _settings_rows(data)
    for heading, items in (("problems", data.get("problems")), ("warnings", data.get("warnings"))):
        if items:
            body += ["", heading, *(f"  - {item}" for item in items)]
    return "\n".join(body)


def render_issue(data: Mapping[str, Any]) -> str:
    text = issue_body(data)
    # A fence longer than any run of backticks in the text.
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))
    return (
        f"**{TITLE}** (paste it next to the output of `python -m vllm.collect_env`)\n\n"
        f"{fence}text\n{text}\n{fence}"
    )
