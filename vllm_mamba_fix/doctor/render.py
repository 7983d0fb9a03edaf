"""The report as text for people, as one JSON object for scripts, or as a block for a bug
report (:mod:`vllm_mamba_fix.doctor.issue`)."""

from __future__ import annotations

import json

from vllm_mamba_fix.decide.policy import Rule
from vllm_mamba_fix.doctor.issue import render_issue
from vllm_mamba_fix.doctor.report import STATUS, Report

_TAGS = {"ok": " ok ", "fail": "FAIL", "warn": "warn", "info": "    ", "skip": " -- "}
_LABEL = max(12, *(len(rule.value) for rule in Rule))  # rule names are labels


def render_text(report: Report, elapsed: float) -> str:
    data = report.data
    tool = data["tool"]
    out = [f"vllm-mamba-fix {tool['version']} doctor  (python: {tool['python']})", ""]
    for line in report.lines:
        out.append(f"  [{_TAGS[line.status]}] {line.label:<{_LABEL}} {line.text}".rstrip())
    for warning in report.warnings:
        out.append(f"  [warn] {'warning':<{_LABEL}} {warning}")
    status = data["status"]
    code, headline = STATUS[status]
    out += ["", f"result: {headline}: {data['summary']} (exit {code}; checked in {elapsed:.1f} s)"]
    if len(report.problems) > 1:
        out += [f"  - {problem}" for problem in report.problems]
    if status in ("protected", "not-protected"):
        out.append(
            "note: run this with the same Python and environment as `vllm serve` (the engine "
            "core inherits them)."
        )
    return "\n".join(out)


def render_json(report: Report) -> str:
    return json.dumps(report.data, indent=2, default=str)


def render_output(report: Report, elapsed: float, as_json: bool, as_issue: bool) -> str:
    """What the command prints: ``--json``, ``--report``, or the text."""
    if as_issue:
        return render_issue(report.data)
    return render_json(report) if as_json else render_text(report, elapsed)
