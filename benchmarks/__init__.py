"""Benchmarks of vllm-mamba-fix (issue 7): ``python -m benchmarks.run --profile smoke|full``."""
