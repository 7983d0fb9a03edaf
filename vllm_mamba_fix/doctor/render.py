"""The report as text for people, as one JSON object for scripts, or as a block for a bug
report: both texts are rendered from the JSON body (:mod:`vllm_mamba_fix.doctor.issue`)."""

from __future__ import annotations

import json

from vllm_mamba_fix.doctor.issue import issue_body, render_issue
from vllm_mamba_fix.doctor.report import STATUS, Report


def render_text(report: Report, elapsed: float) -> str:
    data = report.data
    tool, status = data["tool"], data["status"]
    code, headline = STATUS[status]
    out = [f"vllm-mamba-fix {tool['version']} doctor  (python: {tool['python']})", ""]
    out += [issue_body(data), ""]
    out.append(f"result: {headline}: {data['summary']} (exit {code}; checked in {elapsed:.1f} s)")
    if status in ("protected", "not-protected"):
        out.append(
            "note: run this with the same Python and environment as `vllm serve` (the engine "
            "core inherits them)."
        )
    return "\n".join(out)


def render_output(report: Report, elapsed: float, as_json: bool, as_issue: bool) -> str:
    """What the command prints: ``--json``, ``--report``, or the text."""
    if as_issue:
        return render_issue(report.data)
    if as_json:
        return json.dumps(report.data, indent=2, default=str)
    return render_text(report, elapsed)
