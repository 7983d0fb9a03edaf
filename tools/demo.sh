#!/usr/bin/env bash
# The README's main command: set up .venv, then show the hang and the fix
#   1. on the real vLLM scheduler (seconds), stock against patched;
#   2. on the real engine with a tiny random-weight Qwen3.5-style VL model (CPU),
#      patched, then stock (VLLM_MAMBA_FIX=0) with a watchdog that names the hang.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=$(tools/env.sh)
py=$venv/bin/python

echo "== 1/3 real scheduler: stock against patched"
"$py" -m tools.sched_demo 2> >(grep -v -E "^(INFO|WARNING|DEBUG) " >&2)
echo
echo "== 2/3 real engine, plugin active (default)"
"$py" -m tools.engine_demo
echo
echo "== 3/3 real engine, stock (VLLM_MAMBA_FIX=0): expect the hang, caught by the watchdog"
VLLM_MAMBA_FIX=0 "$py" -m tools.engine_demo
