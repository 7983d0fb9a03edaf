"""The documentation stays true: links resolve, the README's configuration table is
config.py's, the README stays a front door, and pyproject's description is its summary."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vllm_mamba_fix.facts import config

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOC_FILES = sorted([README, REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md")])
README_MAX_LINES = 220
CONFIG_HEADING = "## Configuration"

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def _prose(text: str) -> str:
    """Markdown without code, where a bracket is not a link."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped,
    spaces to hyphens (hyphens and underscores kept)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        slug = github_slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(path.read_text())) if not _EXTERNAL.match(t)]


def test_slugs_follow_github() -> None:
    assert github_slug("Schedulers and platform plugins") == "schedulers-and-platform-plugins"
    assert github_slug("The evidence policy: the code decides") == (
        "the-evidence-policy-the-code-decides"
    )
    assert github_slug("`vllm-mamba-fix doctor`") == "vllm-mamba-fix-doctor"
    assert github_slug("CI and its cost") == "ci-and-its-cost"


def test_the_pages_exist() -> None:
    names = {p.name for p in DOC_FILES}
    for page in (
        "how-it-works.md",
        "compatibility.md",
        "doctor.md",
        "reliability.md",
        "benchmarks.md",
        "deployment.md",
        "extending.md",
    ):
        assert page in names


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path: Path) -> None:
    broken: list[str] = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{path.name}: " + "; ".join(broken)


# A path in backticks: the repo's own folders; a module in backticks: the package's.
_REPO_PATH = re.compile(
    r"`((?:vllm_mamba_fix|tests|tools|benchmarks|examples|docs|\.ci)/[\w./-]+)`"
)
_MODULE = re.compile(r"`(vllm_mamba_fix(?:\.\w+)+)")
GENERATED = ("benchmarks/results/",)  # written by the benchmarks, ignored by git


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_docs_cite_only_files_that_exist(path: Path) -> None:
    missing = [
        cited
        for cited in (m.rstrip(".") for m in _REPO_PATH.findall(path.read_text()))
        if not cited.startswith(GENERATED) and not (REPO / cited).exists()
    ]
    assert not missing, f"{path.name} cites files that do not exist: {missing}"


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_docs_cite_only_modules_and_names_that_exist(path: Path) -> None:
    """``vllm_mamba_fix.a.b.name``: the longest module prefix exists, and has the rest."""
    import importlib

    missing = []
    for dotted in _MODULE.findall(path.read_text()):
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):
            base = REPO.joinpath(*parts[:i])
            if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
                break
        target: object = importlib.import_module(".".join(parts[:i]))
        for name in parts[i:]:
            target = getattr(target, name, None)
            if target is None:
                missing.append(dotted)
                break
    assert not missing, f"{path.name} cites modules or names that do not exist: {missing}"


def test_every_docs_page_says_whom_it_is_for() -> None:
    for path in DOC_FILES:
        if path == README:
            continue
        paragraphs = [p for p in path.read_text().split("\n\n") if p.strip()]
        first = paragraphs[1].strip()  # after the title
        assert first.startswith("For "), f"{path.name} opens with {first[:60]!r}"


def test_the_compatibility_table_lives_in_docs() -> None:
    from tools import matrix

    assert matrix.COMPATIBILITY_DOC == REPO / "docs" / "compatibility.md"
    text = matrix.COMPATIBILITY_DOC.read_text()
    assert text.count(matrix.README_START) == 1 and text.count(matrix.README_END) == 1
    assert "Generated by `python -m tools.matrix" in text
    assert matrix.README_START not in README.read_text()
    assert "docs/compatibility.md" in README.read_text()


# --------------------------------------------------------------------------
# The README's configuration table against config.py


@dataclass
class Variable:
    name: str
    default: str
    rows: list[list[str]] = field(default_factory=list)  # code values of each row


def _code(cell: str) -> list[str]:
    return [v.strip() for v in re.findall(r"`([^`]+)`", cell)]


