"""Checks of the built artefacts: what the wheel and the sdist contain, and the installed wheel.

    python -m tools.artefacts contents DIST_DIR      # in the project venv, after `python -m build`
    python -m tools.artefacts installed              # in a venv where the wheel is installed

``tools/artefacts.sh`` builds, runs ``twine check``, installs the wheel into its own venv
and runs both. Each check prints one ``ok:`` or ``FAIL:`` line; the exit code is the number
of failures (capped at 1). ``installed`` must run where the package comes from the wheel,
not from the source tree: only the ``tools`` package may come from the checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

DIST_NAME = "vllm-mamba-fix"
PACKAGE = "vllm_mamba_fix"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "mamba_fix"
ENTRY_POINT_VALUE = "vllm_mamba_fix:register"
REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 900  # seconds per subprocess: each imports vLLM on a possibly busy machine

# sdist members that are not tracked files: setuptools writes them.
SDIST_GENERATED = {"PKG-INFO", "setup.cfg"}


@dataclass
class Checks:
    failures: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        line = f"{what}: {detail}" if detail else what
        print(f"  {'ok' if ok else 'FAIL'}: {line}", flush=True)
        if not ok:
            self.failures.append(line)
        return ok


# ----------------------------------------------------------------------------- contents


def tracked_files(root: Path = REPO) -> list[str] | None:
    """The repository's tracked files, or None outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z"],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sorted(p for p in out.decode().split("\0") if p and (root / p).is_file())


def sdist_members(sdist: Path) -> dict[str, int]:
    """Paths inside the sdist (without the top folder) -> mode bits, files only."""
    with tarfile.open(sdist) as tar:
        return {
            m.name.split("/", 1)[1]: m.mode
            for m in tar.getmembers()
            if m.isfile() and "/" in m.name
        }


def check_sdist(sdist: Path, checks: Checks, root: Path = REPO) -> None:
    members = sdist_members(sdist)
    checks.check("LICENSE" in members, "sdist carries LICENSE", sdist.name)
    checks.check(f"{PACKAGE}/py.typed" in members, "sdist carries py.typed")
    tracked = tracked_files(root)
    if tracked is None:
        checks.check(True, "sdist completeness", "skipped: not a git checkout")
        return
    missing = [p for p in tracked if p not in members]
    checks.check(
        not missing,
        "sdist carries every tracked file (the suite runs from it)",
        f"{len(tracked)} tracked" if not missing else f"missing {missing[:10]}",
    )
    not_exec = [
        p
        for p in tracked
        if os.access(root / p, os.X_OK) and p in members and not members[p] & 0o100
    ]
    checks.check(not not_exec, "sdist keeps the scripts executable", ", ".join(not_exec))
    stray = [
        p
        for p in members
        if p not in tracked
        and p not in SDIST_GENERATED
        and not p.startswith(f"{PACKAGE}.egg-info/")
        and (p.endswith((".pyc", ".pyo")) or "/__pycache__/" in p or p.startswith(".cache/"))
    ]
    checks.check(not stray, "sdist carries no caches", ", ".join(stray[:10]))


def check_wheel(wheel: Path, checks: Checks, version: str, root: Path = REPO) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = f"{PACKAGE}-{version}.dist-info"
        checks.check(f"{info}/licenses/LICENSE" in names, "wheel carries LICENSE", wheel.name)
        checks.check(f"{PACKAGE}/py.typed" in names, "wheel carries py.typed")
        tracked = tracked_files(root)
        if tracked is None:  # an unpacked sdist: every file there is the package's
            tracked = [p.relative_to(root).as_posix() for p in (root / PACKAGE).rglob("*.py")]
        modules = {p for p in tracked if p.startswith(f"{PACKAGE}/") and p.endswith(".py")}
        missing = ", ".join(sorted(modules - names))
        checks.check(not missing, "wheel carries every module, subpackages included", missing)
        outside = sorted({n.split("/", 1)[0] for n in names} - {PACKAGE, info})
        checks.check(not outside, "wheel holds only the package", ", ".join(outside))
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
        checks.check(
            f"[{PLUGIN_GROUP}]\n{PLUGIN_NAME} = {ENTRY_POINT_VALUE}" in entry_points,
            "wheel declares the vLLM entry point",
            f"{PLUGIN_NAME} = {ENTRY_POINT_VALUE}",
        )
        metadata = zf.read(f"{info}/METADATA").decode()
        checks.check(f"\nVersion: {version}\n" in metadata, "wheel version", version)
        checks.check(
            "\nLicense-Expression: Apache-2.0\n" in metadata, "wheel license", "Apache-2.0"
        )
        checks.check("Classifier: Typing :: Typed" in metadata, "wheel classifier Typing :: Typed")
        checks.check("Project-URL: Source, " in metadata, "wheel project URLs")


