"""Observing: what the plugin did, for whoever reads it.

- ``counters.py``: the per-process counters (``stats()``), the correction log lines and the
  shutdown summary; it imports none of its observers (``counters.report_to``: plugin.py hands
  it metrics.py);
- ``metrics.py``: the counters at ``vllm serve``'s ``/metrics``; ``metrics_sweep.py``: the
  private metrics directories of servers that are gone;
- ``record.py``: the typed record of what each scheduler class carries (``records()``).

May import: ``decide``, ``facts`` and the bottom modules. Never ``rules``, ``install`` or
``doctor``: the rules tell, the observers never reach back.
"""
