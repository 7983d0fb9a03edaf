"""The rules: one module per rule, the rule table, the carriers and what they share.

``table.py`` holds one ``RuleSpec`` per rule and one ``MethodSpec`` per wrapped method. Each
rule module opens with its header; the carriers (the wrappers) and the modules rules share are
listed in CONTRIBUTING.md's layout.

May import: ``observe``, ``decide``, ``facts``, the session (``changes``) and the bottom
modules; never ``install`` or ``doctor``. The three rule-carrying wrappers import none of one
another. What the rules remember is the session's (``installation.memory``), per scheduler
weakly; the plugin's own scheduler attributes are the block unit and the settled split state
(``split_settle.py`` sets them, ``split_rule.py`` re-settles and reads them, as does
``block_unit.py``), beside the block-unit rule's ``cache_config`` view."""