def source_version(root: Path = REPO) -> str:
    """``__version__`` as written in the source tree, without importing the package."""
    for line in (root / PACKAGE / "_version.py").read_text().splitlines():
        if line.startswith("__version__ = "):
            return line.split("=", 1)[1].strip().strip("\"'")
    raise ValueError(f"no __version__ line in {root / PACKAGE / '_version.py'}")


def contents(dist_dir: Path) -> Checks:
    checks = Checks()
    version = source_version()
    wheels = sorted(dist_dir.glob("*.whl"))
    sdists = sorted(dist_dir.glob("*.tar.gz"))
    if not checks.check(len(wheels) == 1 and len(sdists) == 1, "one wheel and one sdist"):
        return checks
    checks.check(
        wheels[0].name == f"{PACKAGE}-{version}-py3-none-any.whl",
        "wheel name carries the source version",
        wheels[0].name,
    )
    check_wheel(wheels[0], checks, version)
    check_sdist(sdists[0], checks)
    return checks


# ----------------------------------------------------------------------------- installed


def _inside(path: str | os.PathLike[str], parent: str | os.PathLike[str]) -> bool:
    return Path(path).resolve().is_relative_to(Path(parent).resolve())


class _Job:
    """A subprocess started now and collected later, with its output and wall time."""

    def __init__(self, cmd: list[str], **kwargs: object) -> None:
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
        )

    def wait(self) -> tuple[int, str, str, float]:
        try:
            out, err = self.proc.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            err += f"\n(killed after {TIMEOUT} s)"
        return self.proc.returncode, out, err, time.monotonic() - self.start


