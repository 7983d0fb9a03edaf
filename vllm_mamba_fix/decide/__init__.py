"""Decisions: plain values in, plain values out; the rules' pure parts.

- ``plan.py``: the rules' names (``Rule``), a verdict on one, a plan of them;
- ``policy.py``: one verdict function per rule, and ``preflight``;
- ``decision.py``: the corrections, as functions of integers;
- ``stalls.py``: zero-token streaks, when a 0 is a stall, the own-inputs arithmetic, and the
  split's line to the watchdog (``listen``);
- ``scope.py``: which requests a rule may touch (the built-in rule, and third parties'
  through :mod:`vllm_mamba_fix.hookspecs`).

May import: ``facts`` and the bottom modules (``_log``, ``hookspecs``). Never vLLM, and
nothing of ``observe``, ``rules``, ``install`` or ``doctor``. ``decision``, ``stalls``,
``scope`` and ``policy`` import none of one another.
"""
