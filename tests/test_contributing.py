"""CONTRIBUTING.md stays true to the tree, and the README's configuration table to the rule table.

- every path CONTRIBUTING.md names under ``vllm_mamba_fix/``, ``tools/`` or ``tests/`` (and
  every ``tools.<module>`` it runs) exists;
- its Layout names every module of ``vllm_mamba_fix/`` (``__init__``/``__main__`` aside) once,
  and every folder of it;
- every rule of the table has a module under ``vllm_mamba_fix/rules/`` that opens with its
  header (what it answers, where it runs, how it is decided, what removes it);
- every module of the package stays under 400 lines;
- the README's configuration table has a row for every rule's switch (``rules.RULES``).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from vllm_mamba_fix.rules.table import RULES

REPO = Path(__file__).resolve().parent.parent
CONTRIBUTING = REPO / "CONTRIBUTING.md"
README = REPO / "README.md"
PACKAGE = REPO / "vllm_mamba_fix"
LAYOUT_HEADING = "## Layout"
CONFIG_HEADING = "## Configuration"

# A path in the tree: starts a word, runs over path characters, ends before punctuation.
_PATH = re.compile(r"(?<![\w./-])((?:vllm_mamba_fix|tools|tests)/[\w./-]*)")
# A module run or named by its dotted name: `python -m tools.matrix`, `tools.matrix.CI_MODES`.
_DOTTED = re.compile(r"(?<![\w./-])tools\.(\w+)")


def _section(text: str, heading: str) -> str:
    lines = text.splitlines()
    assert heading in lines, f"no {heading!r} section"
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def named_paths(text: str) -> set[str]:
    return {match.rstrip(".") for match in _PATH.findall(text)}


def test_every_path_contributing_names_exists() -> None:
    text = CONTRIBUTING.read_text()
    paths = named_paths(text)
    assert any(p.startswith("vllm_mamba_fix/") for p in paths)  # the pattern finds paths
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"CONTRIBUTING.md names paths that do not exist: {missing}"
    modules = set(_DOTTED.findall(text))
    assert "matrix" in modules
    gone = sorted(m for m in modules if not (REPO / "tools" / f"{m}.py").exists())
    assert not gone, f"CONTRIBUTING.md runs tools modules that do not exist: {gone}"


def package_modules() -> list[str]:
    return sorted(
        path.relative_to(REPO).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.stem not in ("__init__", "__main__") and "__pycache__" not in path.parts
    )


def test_the_layout_names_every_module_once() -> None:
    layout = _section(CONTRIBUTING.read_text(), LAYOUT_HEADING)
    named = re.findall(r"(?<![\w./-])(vllm_mamba_fix/[\w/]+\.py)", layout)
    modules = package_modules()
    assert len(modules) > 20  # the walk found the package
    unnamed = [m for m in modules if m not in named]
    assert not unnamed, f"CONTRIBUTING.md's Layout does not name {unnamed}"
    twice = sorted({m for m in named if named.count(m) > 1})
    assert not twice, f"CONTRIBUTING.md's Layout names these more than once: {twice}"


def test_the_layout_names_every_folder() -> None:
    layout = _section(CONTRIBUTING.read_text(), LAYOUT_HEADING)
    folders = sorted(
        init.parent.relative_to(REPO).as_posix() + "/"
        for init in PACKAGE.rglob("__init__.py")
        if init.parent != PACKAGE
    )
    assert "vllm_mamba_fix/rules/" in folders
    unnamed = [f for f in folders if f not in layout]
    assert not unnamed, f"CONTRIBUTING.md's Layout does not name the folders {unnamed}"


def test_every_package_module_stays_under_400_lines() -> None:
    sizes = {m: len((REPO / m).read_text().splitlines()) for m in package_modules()}
    large = {m: n for m, n in sizes.items() if n >= 400}
    assert not large, f"split these modules (at most 399 lines each): {large}"


HEADER_FIELDS = ("# Rule:", "# Answers:", "# Runs on:", "# Decided:", "# Removed:")


def opening_comments(path: Path) -> str:
    """The comment block a module opens with (its header), before its docstring."""
    lines = path.read_text().splitlines()
    return "\n".join(itertools.takewhile(lambda line: line.startswith("#"), lines))


def test_every_rule_has_a_module_that_opens_with_its_header() -> None:
    headers = {p.name: opening_comments(p) for p in sorted((PACKAGE / "rules").glob("*.py"))}
    for spec in RULES:
        rule = re.escape(spec.rule.value)
        owners = [n for n, h in headers.items() if re.match(rf"# Rule:\s+{rule}\b", h)]
        assert len(owners) == 1, f"no one module under rules/ opens with the header of {rule}"
        missing = [f for f in HEADER_FIELDS if f"\n{f}" not in "\n" + headers[owners[0]]]
        assert not missing, f"rules/{owners[0]}'s header lacks {missing}"


def config_rows(readme: str) -> set[str]:
    """The variables the README's configuration table has a row for."""
    rows = [line for line in _section(readme, CONFIG_HEADING).splitlines() if line.startswith("|")]
    names = set()
    for row in rows[2:]:  # after the header and its rule
        first = row.strip().strip("|").split("|")[0]
        names.update(re.findall(r"`([^`]+)`", first))
    return names


def test_the_configuration_table_has_every_rule_switch() -> None:
    rows = config_rows(README.read_text())
    switches = {spec.switch for spec in RULES}
    assert len(switches) >= 4  # each rule names its switch
    missing = sorted(switches - rows)
    assert not missing, f"the README's configuration table has no row for {missing}"
