"""Speculative decoding, which the engine decides only at start: is a ``--speculative-config``
EAGLE-type (classified as vLLM does), and what the plugin does."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

from vllm_mamba_fix.decide.policy import Plan, Rule
from vllm_mamba_fix.doctor.report import stdout_to_stderr
from vllm_mamba_fix.facts.versions import Family, Verdict
from vllm_mamba_fix.observe.mtp_tokens import CAUSE, COMBINATION, RELEASES, VLLM_ISSUE, WORKAROUND

# Drafters with a KV cache group of their own whose block is smaller than a hybrid target's
# Mamba block: the engine core's minimum over the groups pulls cache_config.block_size below it
# (0.34 v1/worker/gpu/model_states/mamba_hybrid.py: "a drafter group ... (e.g. DFlash)").
OWN_KV_GROUP_METHODS = ("dflash",)
OWN_KV_GROUP_TEXT = (
    "its drafter brings its own KV cache group with a smaller block, so on a hybrid model "
    "the engine core's cache_config.block_size (the smallest group block) will be below the "
    "Mamba block"
)
# What SpeculativeConfig infers from the draft model's name when no method is given, in its order.
_NAME_HINTS = (
    ("eagle-", "eagle"),
    ("eagle3", "eagle3"),
    ("dflash", "dflash"),
    ("dspark", "dspark"),
)


@dataclasses.dataclass(frozen=True)
class SpeculativeMethods:  # the installed release's, as ``SpeculativeConfig`` sees them
    eagle: tuple[str, ...]  # those use_eagle() accepts: the scheduler's EAGLE-type
    mtp_aliases: tuple[str, ...]  # names vLLM rewrites to "mtp"
    known: tuple[str, ...] | None  # every accepted method; None: not read
    source: str


FALLBACK_METHODS = SpeculativeMethods(
    ("eagle", "eagle3", "mtp", "dflash", "dspark"),
    ("deepseek_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp", "glm4_moe_lite_mtp",
     "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp", "exaone4_5_mtp",
     "qwen3_next_mtp", "qwen3_5_mtp", "longcat_flash_mtp", "minimax_m3_mtp",
     "bailing_hybrid_mtp", "kimi_k3_mtp", "pangu_ultra_moe_mtp", "step3p5_mtp", "hy_v3_mtp",
     "gemma4_mtp", "inkling_mtp"),
    None,
    "built-in list (vLLM 0.27.1)",
)  # fmt: skip


def _literal_values(tp: Any) -> list[str]:
    values: list[str] = []
    for arg in typing.get_args(tp):
        values.extend(_literal_values(arg) if typing.get_args(arg) else [arg])
    return [v for v in values if isinstance(v, str)]


def release_speculative_methods() -> SpeculativeMethods:
    """Read the release's own lists and ``use_eagle()``; the 0.27.1 lists if that fails."""
    try:
        with stdout_to_stderr():
            spec = importlib.import_module("vllm.config.speculative")
        known = tuple(_literal_values(spec.SpeculativeMethod))
        # use_eagle() reads only self.method on every release (0.15-0.33).
        use_eagle = spec.SpeculativeConfig.use_eagle
        eagle = tuple(m for m in known if use_eagle(types.SimpleNamespace(method=m)))
        aliases = tuple(m for m in _literal_values(spec.MTPModelTypes) if m != "mtp")
    except Exception:
        return FALLBACK_METHODS
    if not known or not eagle:
        return FALLBACK_METHODS
    return SpeculativeMethods(eagle, aliases, known, "vllm.config.speculative (use_eagle)")


def _is_custom_proposer_path(model: str) -> bool:
    """vLLM's test: a dotted import path (``pkg.MyProposer``) is a custom proposer."""
    if model.startswith(("http://", "https://", "file://")) or "/" in model:
        return False
    parts = model.split(".")
    return len(parts) >= 2 and all(part.isidentifier() for part in parts)


def _from_model(model: str, methods: SpeculativeMethods, given: bool) -> str | None:
    """The method vLLM infers from the draft model's name (None: only its config can tell)."""
    known = methods.known
    known = ("custom_class", *(m for _, m in _NAME_HINTS)) if known is None else known  # all
    if not given and model in ("ngram", "[ngram]"):
        return "ngram"
    if not given and _is_custom_proposer_path(model) and "custom_class" in known:
        return "custom_class"
    hint = next((m for key, m in _NAME_HINTS if key in model.lower()), None)
    return hint if hint in known else None


