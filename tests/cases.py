"""The acceptance cases taken from the product documentation (docs/product/): the podTemplateSpec
merge rules and the rollout's worked examples, under tests/data/."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"


def load(name: str) -> list[dict]:
    """The `cases` list of an acceptance-case file."""
    return yaml.safe_load((DATA / name).read_text())["cases"]


WORKED_EXAMPLES = load("rollout-worked-examples.yaml")
MERGE_CASES = load("podtemplatespec-merge.yaml")

# Seed 000 section 3.2.8: 10 nodes, maxParallel 50%.
SEED_POLICY = {
    "enableRollout": True,
    "upgradeSteps": [
        {"replicas": 2},
        {"replicas": 5, "pauseDuration": 10000},
        {"replicas": 8, "pauseDuration": 10000},
        {"replicas": "100%"},
    ],
    "pause": False,
    "maxParallel": "50%",
    "maxUnavailable": 0,
    "maxFailureThreshold": 3,
    "fallback": "pause",
}
