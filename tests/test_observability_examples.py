"""examples/observability/ (issue 37 item 4): the alert rules and the Grafana dashboard.

- ``promtool check rules`` and ``promtool test rules`` on the shipped files, with Prometheus's
  own promtool (Debian's ``prometheus`` package; tools/env.sh puts it in the venv where it can:
  apt, and root for ``apt-get update``). Without promtool these tests skip with the reason; under
  ``CI=true`` they fail instead, so CI cannot pass them by skipping.
- The promtool tests can fail: the same tests against rules with one threshold changed fail.
- Every PromQL expression of the dashboard parses (promtool, as recording rules, with Grafana's
  variables filled in), and every series the rules and the dashboard name is one the plugin
  exports (series.py) or vLLM's own (read from the installed vLLM's metrics module).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_mamba_fix.observe.series import IDENTITY, METRIC_NAMES

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "observability"
RULES = EXAMPLES / "prometheus-alerts.yml"
RULE_TESTS = EXAMPLES / "prometheus-alerts.test.yml"
DASHBOARD = EXAMPLES / "grafana-dashboard.json"
SERIES_NAME = re.compile(r"\b(vllm(?:_mamba_fix_[a-z_]+|:[a-z_]+))\b")


def promtool() -> str:
    """The promtool to run; skips (fails under ``CI=true``) where there is none."""
    found = shutil.which("promtool") or str(Path(sys.executable).with_name("promtool"))
    if os.access(found, os.X_OK):
        return found
    reason = (
        "promtool not found (Debian's prometheus package; tools/env.sh installs it into the "
        "venv where apt is available, as root)"
    )
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}; under CI=true a skip would hide the alert-rule tests")
    pytest.skip(reason)


def _promtool(*args: str, cwd: Path = EXAMPLES) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_promtool_checks_the_rules() -> None:
    run = _promtool("check", "rules", RULES.name)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS: 5 rules found" in run.stdout, run.stdout


def test_promtool_tests_the_rules() -> None:
    run = _promtool("test", "rules", RULE_TESTS.name)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout, run.stdout


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("> 600", "> 6000"),  # the standing stall's age
        ("increase(vllm_mamba_fix_stalls_ended_total[10m])) > 0", "increase(x[10m])) > 0"),
        ("absent(vllm_mamba_fix_info)", "absent(vllm_mamba_fix_infos)"),  # a misspelt name
    ],
)
def test_the_rule_tests_fail_on_other_rules(tmp_path: Path, old: str, new: str) -> None:
    text = RULES.read_text()
    assert text.count(old) == 1, old
    (tmp_path / RULES.name).write_text(text.replace(old, new))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    run = _promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert run.returncode != 0 and "FAILED" in run.stdout + run.stderr, run.stdout


def _dashboard_exprs() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def _rule_exprs() -> list[str]:
    import yaml

    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def _vllm_metric_names() -> set[str]:
    """vLLM's own series (counters with ``_total``), from the installed vLLM's metrics module
    (read, not imported: importing vLLM takes seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    loggers = Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py"
    names = set(re.findall(r'name="(vllm:[a-z_]+)"', loggers.read_text()))
    assert "vllm:num_requests_running" in names, loggers
    return names | {n + "_total" for n in names}


def test_the_dashboard_is_grafana_json_over_known_series() -> None:
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 36
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    used = {m for expr in _dashboard_exprs() for m in SERIES_NAME.findall(expr)}
    unknown = used - METRIC_NAMES - _vllm_metric_names()
    assert not unknown, f"not exported by the plugin or vLLM: {sorted(unknown)}"
    # Over every series of the plugin, and joined with vLLM's own where it helps.
    assert used >= METRIC_NAMES, sorted(METRIC_NAMES - used)
    assert "vllm:num_requests_running" in used
    # Per model and engine, vLLM's labels: every panel query filters or groups by them.
    for expr in _dashboard_exprs()[:-2]:
        assert all(label in expr for label in IDENTITY), expr


def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    """Grafana's variables filled in, each expression is a recording rule promtool checks."""
    fill = {"$__rate_interval": "5m", "$model_name": ".*", "$engine": ".*"}
    rules = []
    for i, expr in enumerate(_dashboard_exprs()):
        if expr.startswith("label_values("):  # Grafana's, not PromQL: its series selector
            expr = expr[len("label_values(") : expr.rindex(",")]
        for variable, value in fill.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        rules.append({"record": f"dashboard:expr_{i}", "expr": expr})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
    run = _promtool("check", "rules", path.name, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_rules_name_known_series() -> None:
    used = {m for expr in _rule_exprs() for m in SERIES_NAME.findall(expr)}
    assert not used - METRIC_NAMES - _vllm_metric_names(), used
    assert {"vllm_mamba_fix_info", "vllm_mamba_fix_stalls_named_total"} <= used
