"""The acceptance cases of ../shared/cases/, with a copy under tests/data/ so the tests also run in
a clone without shared/ beside it (tests/test_cases.py checks that the copies are current)."""
from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "cases"
LOCAL = REPO / "tests" / "data"
FILES = ("podtemplatespec-merge.yaml", "rollout-worked-examples.yaml")


def path(name: str) -> Path:
    """The shared original when it is there, else the local copy."""
    return SHARED / name if (SHARED / name).exists() else LOCAL / name


def load(name: str) -> list[dict]:
    """The `cases` list of an acceptance-case file."""
    return yaml.safe_load(path(name).read_text())["cases"]


WORKED_EXAMPLES = load("rollout-worked-examples.yaml")
MERGE_CASES = load("podtemplatespec-merge.yaml")
