"""YAML text a user hands us: read it, and refuse what a parser would take silently or die of.

`read_text` and `load_one` are what every command reading a user's YAML file uses (values files,
policies, the CRD, the hook values); the post-renderer uses the two checks below directly.

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
import sys
from pathlib import Path
from typing import Any

from metax_operator.errors import UserError, UserErrors

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


def read_text(path: str | Path, fix: str) -> str:
    """The UTF-8 text of the file at `path` (`-`: stdin); a UserError naming it when it cannot be read."""
    where = "stdin" if str(path) == "-" else str(path)
    try:
        data = sys.stdin.buffer.read() if where == "stdin" else Path(path).read_bytes()
    except OSError as err:
        raise UserError(where, f"cannot be read: {err.strerror}", fix) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UserError(where, f"is not UTF-8 text (byte {err.start} is 0x{data[err.start]:02x})", "save it as UTF-8") from None


def load_one(text: str, where: str) -> Any:
    """The one YAML document of `text` (None when empty). UserErrors naming `where` (and the line)
    for text nested too deeply, not YAML, of several documents, or repeating a key."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    if problem := nesting_problem(text):
        raise UserError(where, problem, "flatten it")
    try:
        documents = [node for node in yaml.compose_all(text, Loader=loader) if node is not None]
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        raise UserError(
            f"{where}:{mark.line + 1}" if mark else where,
            f"is not valid YAML: {getattr(err, 'problem', None) or err}",
            "fix the YAML syntax",
        ) from None
    if len(documents) > 1:
        raise UserError(
            where,
            f"holds {len(documents)} YAML documents",
            "keep one (remove the `---` between them): tools disagree on which one counts "
            "(Helm 3 reads the first, Helm 4 the last)",
        )
    if not documents:
        return None
    repeated = [
        UserError(
            f"{where}:{line}",
            f"key {key!r} is repeated (first at line {first})",
            "remove one of them: a parser would keep only the last, silently",
        )
        for key, line, first in duplicate_keys(documents[0])
    ]
    if repeated:
        raise UserErrors(repeated)
    return yaml.load(text, Loader=loader)
