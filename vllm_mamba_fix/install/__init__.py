"""Installing: the one place that changes vLLM, and the entry point that starts it.

- ``plugin.py``: ``register()`` (the ``vllm.general_plugins`` entry point) and
  ``unregister()``; the per-construction check that settles and records each scheduler class;
- ``active_line.py``: the one short line each class built logs, its reasons at DEBUG;
- ``patch.py``: wraps and unwraps the scheduler's methods (``install_on_base``,
  ``settle_method``, ``undo``);
- ``import_hook.py``: runs a callback once a module is imported, without importing it early;
- ``stream_end.py``: the API server's stream generators, wrapped so a streaming client of a
  request the stall end ended is told (the stall-end rule's client side).

May import: ``rules`` and every layer below. Only ``doctor`` and the package's front door
(``vllm_mamba_fix/__init__.py``) import it.
"""
