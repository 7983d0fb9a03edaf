"""Observing: what the plugin did, for whoever reads it (``counters``, ``metrics`` with
``series``, ``metrics_store`` and ``metrics_sweep``, ``record``, ``mtp_tokens``; CONTRIBUTING.md's
layout says what each holds).

May import: ``decide``, ``facts``, the session and the bottom modules. Never ``rules``,
``install`` or ``doctor``: the rules tell, the observers never reach back."""
