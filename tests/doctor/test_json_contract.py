"""The ``--json`` contract: every field path and exit code pinned, on the installed vLLM and
on fakes. Fields may be added; none of the pinned may go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.doctor.conftest import (
    ENCODER_CHANGED,
    Run,
    _doctor,
    _fake_run,
    _run,
    needs_affected_vllm,
)

# Pinned from the doctor before it became a package (commit 9d8ec53, vLLM 0.27.1 and the
# fakes of conftest.py): every field path of its --json output ("a.b"; "a[].b" inside a
# list) and its exit code, per case. Fields may be added; none of these may go.
PINNED_FIELDS = frozenset(
    {
        "dry_run",
        "dry_run.already_active",
        "dry_run.forced",
        "dry_run.log",
        "dry_run.overriding_subclasses",
        "dry_run.patched",
        "dry_run.ran",
        "dry_run.restored",
        "dry_run.via",
        "dry_run.wrapped_methods",
        "elapsed_seconds",
        "entry_point",
        "entry_point.count",
        "entry_point.distribution",
        "entry_point.distribution_version",
        "entry_point.found",
        "entry_point.group",
        "entry_point.name",
        "entry_point.value",
        "evidence",
        "evidence.deferred_encoder_free",
        "evidence.problem",
        "evidence.read_from",
        "evidence.split_after_encoder",
        "exit_code",
        "family",
        "family.name",
        "family.summary",
        "family.verdict",
        "platform_plugins",
        "policy",
        "policy.needed",
        "policy.needed_rules",
        "policy.reason",
        "policy.should_patch",
        "policy.verdict",
        "problems",
        "rules",
        "rules[].active",
        "rules[].code",
        "rules[].code.active",
        "rules[].code.reason",
        "rules[].decided_by",
        "rules[].installs",
        "rules[].method",
        "rules[].needed",
        "rules[].problem",
        "rules[].reason",
        "rules[].rule",
        "rules[].version",
        "rules[].version.active",
        "rules[].version.reason",
        "schedulers",
        "schedulers[].class",
        "schedulers[].derives_from_scheduler",
        "schedulers[].loaded",
        "schedulers[].methods",
        "schedulers[].methods._mamba_block_aligned_split",
        "schedulers[].methods._mamba_block_aligned_split.overridden_by",
        "schedulers[].methods._mamba_block_aligned_split.reached",
        "schedulers[].methods._try_schedule_encoder_inputs",
        "schedulers[].methods._try_schedule_encoder_inputs.overridden_by",
        "schedulers[].methods._try_schedule_encoder_inputs.reached",
        "schedulers[].overridden_by",
        "schedulers[].problems",
        "schedulers[].reached",
        "schedulers[].role",
        "settings",
        "settings.env",
        "settings.env.VLLM_MAMBA_FIX",
        "settings.env.VLLM_MAMBA_FIX_SCOPE",
        "settings.env.VLLM_MAMBA_FIX_STALL_SECONDS",
        "settings.mode",
        "settings.other_env",
        "settings.problems",
        "settings.scope",
        "settings.stall_seconds",
        "speculative",
        "speculative.eagle_methods",
        "speculative.eagle_methods_from",
        "speculative.eagle_type",
        "speculative.plugin",
        "speculative.plugin_text",
        "speculative.source",
        "speculative.visible",
        "status",
        "summary",
        "timings_seconds",
        "timings_seconds.dry_run",
        "timings_seconds.import_vllm",
        "tool",
        "tool.name",
        "tool.package_path",
        "tool.python",
        "tool.version",
        "vllm",
        "vllm.distribution",
        "vllm.distribution.name",
        "vllm.distribution.version",
        "vllm.importable",
        "vllm.path",
        "vllm.version",
        "vllm_plugins",
        "vllm_plugins.allows",
        "vllm_plugins.value",
        "warnings",
    }
)


# Present only where the dry run ran (not on a release with nothing to patch).
DRY_RUN_FIELDS = frozenset(
    {
        "dry_run.already_active",
        "dry_run.forced",
        "dry_run.log",
        "dry_run.overriding_subclasses",
        "dry_run.patched",
        "dry_run.restored",
        "dry_run.via",
        "dry_run.wrapped_methods",
        "schedulers[].class",
        "schedulers[].derives_from_scheduler",
        "schedulers[].loaded",
        "schedulers[].methods",
        "schedulers[].methods._mamba_block_aligned_split",
        "schedulers[].methods._mamba_block_aligned_split.overridden_by",
        "schedulers[].methods._mamba_block_aligned_split.reached",
        "schedulers[].methods._try_schedule_encoder_inputs",
        "schedulers[].methods._try_schedule_encoder_inputs.overridden_by",
        "schedulers[].methods._try_schedule_encoder_inputs.reached",
        "schedulers[].overridden_by",
        "schedulers[].problems",
        "schedulers[].reached",
        "schedulers[].role",
        "timings_seconds.dry_run",
    }
)


# Present only where vLLM was imported.
IMPORTED_FIELDS = frozenset(
    {
        "evidence",
        "evidence.deferred_encoder_free",
        "evidence.problem",
        "evidence.read_from",
        "evidence.split_after_encoder",
        "family.name",
        "family.summary",
        "family.verdict",
        "platform_plugins",
        "policy",
        "policy.needed",
        "policy.needed_rules",
        "policy.reason",
        "policy.should_patch",
        "policy.verdict",
        "rules",
        "rules[].active",
        "rules[].code",
        "rules[].code.active",
        "rules[].code.reason",
        "rules[].decided_by",
        "rules[].installs",
        "rules[].method",
        "rules[].needed",
        "rules[].problem",
        "rules[].reason",
        "rules[].rule",
        "rules[].version",
        "rules[].version.active",
        "rules[].version.reason",
        "speculative",
        "speculative.eagle_methods",
        "speculative.eagle_methods_from",
        "speculative.eagle_type",
        "speculative.plugin",
        "speculative.plugin_text",
        "speculative.source",
        "speculative.visible",
        "vllm.distribution",
        "vllm.distribution.name",
        "vllm.distribution.version",
        "vllm.path",
        "vllm.version",
    }
)


def _field_paths(value: Any, prefix: str = "") -> set[str]:
    """Every key path of a JSON value: "a.b" for nested objects, "a[].b" inside lists."""
    paths: set[str] = set()
    if isinstance(value, dict):
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else key
            paths |= {path, *_field_paths(item, path)}
    elif isinstance(value, list):
        for item in value:
            paths |= _field_paths(item, f"{prefix}[]")
    return paths


def _assert_pinned(
    run: Run, code: int, status: str, extra: frozenset[str], absent: frozenset[str]
) -> None:
    data = run.json()
    assert (run.code, data["exit_code"], data["status"]) == (code, code, status), run.err
    missing = ((PINNED_FIELDS - absent) | extra) - _field_paths(data)
    assert not missing, f"fields the doctor no longer writes: {sorted(missing)}"


@needs_affected_vllm
@pytest.mark.parametrize(
    ("run_name", "code", "status", "extra"),
    [
        ("json", 0, "protected", frozenset()),
        ("off", 1, "not-protected", frozenset({"dry_run.mode"})),
        ("custom", 1, "not-protected", frozenset()),
    ],
)
def test_json_fields_and_exit_codes_are_pinned_on_real_vllm(
    real: dict[str, Run], run_name: str, code: int, status: str, extra: frozenset[str]
) -> None:
    _assert_pinned(real[run_name], code, status, extra, frozenset())


@pytest.mark.parametrize(
    ("vllm_version", "fake", "args", "code", "status", "extra", "absent"),
    [
        ("0.32.0", {"encoder": ENCODER_CHANGED}, (), 1, "not-protected",
         frozenset({"dry_run.error"}), frozenset()),
        # dry_run.error is now null here: the block-unit rule installs on 0.33 too.
        ("0.33.0", {}, (), 0, "protected", frozenset({"dry_run.error"}), frozenset()),
        ("0.14.1", {}, (), 0, "not-needed", frozenset(), DRY_RUN_FIELDS),
        ("not-a-version", {}, (), 3, "unknown", frozenset({"dry_run.mode"}), frozenset()),
        ("0.27.1", {}, ("--scheduler-cls", "no_such_module_xyz.Sched",
                        "--speculative-config", '{"method": "mtp"}'),
         2, "invalid-input",
         frozenset({"schedulers[].error", "speculative.how", "speculative.invalid",
                    "speculative.method", "speculative.model", "speculative.resolved_method"}),
         frozenset()),
        (None, {}, (), 3, "unknown", frozenset({"vllm.error"}), DRY_RUN_FIELDS | IMPORTED_FIELDS),
    ],
)  # fmt: skip
def test_json_fields_and_exit_codes_are_pinned_on_fakes(
    tmp_path: Path,
    vllm_version: str | None,
    fake: dict[str, str],
    args: tuple[str, ...],
    code: int,
    status: str,
    extra: frozenset[str],
    absent: frozenset[str],
) -> None:
    if vllm_version is None:  # vLLM not importable
        (tmp_path / "vllm").mkdir()
        (tmp_path / "vllm" / "__init__.py").write_text("raise ImportError('broken build')\n")
        run = _run(_doctor("--json"), {"PYTHONPATH": str(tmp_path)})
    else:
        run = _fake_run(tmp_path, vllm_version, "--json", *args, **fake)
    _assert_pinned(run, code, status, extra, absent)
