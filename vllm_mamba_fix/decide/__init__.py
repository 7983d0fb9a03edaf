"""Decisions: plain values in, plain values out; the rules' pure parts (CONTRIBUTING.md's layout).

May import ``facts`` and the bottom modules; never vLLM, ``observe``, ``rules``, ``install`` or
``doctor``. ``decision``, ``stalls``, ``scope`` and ``policy`` import none of one another."""
