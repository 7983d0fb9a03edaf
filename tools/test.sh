#!/usr/bin/env bash
# The project's test command: builds the environment, lints, checks the built wheel and
# sdist (tools/artefacts.sh), runs the suite on vLLM 0.27.1, then the scheduler suite on
# one release per family (tools/releases.py CI_MODES: every mode on 0.27.1, sync elsewhere,
# plus sync+mtp2 on 0.28.0). Ends with one line of phase times, also when a phase fails.
#   tools/test.sh                 everything CI runs (.ci/run execs it)
#   tools/test.sh -m "not e2e"    extra arguments go to the main pytest run
#   VLLM_MAMBA_FIX_SKIP_ARTEFACTS=1 tools/test.sh    without the artefact step (local runs)
# Exhaustive scheduler-suite runs are not part of CI (hours on 2 cores); run them by hand:
#   python -m tools.matrix                     every mode on 20 releases (0.15.0 + each minor's last)
#   python -m tools.matrix --all               every published release
#   python -m tools.matrix 0.24.0 --modes sync,async+mtp2 -j 1    chosen releases and modes
#   python -m tools.matrix --readme            also regenerate docs/compatibility.md
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

phase_names=()
phase_seconds=()
phase_now=""
phase_started=$SECONDS

# Close the running phase (if any) and start the one named (none if empty).
phase() {
  if [[ -n $phase_now ]]; then
    phase_names+=("$phase_now")
    phase_seconds+=($((SECONDS - phase_started)))
  fi
  phase_now=$1
  phase_started=$SECONDS
}

print_phase_times() {
  local status=$? failed=$phase_now summary="" i
  phase ""
  for i in "${!phase_names[@]}"; do
    summary+="${summary:+, }${phase_names[$i]} ${phase_seconds[$i]}s"
  done
  summary+="${summary:+, }total ${SECONDS}s"
  if [[ $status != 0 && -n $failed ]]; then
    summary+=" (failed in $failed, exit $status)"
  fi
  echo "test: phase times: $summary" >&2
}
trap print_phase_times EXIT

phase env
venv=$(tools/env.sh)
py=$venv/bin/python

phase lint
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
# ruff holds the package's complexity (C901, PLR0912, PLR0915); this, its functions' length.
"$py" -m tools.function_length
# The import contracts in pyproject.toml: the layers (every module in one, none importing a
# higher one), no vLLM in facts and decisions, observers plugged in rather than imported.
"$venv/bin/lint-imports" --no-cache >/dev/null || "$venv/bin/lint-imports" --no-cache

# The wheel as users install it: built, twine-checked, installed (not editable) into its own
# venv, where vLLM must load the plugin from it and be patched. One to three minutes.
if [[ ${VLLM_MAMBA_FIX_SKIP_ARTEFACTS:-0} == 1 ]]; then
  echo "test: skipping the built-artefact check (VLLM_MAMBA_FIX_SKIP_ARTEFACTS=1)" >&2
else
  phase artefacts
  VLLM_MAMBA_FIX_PYTHON=$py tools/artefacts.sh
fi

run_pytest() {
  local status=0
  "$py" -m pytest "$@" || status=$?
  if [[ $status == 5 ]]; then
    echo "test: pytest collected no tests for: $*; that is a broken suite, not a pass" >&2
    return 1
  fi
  return "$status"
}

phase pytest
run_pytest -p no:cacheprovider "$@"
phase matrix
"$py" -m tools.matrix --ci
