#!/usr/bin/env bash
# Run the scheduler-level suite against vLLM releases; see tools/matrix.py.
#   tools/matrix.sh --ci            one release per family (CI)
#   tools/matrix.sh                 latest patch of every minor 0.15 ... 0.33
#   tools/matrix.sh 0.19.1 0.25.1   chosen releases
#   tools/matrix.sh --readme        and refresh the table in docs/compatibility.md
#   tools/matrix.sh --fresh         ignore the per-cell cache (a re-run resumes by default:
#                                   only cells not cached under their content key run)
# Runs in the project environment (tools/env.sh builds it on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(tools/env.sh)
exec "$venv/bin/python" -m tools.matrix "$@"