def classify_speculative(config: Mapping[str, Any], methods: SpeculativeMethods) -> dict[str, Any]:
    """Whether it makes the scheduler EAGLE-type (``use_eagle``): ``eagle_type`` None where only
    the draft model's config, read at engine start, can tell; ``invalid``: why vLLM rejects it."""
    method, model = config.get("method"), config.get("model")
    out: dict[str, Any] = {"method": method, "model": model, "invalid": None}
    resolved, how = method, "method given"
    if isinstance(method, str) and method in methods.mtp_aliases:
        resolved, how = "mtp", f"{method!r} is an MTP model type, which vLLM runs as 'mtp'"
    elif method in (None, "draft_model") and isinstance(model, str):
        resolved = _from_model(model, methods, method is not None)
        how = "method inferred from the draft model's name, as vLLM does"
        if resolved is None:
            how = (
                f"no method given: the engine infers it at start from the config of {model} "
                "(EAGLE-type if its model_type is an MTP type)"
            )
    elif method is None:
        out["invalid"] = how = "neither 'method' nor 'model' is given"
    if isinstance(resolved, str) and methods.known is not None and resolved not in methods.known:
        out["invalid"] = f"method {resolved!r} is not one this vLLM accepts"
    eagle = None if resolved is None else resolved in methods.eagle
    out.update(resolved_method=resolved, eagle_type=eagle,
               drafter_kv_group=resolved in OWN_KV_GROUP_METHODS, how=how)  # fmt: skip
    return out


def parse_speculative_config(value: str) -> dict[str, Any]:
    """argparse type: the JSON object ``vllm serve --speculative-config`` takes."""
    try:
        config = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    for key in ("method", "model"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise argparse.ArgumentTypeError(f"{key!r} must be a string")
    return config


def mtp_output_warning(eagle: bool | None, method: Any, version: str, family: Family) -> str | None:
    """vLLM #53912 (:mod:`vllm_mamba_fix.observe.mtp_tokens`) for an EAGLE-type method on 0.15+,
    or None: it changes neither verdict nor exit code (doctor sees no model, no prefix caching)."""
    if eagle is not True or family.verdict is Verdict.ABSENT:
        return None
    return (
        f"--speculative-config {method} is EAGLE-type: on vLLM {version}, {COMBINATION} can "
        f"give wrong tokens after a prefix-cache hit ({VLLM_ISSUE}; {RELEASES}); {CAUSE}, "
        "and the scheduler-side invariants of vLLM #47861/#48375 (EAGLE's last-block drop spares "
        "Mamba groups; align-mode snapshots only at exact boundaries) already hold in 0.27.1's "
        f"scheduler; {WORKAROUND}"
    )


def _what_the_plugin_does(
    decided: Plan | None, family: Family, installed: frozenset[Rule]
) -> tuple[str, str]:
    """("ends" | "names" | "none", text): what the plugin does about the EAGLE encoder stall,
    under the real settings' plan (None: inactive) and what its dry run installed."""
    if decided is None:
        return "none", "the plugin stays inactive, so it neither ends nor names an EAGLE stall"
    if decided.verdict(Rule.SPECULATIVE_STALL).active:
        if Rule.SPECULATIVE_STALL not in installed:
            return "none", "the plugin would end the EAGLE encoder stall, but cannot install it"
        return "ends", "the plugin ends the EAGLE encoder stall"
    if family.drafter_fallback:
        return "none", "encoder inputs are freed without a look-ahead: the EAGLE stall cannot arise"
    if Rule.STALL_WATCHDOG in installed:
        return "names", (
            "the plugin only names an EAGLE encoder stall (watchdog); before 0.24 it cannot end "
            "it, as the model runner asserts on an encoder-cache miss"
        )
    return "none", "the plugin cannot end an EAGLE encoder stall before 0.24; the watchdog is off"


@dataclasses.dataclass
class SpeculativeCheck:
    data: dict[str, Any]  # the JSON object
    eagle: bool | None  # None: not given, or only the engine can tell
    invalid: str | None = None
    warnings: list[str] = dataclasses.field(default_factory=list)


def check_speculative(
    config: Mapping[str, Any] | None,
    version: str,
    family: Family,
    decided: Plan | None,
    installed: frozenset[Rule],
) -> SpeculativeCheck:
    methods = release_speculative_methods()
    does, does_text = _what_the_plugin_does(decided, family, installed)
    data: dict[str, Any] = {
        "visible": config is not None,
        "source": "--speculative-config" if config is not None else None,
        "eagle_type": None,
        "eagle_methods": list(methods.eagle),
        "eagle_methods_from": methods.source,
        "plugin": does,
        "plugin_text": f"on vLLM {version} {does_text}",
        "known_vllm_issue": None,  # vLLM's own wrong tokens under an EAGLE-type method
    }
    if config is None:
        return SpeculativeCheck(data, None)
    data.update(classify_speculative(config, methods))
    if data["invalid"]:
        return SpeculativeCheck(data, None, invalid=f"--speculative-config: {data['invalid']}")
    if not data["eagle_type"]:
        return SpeculativeCheck(data, data["eagle_type"])
    method, warnings = data["resolved_method"], []
    if does == "names":
        warnings.append(
            f"EAGLE-type speculation ({method}) on vLLM {version}: a request whose images sit "
            "less than 2 tokens apart can stall, and the plugin can only name it; upgrade to "
            "0.33+, or keep 2 or more tokens between images"
        )
    known = mtp_output_warning(True, method, version, family)
    data["known_vllm_issue"] = None if known is None else {"issue": VLLM_ISSUE, "text": known}
    return SpeculativeCheck(data, True, warnings=warnings + ([known] if known else []))
