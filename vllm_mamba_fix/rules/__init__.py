"""The rules: one module per rule, the rule table, the carriers and what they share.

``table.py`` holds one ``RuleSpec`` per rule and one ``MethodSpec`` per wrapped method, and
``plan()``. The five rules open with their header: ``split_rule.py`` (also the split method's
wrapper, carrying the block-unit rule), ``block_unit.py``, ``speculative_stall.py`` (carried by
``encoder_wrapper.py``, the split rule's ear too), ``stall_watch.py`` (its look:
``stall_look.py``) and ``stall_end.py`` (the ``update_from_output`` wrapper, carrying the
look); ``wrappers.py`` holds the ``__init__`` and ``_free_request`` wrappers. Shared:
``split_settle.py``, ``split_reads.py``, ``encoder_cut.py``, ``encoder_facts.py``,
``zero_streaks.py``, ``end_order.py``, ``marking.py`` (CONTRIBUTING.md's layout).

May import: ``observe``, ``decide``, ``facts``, the session (``changes``) and the bottom
modules; never ``install`` or ``doctor``. The three rule-carrying wrappers import none of one
another. What the rules remember is the session's (``installation.memory``), per scheduler
weakly; the plugin's own scheduler attributes are the block unit and the settled split state
(``split_settle.py`` sets them, ``split_rule.py`` re-settles and reads them, as does
``block_unit.py``), beside the block-unit rule's ``cache_config`` view."""
