"""Ordering resourceVersions, which Kubernetes 1.35 made comparable (KEP-5504)."""

from __future__ import annotations


def compare_versions(a: str, b: str) -> int:
    """-1, 0 or 1 as resourceVersion `a` is older than, the same as or newer than `b` (objects
    of the same kind). Kubernetes 1.35 made them comparable (KEP-5504, client-go's
    `CompareResourceVersion`): positive decimal integers without leading zeros, so the longer is
    the newer, and at equal length the string order is the number order. Anything else is a
    ValueError: an API server whose versions cannot be compared is not one this runner supports."""
    for version in (a, b):
        if not (version.isascii() and version.isdigit()) or version.startswith("0"):
            raise ValueError(f"resourceVersion {version!r} is not a positive decimal integer")
    key = lambda v: (len(v), v)  # noqa: E731
    return (key(a) > key(b)) - (key(a) < key(b))
