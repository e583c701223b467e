"""Checks of YAML text a user hands us, before and after PyYAML composes it.

- `nesting_problem`: a cheap upper bound of the nesting depth, checked BEFORE the text reaches
  PyYAML's C composer, which recurses once per level and kills the process with SIGSEGV somewhere
  past 20,000 levels (no exception to catch). The bound counts flow brackets (`[`, `{`, quoted or
  not) plus twice the widest block indentation (a block level costs at least one column, an
  indentless sequence shares its parent's), so it can only over-estimate.
- `duplicate_keys`: keys that appear twice in one mapping of a composed document. YAML forbids
  them; PyYAML and Helm keep the last one silently (a second `driver:` block would drop the
  first's settings).

Imported by the post-renderer inside every `helm template`: nothing heavier than `re` at import.
"""
from __future__ import annotations

import re

#: Deeper documents are refused; the chart's own are under 30 levels.
MAX_DEPTH = 1000

_BRACKET = re.compile(r"[\[\]{}]")
_BLOCK_INDENT = re.compile(r"^[ \t?-]*", re.MULTILINE)


def nesting_problem(text: str) -> str | None:
    """Why `text` is too deeply nested to parse safely, or None."""
    depth = deepest = 0
    for match in _BRACKET.finditer(text):
        depth = depth + 1 if match.group() in "[{" else max(0, depth - 1)
        deepest = max(deepest, depth)
    indent = max((len(m.group()) for m in _BLOCK_INDENT.finditer(text)), default=0)
    if deepest + 2 * indent > MAX_DEPTH:
        return f"is nested more than {MAX_DEPTH} levels deep"
    return None


def duplicate_keys(node) -> list[tuple[str, int, int]]:
    """(key, line, first line) of every repeated scalar key under a composed PyYAML `node`
    (lines from 1), in document order. Iterative: the depth is bounded by `nesting_problem`, but
    a loop needs no stack either way."""
    found, stack, seen_nodes = [], [node], set()
    while stack:
        current = stack.pop()
        if id(current) in seen_nodes:  # an alias repeats a node already visited
            continue
        seen_nodes.add(id(current))
        if current.id == "mapping":
            first: dict[str, int] = {}
            for key, value in current.value:
                if key.id == "scalar":
                    line = key.start_mark.line + 1
                    if key.value in first:
                        found.append((key.value, line, first[key.value]))
                    else:
                        first[key.value] = line
                stack += [value, key]
        elif current.id == "sequence":
            stack += current.value
    return sorted(found, key=lambda item: item[1])
