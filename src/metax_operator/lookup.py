"""Reading a field of plain data (a parsed manifest, values, a CR) that may be absent."""

from __future__ import annotations

from typing import Any


def lookup(node: Any, *path: str) -> Any:
    """`node[path[0]][path[1]]...`, or None as soon as a level is missing or not a mapping."""
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node
