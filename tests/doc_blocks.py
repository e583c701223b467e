"""The checked parts of a Markdown page: each fenced code block or table preceded by a marker line
`<!-- check: KIND [ARGS...] -->` (invisible once rendered), so a test can run or validate it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MARKER = re.compile(r"^<!-- check: (\S+)((?: \S+)*) -->$")
FENCE = "```"


@dataclass(frozen=True)
class Block:
    kind: str
    args: tuple[str, ...]
    text: str  # the code block's content, or the table's lines
    line: int  # where it starts in the page (1-based), for messages


def blocks(page: Path) -> list[Block]:
    """Every marked block of `page`, in page order."""
    lines = page.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        match = MARKER.match(line)
        if not match:
            continue
        start = i + 1
        if lines[start].startswith(FENCE):
            end = next(j for j in range(start + 1, len(lines)) if lines[j].startswith(FENCE))
            text = "\n".join(lines[start + 1 : end]) + "\n"
        elif lines[start].startswith("|"):
            end = next((j for j in range(start, len(lines)) if not lines[j].startswith("|")), len(lines))
            text = "\n".join(lines[start:end]) + "\n"
        else:
            raise AssertionError(f"{page}:{i + 1}: a check marker must be followed by a code block or a table")
        found.append(Block(match.group(1), tuple(match.group(2).split()), text, start + 1))
    return found


def unmarked_code_blocks(page: Path) -> list[int]:
    """The lines where a fenced code block starts without a marker before it."""
    lines = page.read_text().splitlines()
    opening, unmarked = True, []
    for i, line in enumerate(lines):
        if line.startswith(FENCE):
            if opening and not (i and MARKER.match(lines[i - 1])):
                unmarked.append(i + 1)
            opening = not opening
    return unmarked


def table_rows(text: str) -> list[list[str]]:
    """A Markdown table's body rows, each cell stripped of spaces and backticks."""
    rows = [[cell.strip().strip("`") for cell in line.strip().strip("|").split("|")] for line in text.splitlines()]
    return rows[2:]
