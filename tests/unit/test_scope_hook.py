"""The pluggy scope hook, with third-party rules discovered through a real entry point."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tests.conftest import InstallScopeRule
from vllm_mamba_fix.decide.scope import ScopePolicy, builtin_in_scope, load_third_party_hook
from vllm_mamba_fix.facts.config import Scope
from vllm_mamba_fix.hookspecs import ENTRY_POINT_GROUP

# mm_features as vLLM's Request has them: a list, empty for a text request.
TEXT = SimpleNamespace(request_id="text", mm_features=[], priority=0)
IMAGE = SimpleNamespace(request_id="image", mm_features=[object()], priority=0)
VIP_TEXT = SimpleNamespace(request_id="vip", mm_features=[], priority=-1)


def test_builtin_scopes() -> None:
    multimodal = ScopePolicy(Scope.MULTIMODAL)
    assert multimodal.in_scope(IMAGE) and not multimodal.in_scope(TEXT)
    everything = ScopePolicy(Scope.ALL)
    assert everything.in_scope(IMAGE) and everything.in_scope(TEXT)


def test_third_party_rule_is_honoured(install_scope_rule: InstallScopeRule) -> None:
    install_scope_rule(
        "vip_scope",
        """
        from vllm_mamba_fix.hookspecs import hookimpl

        @hookimpl
        def mamba_fix_in_scope(request, scope):
            if request.priority < 0:
                return True
            if request.request_id == "image":
                return False
            return None
        """,
    )
    policy = ScopePolicy(Scope.MULTIMODAL)
    assert policy.in_scope(VIP_TEXT)  # the rule widens the scope
    assert not policy.in_scope(IMAGE)  # and narrows it
    assert not policy.in_scope(TEXT)  # None defers to the built-in rule


def test_the_hook_ends_with_the_one_builtin_rule(install_scope_rule: InstallScopeRule) -> None:
    install_scope_rule(
        "deferring_scope",
        """
        from vllm_mamba_fix.hookspecs import hookimpl

        @hookimpl
        def mamba_fix_in_scope(request, scope):
            return None
        """,
    )
    hook = load_third_party_hook()
    assert hook is not None
    # Where every third-party rule defers, the hook's own last impl answers, as
    # builtin_in_scope does; a scope it does not know is deferred, never guessed.
    for scope in Scope:
        for request in (TEXT, IMAGE):
            assert hook(request=request, scope=scope.value) is builtin_in_scope(request, scope)
    assert hook(request=IMAGE, scope="no-such-scope") is None
    builtin = [impl for impl in hook.get_hookimpls() if impl.plugin_name == "builtin"]
    assert len(builtin) == 1 and builtin[0].trylast
    assert hook.get_hookimpls()[0] is builtin[0]  # pluggy calls the list last to first


def test_failing_rule_falls_back_with_one_warning(
    install_scope_rule: InstallScopeRule, plugin_log: pytest.LogCaptureFixture
) -> None:
    install_scope_rule(
        "broken_scope",
        """
        from vllm_mamba_fix.hookspecs import hookimpl

        @hookimpl
        def mamba_fix_in_scope(request, scope):
            raise RuntimeError("rule database unreachable")
        """,
    )
    policy = ScopePolicy(Scope.MULTIMODAL)
    with plugin_log.at_level(logging.DEBUG):
        assert policy.in_scope(IMAGE)
        assert not policy.in_scope(TEXT)
    warnings = [r for r in plugin_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "rule database unreachable" in warnings[0].getMessage()


def test_unimportable_rule_is_skipped_with_a_warning(
    install_scope_rule: InstallScopeRule, plugin_log: pytest.LogCaptureFixture
) -> None:
    install_scope_rule("missing_dep_scope", "import no_such_module_xyz\n")
    policy = ScopePolicy(Scope.MULTIMODAL)
    with plugin_log.at_level(logging.DEBUG):
        assert policy.in_scope(IMAGE) and not policy.in_scope(TEXT)
    assert len(plugin_log.records) == 1
    assert ENTRY_POINT_GROUP in plugin_log.records[0].getMessage()
