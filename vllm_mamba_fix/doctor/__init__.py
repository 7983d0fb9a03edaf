"""``vllm-mamba-fix doctor``: will the fix be active where vLLM's scheduler runs?

It checks, in this interpreter and environment: the vLLM release, the
scheduler's code evidence and which of the two decides each rule of the rule
table (split, block-unit, speculative-stall, stall-watchdog, stall-end), the
``vllm.general_plugins`` entry point, ``VLLM_PLUGINS``, the plugin's own
settings and rule switches, and, per scheduler class vLLM may build
(``--scheduler-cls``, repeatable), what runs for it (its own rules and those it
inherits); it dry-runs the patch (apply through ``register()``, settle each
class as the engine does, verify every wrapper, undo). The block-unit rule
engages per built scheduler, which a dry run cannot see.

Speculative decoding is configured when the engine starts, so the doctor
cannot see it; pass the engine's --speculative-config to have it classified.

Exit codes:
  0  protected (every rule the release needs will apply), or not needed
  1  not protected: a rule the release needs would not apply
  2  invalid input: bad arguments (a --speculative-config that is not a JSON
     object, or that vLLM would reject), or a --scheduler-cls that cannot be
     loaded
  3  cannot tell: vLLM is not importable, its version cannot be read, or an
     internal error
"""

# The docstring above is --help. checks/ fill in a JSON body, verdict reads the install records
# (never the log text), render prints the JSON; only core.py imports install/plugin.py.

from __future__ import annotations

from vllm_mamba_fix.doctor.checks.speculative import (
    FALLBACK_METHODS,
    SpeculativeMethods,
    classify_speculative,
)
from vllm_mamba_fix.doctor.core import main, run
from vllm_mamba_fix.doctor.report import (
    EXIT_CANNOT_TELL,
    EXIT_INVALID_INPUT,
    EXIT_NOT_PROTECTED,
    EXIT_OK,
)

__all__ = ["EXIT_CANNOT_TELL", "EXIT_INVALID_INPUT", "EXIT_NOT_PROTECTED", "EXIT_OK",
           "FALLBACK_METHODS", "SpeculativeMethods", "classify_speculative",
           "main", "run"]  # fmt: skip
