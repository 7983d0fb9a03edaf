"""The active line's shape, parsed in one place for every test that reads it (issue 45 item 3).

``vllm-mamba-fix <version> active: <class> carries <rule>, <rule> (inherited), ...
[block <N>[ (cache_config <M>)]; split rules idle; <setting>=<value>, ...] (vLLM <version>,
pid <N>)``. The reasons are not on it: they are in the DEBUG line, doctor and the log fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ACTIVE = re.compile(
    r"vllm-mamba-fix (?P<version>\S+) active: (?P<cls>\S+) carries (?P<rules>[^\[]*) "
    r"\[(?P<notes>[^\]]*)\] \(vLLM (?P<vllm>\S+), pid (?P<pid>\d+)\)"
)
BLOCK = re.compile(
    r"block (?P<block>\d+|none|unknown)(?: \((?:cache_config (?P<configured>\d+)|dry run)\))?"
)


@dataclass(frozen=True)
class ActiveLine:
    version: str
    scheduler_class: str
    rules: tuple[str, ...]  # in the line's order
    inherited: tuple[str, ...]
    block: int | None  # None: no Mamba block, or a dry run's unknown
    configured_block: int | None  # only where it differs
    notes: tuple[str, ...]  # besides the block and the settings: "split rules idle"
    settings: dict[str, str] = field(default_factory=dict)
    vllm: str = ""
    pid: int = 0


def parse_active(line: str) -> ActiveLine | None:
    """The active line's parts, or None where ``line`` is not one (anywhere in the text)."""
    found = ACTIVE.search(line)
    if found is None:
        return None
    carried = [r.strip() for r in found["rules"].split(",")]
    inherited = tuple(r.removesuffix(" (inherited)") for r in carried if r.endswith("(inherited)"))
    rules = tuple(r.removesuffix(" (inherited)") for r in carried)
    first, *rest = found["notes"].split("; ")
    block = BLOCK.fullmatch(first)
    assert block is not None, line
    settings: dict[str, str] = {}
    notes = []
    for note in rest:
        if "=" in note:
            settings.update(pair.split("=", 1) for pair in note.split(", "))
        else:
            notes.append(note)
    return ActiveLine(
        found["version"], found["cls"], rules, inherited,
        int(block["block"]) if block["block"].isdigit() else None,
        int(block["configured"]) if block["configured"] else None,
        tuple(notes), settings, found["vllm"], int(found["pid"]),
    )  # fmt: skip


def active_lines(messages: list[str], scheduler_class: str | None = None) -> list[ActiveLine]:
    """The active lines among ``messages`` (of ``scheduler_class`` only, if given)."""
    parsed = [p for p in map(parse_active, messages) if p is not None]
    return [p for p in parsed if scheduler_class in (None, p.scheduler_class)]
