"""One check per module; each fills in its part of the doctor's ``Report``.

A check may import the doctor's report and verdict, and every layer below doctor; none
imports ``install/plugin.py`` (:mod:`vllm_mamba_fix.doctor.core` hands it over).
"""
