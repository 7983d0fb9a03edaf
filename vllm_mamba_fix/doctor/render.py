"""The report rendered from its JSON body: the text, ``--json``, and ``--report`` (the text's rows
fenced for a bug report, beside ``python -m vllm.collect_env``, which shows torch, Python, the OS
and the hardware)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from vllm_mamba_fix.doctor.report import STATUS, VERDICT_TEXT, Report
from vllm_mamba_fix.facts import config

UNKNOWN_BLOCKS = (
    "unknown until the engine starts: each engine core's active line names the Mamba KV "
    "cache's block (block size ...), and where it differs from cache_config.block_size the "
    "block-unit line names both"
)


def _row(label: str, text: str) -> str:
    return f"{label:<17} {text}".rstrip()  # 17: the label column


def _plugin_rows(data: Mapping[str, Any]) -> list[str]:
    tool, ep, vllm = data.get("tool", {}), data.get("entry_point", {}), data.get("vllm", {})
    where = f"entry point NOT usable: {ep.get('error', 'not checked')}"
    if ep.get("found"):
        dist = f"{ep.get('distribution')} {ep.get('distribution_version')}"
        where = f"entry point {ep.get('name')} -> {ep.get('value')} ({dist})"
    status = data.get("status", "unknown")
    code, headline = STATUS.get(status, (data.get("exit_code"), status))
    text = f"not importable ({vllm.get('error', 'unknown')})"
    if vllm.get("importable"):
        build = vllm.get("distribution") or {}
        built = f" ({build['name']} {build['version']})" if build else ""
        family = (data.get("family") or {}).get("name")
        text = f"{vllm.get('version')}{built}, family {family}, at {vllm.get('path')}"
    rows = [
        _row("vllm-mamba-fix", f"{tool.get('version')} at {tool.get('package_path')}; {where}"),
        _row("doctor", f"{headline} (exit {code}): {data.get('summary', '')}"),
        _row("vLLM", text),
    ]
    if "policy" in data:
        policy = data["policy"]
        rows.append(_row("policy", f"{VERDICT_TEXT[policy['verdict']]}: {policy['reason']}"))
    return rows


def _dry_run_rows(data: Mapping[str, Any]) -> list[str]:
    info = data.get("dry_run") or {}
    if not info.get("ran"):
        return [_row("dry run", "not run")]
    forced = f" with {config.ENV_MODE}={info['mode']}" if info.get("forced") else ""
    how = f"register(){forced}"
    if not info.get("wrapped_methods"):
        return [_row("dry run", f"{how} patched nothing: {info.get('error')}")]
    undo = "undone" if info.get("restored") else "NOT undone"
    if info.get("already_active"):
        undo = "already active in this process, so left in place"
    names = " and ".join(f"Scheduler.{m}" for m in info["wrapped_methods"])
    hook = "on import of the scheduler module" if info["via"] == "import hook" else "at once"
    return [_row("dry run", f"{how} patched {names} {hook}; wrappers verified; {undo}")]


def _support_rows(data: Mapping[str, Any]) -> list[str]:
    rows, metrics, stall_end = [], data.get("metrics"), data.get("stall_end") or {}
    if metrics:
        state = {True: "available", False: "NOT available", None: "not checked"}
        rows.append(_row("metrics", f"{state[metrics['available']]}: {metrics['reason']}"))
    if stall_end and not stall_end["checked"]:
        rows.append(_row("ending stalls", f"not checked: {stall_end.get('error')}"))
    for name, why in stall_end.get("classes", {}).items():
        text = "vLLM's own finish reaches the client" if why is None else f"only named: {why}"
        rows.append(_row("ending stalls", f"{name}: {text}"))
    return rows


def _delivered(data: Mapping[str, Any]) -> bool:  # the entry point found, VLLM_PLUGINS allows
    return bool(
        data.get("entry_point", {}).get("found") and data.get("vllm_plugins", {}).get("allows")
    )


def _rule_rows(data: Mapping[str, Any]) -> list[str]:
    entries, delivered = data.get("rules"), _delivered(data)
    if not entries:
        return [_row("rules", "not checked (vLLM is not importable)")]
    rows = [_row("rules", "what will run in the engine core, and why")]
    width = max(len(e["rule"]) for e in entries)
    for entry in entries:
        why = f"by {entry['decided_by']}: {entry['reason']}"
        why = f"needed; {why}" if entry.get("needed") else why
        if entry["active"] and not delivered:
            why = f"vLLM will not load the plugin; {why}"
        why = f"{why}; {entry['problem']}" if entry.get("problem") else why
        runs = entry["active"] and entry.get("installs") and delivered
        state = "runs" if runs else "does not run"
        rows.append(f"  {entry['rule']:<{width}}  {state:<12} {why}")
    spec = data.get("speculative", {})
    if spec.get("visible"):
        eagle = "EAGLE-type" if spec.get("eagle_type") else "not EAGLE-type"
        how = "" if spec.get("how") == "method given" else f" ({spec.get('how')})"
        rows.append(_row("speculative", f"{spec.get('resolved_method')}: {eagle}{how}"))
    elif spec:
        text = f"set by the engine at start (not given to doctor); {spec['plugin_text']}"
        rows.append(_row("speculative", text))
    return rows


def _block_rows(data: Mapping[str, Any]) -> list[str]:
    entry = next((e for e in data.get("rules") or () if e["rule"] == "block-unit"), {})
    if not entry.get("block_facts"):
        foreseen = f"; {entry['foreseen']}" if entry.get("foreseen") else ""
        return [_row("block sizes", UNKNOWN_BLOCKS + foreseen)]
    rows = [_row("block sizes", "of the schedulers built in this process")]
    for fact in entry["block_facts"]:
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
    if name == config.ENV_STALL_SECONDS:
        return "stall watchdog off" if stall is None else f"stall watchdog after {stall:g} s"
    if name == config.ENV_END_STALLS_AFTER:
        if end is None:
            return "stalls no rule can end are never ended"
        return f"a stall no rule can end is ended {end:g} s after it is named"
    key = {config.ENV_MODE: "mode", config.ENV_SCOPE: "scope"}.get(name)
    return str(settings.get(key)) if key else "?"


def _settings_rows(data: Mapping[str, Any]) -> list[str]:
    settings = data.get("settings", {})
    env, other = settings.get("env", {}), settings.get("other_env", {})
    width = max([len(name) for name in (*env, *other)] or [0])
    rows = [_row("settings", "every VLLM_MAMBA_FIX* variable: its value -> what applies")]
    for name, raw in env.items():
        bad = [p for p in settings.get("problems", []) if p.startswith(f"{name}=")]
        flag = f"  INVALID: {bad[0]}" if bad else ""
        shown = "unset" if raw is None else repr(raw)
        rows.append(f"  {name:<{width}}  {shown} -> {_effective(name, settings)}{flag}")
    for name, raw in other.items():
        rows.append(f"  {name:<{width}}  {raw!r} -> UNKNOWN: the plugin reads no such variable")
    plugins = data.get("vllm_plugins", {})
    if "value" in plugins:
        allows = "loads" if plugins.get("allows") else "does NOT load"
        shown = "unset" if plugins["value"] is None else repr(plugins["value"])
        rows.append(_row(config.ENV_VLLM_PLUGINS, f"{shown}: vLLM {allows} {config.PLUGIN_NAME!r}"))
    return rows


def issue_body(data: Mapping[str, Any]) -> str:  # the text report's rows and --report's
    body = [*_plugin_rows(data), "", *_rule_rows(data), *_block_rows(data), *_support_rows(data)]
    body += ["", *_dry_run_rows(data), *_scheduler_rows(data), "", *_settings_rows(data)]
    for heading, items in (("problems", data.get("problems")), ("warnings", data.get("warnings"))):
        if items:
            body += ["", heading, *(f"  - {item}" for item in items)]
    return "\n".join(body)


def render_issue(data: Mapping[str, Any]) -> str:
    text = issue_body(data)
    # A fence longer than any run of backticks in the text.
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))
    return (
        "**vllm-mamba-fix doctor --report** (paste it next to the output of "
        f"`python -m vllm.collect_env`)\n\n{fence}text\n{text}\n{fence}"
    )


def render_text(report: Report, elapsed: float) -> str:
    data, tool = report.data, report.data["tool"]
    code, headline = STATUS[data["status"]]
    out = [f"vllm-mamba-fix {tool['version']} doctor  (python: {tool['python']})", ""]
    out += [issue_body(data), ""]
    out.append(f"result: {headline}: {data['summary']} (exit {code}; checked in {elapsed:.1f} s)")
    if data["status"] in ("protected", "not-protected"):
        out.append(
            "note: run this with the same Python and environment as `vllm serve` (the engine "
            "core inherits them)."
        )
    return "\n".join(out)


def render_output(report: Report, elapsed: float, as_json: bool, as_issue: bool) -> str:
    if as_issue:
        return render_issue(report.data)
    if as_json:
        return json.dumps(report.data, indent=2, default=str)
    return render_text(report, elapsed)
