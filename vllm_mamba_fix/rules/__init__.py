"""The rules: one module per rule, each opening with its header (the vLLM issue it answers,
the releases it runs on, how it is decided, what removes it), and the rule table.

- ``table.py``: the rule table: one ``RuleSpec`` per rule, one ``MethodSpec`` per wrapped
  method, and ``plan()``;
- ``wrappers.py``: the split method's wrapper, carrying the split and block-unit rules (and
  the ``__init__`` and ``_free_request`` wrappers); ``split_rule.py``: the split rule's
  corrector;
- ``encoder_wrapper.py``: the speculative-stall rule, and the watchdog's ear on the
  encoder-input check;
- ``stall_watch.py``: the stall-watchdog rule; ``end_order.py``: the order it leaves;
  ``stall_end.py``: the stall-end rule, which carries the order out;
- ``encoder_facts.py``: the proof, shared by the split rule and the watchdog, that a
  request's own encoder inputs keep it at a 0.

A new rule goes here: its module (with the header), its row in ``table.py``; its verdict in
``decide/policy.py`` (CONTRIBUTING.md, "Adding a rule").

May import: ``observe``, ``decide``, ``facts`` and the bottom modules. Never ``install`` or
``doctor``. The wrappers of the three rule-carrying methods (``wrappers``,
``encoder_wrapper``, ``stall_end``) import none of one another.
"""
