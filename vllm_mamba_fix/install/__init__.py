"""Installing: ``register()`` and its undo (``plugin.py``), the active line (``active_line.py``),
the one place that wraps vLLM's scheduler (``patch.py``), the import hook that waits for the
scheduler module (``import_hook.py``), and the API server's stream generators (``stream_end.py``).

May import ``rules`` and every layer below; only ``doctor`` and the front door import it.
"""
