#!/usr/bin/env bash
# The README's main command: set up .venv, then show the hang and the fix
#   1. on the real vLLM scheduler (seconds), stock against patched;
#   2. on the real engine with a tiny random-weight Qwen3.5-style VL model (CPU),
#      patched, then stock (VLLM_MAMBA_FIX=0) with a watchdog that names the hang.
# The terminal shows the verdicts and chunk lists; vLLM's own lines (it logs to stdout) go
# to log files under one folder, printed first, and a failing step shows its log's tail.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=$(tools/env.sh)
py=$venv/bin/python
logs=$(mktemp -d "${TMPDIR:-/tmp}/vllm-mamba-fix-demo.XXXXXX")
echo "vLLM's own log lines go to $logs/"

# step LOG CMD...: CMD's stdout here, its stderr to LOG; on failure, LOG's last lines, then stop.
step() {
  local log=$1 status=0
  shift
  "$@" 2>"$log" || status=$?
  if ((status != 0)); then
    echo "demo: failed with exit code $status; the last lines of $log:"
    tail -n 40 "$log"
    exit "$status"
  fi
}

echo
echo "== 1/3 real scheduler: stock against patched"
# vLLM's log to stderr, that is to the log file (sched_demo does this itself too).
VLLM_LOGGING_STREAM=ext://sys.stderr step "$logs/scheduler.log" "$py" -m tools.sched_demo
echo
echo "== 2/3 real engine, plugin active (default)"
# engine_demo keeps vLLM's lines in <workdir>/worker.log and prints its tail on failure.
step "$logs/engine-patched.stderr.log" \
  "$py" -m tools.engine_demo --workdir "$logs/engine-patched"
echo
echo "== 3/3 real engine, stock (VLLM_MAMBA_FIX=0): expect the hang, caught by the watchdog"
VLLM_MAMBA_FIX=0 step "$logs/engine-stock.stderr.log" \
  "$py" -m tools.engine_demo --workdir "$logs/engine-stock"
echo
echo "demo: done; vLLM's log lines are in $logs/"
