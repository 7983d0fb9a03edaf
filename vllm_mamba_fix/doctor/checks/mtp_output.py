"""An EAGLE-type ``--speculative-config`` on a release with the split: name vLLM #53912.

Prefix caching with MTP/EAGLE gives wrong tokens after a prefix-cache hit on hybrid
Mamba/GDN models, in vLLM's model runner (:mod:`vllm_mamba_fix.observe.mtp_tokens` says what
is known). Doctor cannot see the model or ``--enable-prefix-caching``, so the warning names
the combination; the engine core's log names it once it is built. A warning about vLLM, not
about the plugin: it changes neither the verdict nor the exit code.
"""

from __future__ import annotations

from typing import Any

from vllm_mamba_fix.facts.versions import Family, Verdict
from vllm_mamba_fix.observe.mtp_tokens import (
    CAUSE,
    COMBINATION,
    RELEASES,
    VLLM_ISSUE,
    WORKAROUND,
)

SCHEDULER_SIDE = (
    "the scheduler-side invariants of vLLM #47861/#48375 (EAGLE's last-block drop spares Mamba "
    "groups; align-mode snapshots only at exact boundaries) already hold in 0.27.1's scheduler"
)


def mtp_output_warning(eagle: bool | None, method: Any, version: str, family: Family) -> str | None:
    """The warning for an EAGLE-type method on a release with the split (0.15+), or None."""
    if eagle is not True or family.verdict is Verdict.ABSENT:
        return None
    return (
        f"--speculative-config {method} is EAGLE-type: on vLLM {version}, {COMBINATION} can "
        f"give wrong tokens after a prefix-cache hit ({VLLM_ISSUE}; {RELEASES}); {CAUSE}, "
        f"and {SCHEDULER_SIDE}; {WORKAROUND}"
    )
