"""``python -m vllm_mamba_fix [doctor] [--json] [--scheduler-cls module.Class]``."""

from vllm_mamba_fix.doctor.core import main

raise SystemExit(main())
