"""Decisions: plain values in, plain values out; the rules' pure parts (``plan``, ``policy``,
``decision``, ``stalls``, ``scope``; CONTRIBUTING.md's layout says what each holds).

May import: ``facts`` and the bottom modules. Never vLLM, and nothing of ``observe``,
``rules``, ``install`` or ``doctor``. ``decision``, ``stalls``, ``scope`` and ``policy``
import none of one another.
"""