def config_table() -> dict[str, Variable]:
    text = README.read_text()
    assert CONFIG_HEADING in text.splitlines(), f"README has no {CONFIG_HEADING!r} section"
    section = text.split(f"\n{CONFIG_HEADING}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    assert header[:3] == ["Variable", "Values", "Default"], header
    variables: dict[str, Variable] = {}
    current: Variable | None = None
    for line in rows[2:]:  # after the header and its rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name, values, default = cells[0], cells[1], cells[2]
        if name:
            (var_name,) = _code(name)
            defaults = _code(default)
            current = Variable(var_name, defaults[0] if defaults else default)
            variables[var_name] = current
        elif default:
            pytest.fail(f"a continuation row of {current and current.name} has a default")
        assert current is not None, "the table starts with a continuation row"
        current.rows.append(_code(values))
    return variables


def test_the_table_lists_every_variable_config_reads() -> None:
    read_by_config = {value for name, value in vars(config).items() if name.startswith("ENV_")}
    assert set(config_table()) == read_by_config


def test_mode_values_and_default_match_config() -> None:
    row = config_table()[config.ENV_MODE]
    listed = [v for values in row.rows for v in values]
    assert sorted(listed) == sorted(config._MODE_VALUES)
    for values in row.rows:  # the values of one row mean one mode
        modes = {config.load_settings({config.ENV_MODE: v}).mode for v in values}
        assert len(modes) == 1, f"{values} mean {modes}"
    assert config.load_settings({config.ENV_MODE: row.default}).mode == config.Settings().mode
    assert config.load_settings({}).mode == config.Settings().mode


def test_scope_values_and_default_match_config() -> None:
    row = config_table()[config.ENV_SCOPE]
    listed = [v for values in row.rows for v in values]
    assert sorted(listed) == sorted(scope.value for scope in config.Scope)
    assert row.default == config.load_settings({}).scope.value


def test_stall_seconds_values_and_default_match_config() -> None:
    row = config_table()[config.ENV_STALL_SECONDS]
    words = [v for values in row.rows for v in values]
    assert words == ["off"], "only 'off' is a word; the other row is a number of seconds"
    assert config.load_settings({config.ENV_STALL_SECONDS: "off"}).stall_seconds is None
    assert float(row.default) == config.DEFAULT_STALL_SECONDS
    assert config.load_settings({}).stall_seconds == float(row.default)
    numbers = config.load_settings({config.ENV_STALL_SECONDS: "0"})
    assert numbers.stall_seconds == 0 and not numbers.problems  # "0 or more" holds at 0
    assert config.load_settings({config.ENV_STALL_SECONDS: "-1"}).problems


def test_the_bounds_the_docs_justify_are_configs_defaults() -> None:
    """The reliability page argues for the two defaults; its figures must be the code's."""
    text = (REPO / "docs" / "reliability.md").read_text()
    stated = re.search(rf"`{config.ENV_END_STALLS_AFTER}` defaults to (\d+) s", text)
    assert stated, "docs/reliability.md no longer states the end's default"
    assert float(stated.group(1)) == config.DEFAULT_END_STALLS_AFTER
    assert f"`{config.ENV_STALL_SECONDS}` ({config.DEFAULT_STALL_SECONDS:g} s)" in text
    assert float(config_table()[config.ENV_END_STALLS_AFTER].default) == (
        config.DEFAULT_END_STALLS_AFTER
    )


def test_vllm_plugins_row_names_the_plugin() -> None:
    row = config_table()[config.ENV_VLLM_PLUGINS]
    assert row.default == "unset"
    assert f"`{config.PLUGIN_NAME}`" in README.read_text().split(CONFIG_HEADING, 1)[1]


# --------------------------------------------------------------------------
# The front door


def test_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def readme_summary() -> str:
    """The README's one-line summary: its first paragraph after the title."""
    paragraphs = [p.strip() for p in README.read_text().split("\n\n") if p.strip()]
    assert paragraphs[0].startswith("# ")
    return " ".join(paragraphs[1].split())


def test_pyproject_description_is_the_readme_summary() -> None:
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is in the standard library from Python 3.11")
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["description"] == readme_summary()


# --------------------------------------------------------------------------
# Generated tables describe this release (issue 22 item 5)

_GENERATED_BY = re.compile(
    r"vllm-mamba-fix (?P<version>\d+\.\d+\.\d+[^\s;,]*)[;,]? .*?(?P<date>\d{4}-\d{2}-\d{2})"
    r"|(?P<date2>\d{4}-\d{2}-\d{2}).*?vllm-mamba-fix (?P<version2>\d+\.\d+\.\d+[^\s;,]*)"
)


def _generated_tables() -> dict[str, str]:
    """Each generated table's first line: the one that names the run that made it."""
    from tools import matrix

    compat = matrix.COMPATIBILITY_DOC.read_text()
    inside = compat.split(matrix.README_START, 1)[1].split(matrix.README_END, 1)[0]
    bench = (REPO / "docs" / "benchmarks.md").read_text()
    latest = bench.split("## Latest results", 1)[1]
    return {
        "docs/compatibility.md": next(ln for ln in inside.splitlines() if ln.strip()),
        "docs/benchmarks.md": next(
            ln for ln in latest.splitlines() if ln.startswith("Benchmarks:")
        ),
    }


def named_version_and_date(line: str) -> tuple[str, str] | None:
    match = _GENERATED_BY.search(line)
    if not match:
        return None
    return (match["version"] or match["version2"]), (match["date"] or match["date2"])


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def test_named_version_and_date_reads_both_table_lines() -> None:
    matrix_line = ("Generated by `python -m tools.matrix --readme` with vllm-mamba-fix 0.4.0 on "
                   "2026-12-02 (20 releases; 100 release/mode cells run now).")  # fmt: skip
    bench_line = ("Benchmarks: `python -m benchmarks.run --profile full`, 2026-12-02 17:01 UTC, "
                  "Linux x86_64; vLLM 0.27.1, vllm-mamba-fix 0.4.0; load 2.1")  # fmt: skip
    assert named_version_and_date(matrix_line) == ("0.4.0", "2026-12-02")
    assert named_version_and_date(bench_line) == ("0.4.0", "2026-12-02")
    assert named_version_and_date("Generated by `python -m tools.matrix` on a day") is None


@pytest.mark.parametrize("doc", ["docs/compatibility.md", "docs/benchmarks.md"])
def test_generated_tables_name_this_minor_and_a_date(doc: str) -> None:
    import vllm_mamba_fix

    line = _generated_tables()[doc]
    named = named_version_and_date(line)
    assert named, f"{doc}: the generated table names no package version and date: {line!r}"
    version, _date = named
    assert _minor(version) >= _minor(vllm_mamba_fix.__version__), (
        f"{doc}'s table comes from vllm-mamba-fix {version}, older than "
        f"{vllm_mamba_fix.__version__}'s minor: regenerate it "
        "(CONTRIBUTING: regenerating the tables)"
    )
