"""Observing: what the plugin did, for whoever reads it (CONTRIBUTING.md's layout).

May import: ``decide``, ``facts``, the session and the bottom modules. Never ``rules``,
``install`` or ``doctor``: the rules tell, the observers never reach back."""
