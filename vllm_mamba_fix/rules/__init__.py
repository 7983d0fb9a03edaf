"""The rules: one module per rule, the rule table, the two carriers and what they share.

- ``table.py``: the rule table: one ``RuleSpec`` per rule (naming its module), one
  ``MethodSpec`` per wrapped method, and ``plan()``;
- the five rules, each one module opening with its header (the vLLM issue it answers, the
  releases it runs on, how it is decided, what removes it), then when it applies and what it
  does per call: ``split_rule.py``, ``block_unit.py``, ``speculative_stall.py``,
  ``stall_watch.py``, ``stall_end.py`` (the last carries itself and the watchdog's look,
  ``stall_look.py``: the ``update_from_output`` wrapper);
- the carriers: ``split_rule.py`` is the split method's wrapper too (for the split and
  block-unit rules: a split call reads top to bottom in that one module); ``wrappers.py``
  holds the ``__init__`` and ``_free_request`` wrappers and ``encoder_wrapper.py`` the
  encoder-input check's (the speculative-stall rule, the split rule's ear);
- shared: ``split_settle.py`` (a scheduler's split state, once), ``encoder_cut.py`` (which
  chunk the encoder check cut), ``encoder_facts.py`` (what a request's own inputs need),
  ``zero_streaks.py`` (the stores of 0s), ``end_order.py`` (the watchdog's order to the end).

A new rule goes here: its module (with the header), its row in ``table.py``, its test file
``tests/rules/test_<module>.py``; its verdict in ``decide/policy.py`` (CONTRIBUTING.md,
"Adding a rule").

May import: ``observe``, ``decide``, ``facts``, the session (``changes``) and the bottom
modules. Never ``install`` or ``doctor``. The wrappers of the three rule-carrying methods
(``split_rule``, ``encoder_wrapper``, ``stall_end``) import none of one another. What the
rules remember (the encoder note, streaks, named stalls, orders) is the session's
(``installation.memory``), per scheduler weakly; the plugin's own scheduler attributes are
the block unit and the settled split state (``split_settle.py`` sets them, ``split_rule.py``
re-settles; both and ``block_unit.py`` read them), beside the block-unit rule's
``cache_config`` view.
"""
