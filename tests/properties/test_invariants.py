"""Issue 5: hypothesis property tests of the plugin on the real Scheduler.

Generated (tests/properties/_support.py): prompts with 0-4 images of varied
sizes and text before, between and after them; block sizes 16..2096; token
budgets; encoder caches from the largest image to all images;
long_prefill_token_threshold; 1-4 concurrent text and image requests submitted
at different steps; repeated requests (same tokens, same image hashes) that
hit the prefix cache, submitted while the original runs or once it finished.

Each scenario runs twice: on stock vLLM and with the plugin loaded through
vLLM's load_general_plugins() (VLLM_MAMBA_FIX=force where the release leaves
it off). With the plugin, invariants 1-5 hold (see the checks in _support).
"""

from __future__ import annotations

from hypothesis import given

from tests.properties._support import check_scenario, profile, scenarios
from tools.prop_adapters import PropScenario


@profile(ci_examples=30)
@given(scenario=scenarios())
def test_mixed_scenarios(scenario: PropScenario) -> None:
    check_scenario(scenario)


@profile(ci_examples=10)
@given(scenario=scenarios(text_only=True))
def test_text_only_scenarios_are_stock(scenario: PropScenario) -> None:
    check_scenario(scenario)


@profile(ci_examples=15)
@given(scenario=scenarios(repeat=True))
def test_repeated_requests_hit_the_prefix_cache(scenario: PropScenario) -> None:
    check_scenario(scenario)
