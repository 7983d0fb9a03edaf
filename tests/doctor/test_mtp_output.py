"""Doctor names vLLM #53912 for an EAGLE-type ``--speculative-config`` (issue 36 item 3).

Prefix caching with MTP/EAGLE gives wrong tokens after a prefix hit on hybrid Mamba/GDN
models, in vLLM's model runner, where the plugin cannot act. Doctor warns where the
set-up is EAGLE-type, and nowhere else; the warning leaves the verdict and the exit code
alone. The command line on the installed vLLM (0.27.1): ``--json`` with and without the
MTP config, and ``--report`` with it.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.doctor.conftest import REPO, Run, _body, _doctor, _run, needs_affected_vllm
from vllm_mamba_fix.doctor.checks.speculative import check_speculative, mtp_output_warning
from vllm_mamba_fix.facts.versions import family_for
from vllm_mamba_fix.observe.mtp_tokens import VLLM_ISSUE

MTP = '{"method": "mtp", "num_speculative_tokens": 2}'
CANDIDATE_FIXES = ("#53919", "#53505", "#47861/#48375")


def _named(warnings: list[str]) -> list[str]:
    return [w for w in warnings if VLLM_ISSUE in w]


@pytest.fixture(scope="module")
def runs() -> dict[str, Run]:
    jobs = {
        "plain": _doctor("--json"),
        "mtp": _doctor("--json", "--speculative-config", MTP),
        "report": _doctor("--report", "--speculative-config", MTP),
    }
    with ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        futures = {name: pool.submit(_run, cmd, None, REPO) for name, cmd in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


@needs_affected_vllm
def test_an_mtp_config_is_warned_about_and_keeps_the_exit_code(runs: dict[str, Run]) -> None:
    plain, mtp = runs["plain"].json(), runs["mtp"].json()
    assert _named(plain["warnings"]) == [] and plain["speculative"]["known_vllm_issue"] is None
    (warning,) = _named(mtp["warnings"])
    assert mtp["speculative"]["known_vllm_issue"] == {"issue": VLLM_ISSUE, "text": warning}
    assert warning.startswith("--speculative-config mtp is EAGLE-type: on vLLM ")
    for named in ("0.28.0", "0.32.0", "0.27.1", *CANDIDATE_FIXES, "disable prefix caching"):
        assert named in warning, named
    # A warning about vLLM, not the plugin: the same verdict and exit code as without it.
    expected = (0, "protected")
    assert (runs["mtp"].code, mtp["status"]) == (runs["plain"].code, plain["status"]) == expected


@needs_affected_vllm
def test_the_report_block_lists_the_warning(runs: dict[str, Run]) -> None:
    run = runs["report"]
    assert run.code == 0, run.err[-3000:]
    body = _body(run)
    warnings = body.split("\nwarnings\n", 1)[1].splitlines()
    assert [w for w in warnings if VLLM_ISSUE in w] == [
        f"  - {_named(runs['mtp'].json()['warnings'])[0]}"
    ]


@pytest.mark.parametrize(
    ("config", "version", "warned"),
    [
        ({"method": "qwen3_next_mtp", "num_speculative_tokens": 2}, "0.27.1", True),  # the seed
        ({"method": "eagle3", "model": "some/eagle3-drafter"}, "0.32.0", True),
        ({"method": "ngram", "num_speculative_tokens": 2}, "0.27.1", False),
        ({"model": "some/draft-model"}, "0.27.1", False),  # only the engine can tell
        ({"method": "mtp", "num_speculative_tokens": 2}, "0.14.1", False),  # no split there
    ],
)
def test_only_an_eagle_type_method_on_a_release_with_the_split_is_warned_about(
    config: dict[str, Any], version: str, warned: bool
) -> None:
    family = family_for(version)
    found = check_speculative(config, version, family, None, frozenset())
    assert bool(_named(found.warnings)) is warned, found.warnings
    assert (found.data["known_vllm_issue"] is not None) is warned
    assert (mtp_output_warning(found.eagle, config.get("method"), version, family) is not None) is (
        warned
    )