def installed() -> Checks:
    """Run in the wheel's venv: metadata, vLLM's own plugin loading, doctor, the reproduction."""
    import importlib.metadata as md

    checks = Checks()
    purelib = sysconfig.get_paths()["purelib"]
    print(f"  python {sys.executable}, site-packages {purelib}", flush=True)

    # 1. Metadata, before anything imports the package.
    checks.check(PACKAGE not in sys.modules, "package not imported before vLLM loads it")
    dists = [d for d in md.distributions() if (d.metadata["Name"] or "").lower() == DIST_NAME]
    where = [str(d.locate_file("")) for d in dists]
    if not checks.check(len(dists) == 1, f"one {DIST_NAME} distribution visible", str(where)):
        return checks
    (dist,) = dists
    checks.check(_inside(where[0], purelib), "it is installed in this venv", where[0])
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    checks.check(
        not direct_url.get("dir_info", {}).get("editable", False), "not an editable install"
    )
    files = {str(f) for f in dist.files or []}
    checks.check(f"{PACKAGE}/py.typed" in files, "py.typed installed")
    checks.check(any(f.endswith("licenses/LICENSE") for f in files), "LICENSE installed")
    eps = md.entry_points(group=PLUGIN_GROUP, name=PLUGIN_NAME)
    owners = [str(ep.dist.locate_file("")) if ep.dist else None for ep in eps]
    checks.check(
        len(owners) == 1 and owners[0] is not None and _inside(owners[0], purelib),
        f"the only {PLUGIN_GROUP}:{PLUGIN_NAME} entry point is the wheel's",
        str(owners),
    )

    # 2. vLLM loads the plugin the engine's way; the scheduler import applies the patch.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the checks
    import vllm
    import vllm.plugins

    # Record which plugins vLLM's own loader returns, by name, on the way through.
    loaded_by_name: dict[str, object] = {}
    by_group = vllm.plugins.load_plugins_by_group

    def recording(group: str) -> dict:
        plugins = by_group(group)
        if group == PLUGIN_GROUP:
            loaded_by_name.update(plugins)
        return plugins

    vllm.plugins.load_plugins_by_group = recording
    try:
        vllm.plugins.load_general_plugins()
    finally:
        vllm.plugins.load_plugins_by_group = by_group
    module = sys.modules.get(PACKAGE)
    checks.check(
        module is not None and loaded_by_name.get(PLUGIN_NAME) is getattr(module, "register", 0),
        f"load_general_plugins() loaded {PLUGIN_NAME!r} -> {ENTRY_POINT_VALUE}",
        f"plugins loaded: {sorted(loaded_by_name)}",
    )
    loaded = getattr(module, "__file__", None) or "(not imported)"
    checks.check(
        module is not None and _inside(loaded, purelib),
        "load_general_plugins() imported the package from the wheel",
        loaded,
    )
    if module is not None:
        checks.check(
            module.__version__ == dist.version,
            "__version__ agrees with the installed metadata",
            f"{module.__version__} / {dist.version}",
        )
    from vllm.v1.core.sched.scheduler import Scheduler

    fn = Scheduler.__dict__.get("_mamba_block_aligned_split")
    wrapped = fn is not None and getattr(fn, "__wrapped__", None) is not None
    code_file = getattr(getattr(fn, "__code__", None), "co_filename", "?")
    checks.check(
        wrapped and _inside(code_file, purelib),
        f"vLLM {vllm.__version__}: Scheduler._mamba_block_aligned_split patched by the wheel",
        code_file,
    )

    # 3 and 4, side by side (each imports vLLM): doctor through the wheel's console script
    # without the checkout on the path, and the scheduler reproduction (tools/ from the
    # checkout, the package from the wheel).
    script = Path(sys.executable).with_name("vllm-mamba-fix")
    if not checks.check(script.exists(), "console script installed", str(script)):
        return checks
    no_checkout = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    doctor = _Job([str(script), "doctor", "--json"], env=no_checkout, cwd=script.parent)
    demo = _Job([sys.executable, "-m", "tools.sched_demo"])

    code, out, err, seconds = doctor.wait()
    try:
        report = json.loads(out)
    except ValueError:
        report = {}
    status = report.get("status")
    ok = checks.check(
        code == 0 and status == "protected",
        "vllm-mamba-fix doctor --json: protected, exit 0",
        f"exit {code}, status {status}, {seconds:.0f} s; {report.get('summary')!r}",
    )
    if not ok:
        lines = [*report.get("problems", []), *report.get("warnings", [])] if report else []
        print("\n".join(lines) or out[-3000:] + err[-3000:], file=sys.stderr)

    code, out, err, seconds = demo.wait()
    origin = next((ln for ln in out.splitlines() if ln.startswith("plugin: ")), "no plugin line")
    verdict = next((ln for ln in out.splitlines() if ln.startswith("verdict: ")), "no verdict")
    ok = checks.check(
        code == 0 and "patched completes" in verdict,
        "python -m tools.sched_demo completes with the plugin",
        f"exit {code}, {seconds:.0f} s; {verdict}",
    )
    ok &= checks.check(purelib in origin, "the reproduction ran the wheel's plugin", origin)
    if not ok:
        print(out[-3000:] + err[-3000:], file=sys.stderr)
    return checks


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("contents").add_argument("dist_dir", type=Path)
    sub.add_parser("installed")
    args = parser.parse_args(argv)
    checks = contents(args.dist_dir) if args.command == "contents" else installed()
    if checks.failures:
        print(f"artefacts: {len(checks.failures)} check(s) failed:", file=sys.stderr)
        for failure in checks.failures:
            print(f"  - {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
