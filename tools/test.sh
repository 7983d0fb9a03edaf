#!/usr/bin/env bash
# The project's test command: builds the environment, lints, runs the suite on
# vLLM 0.27.1, then the scheduler suite on one release per family.
#   tools/test.sh                 everything CI runs
#   tools/test.sh -m "not e2e"    extra arguments go to the main pytest run
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
venv=$(tools/env.sh)
py=$venv/bin/python

"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .

run_pytest() {
  local status=0
  "$py" -m pytest "$@" || status=$?
  if [[ $status == 5 ]]; then
    echo "test: pytest collected no tests for: $*; that is a broken suite, not a pass" >&2
    return 1
  fi
  return "$status"
}

run_pytest -p no:cacheprovider "$@"
"$py" -m tools.matrix --ci
