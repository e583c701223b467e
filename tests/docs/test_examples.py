"""The example values in examples/ are valid values and give the seed's worked rollouts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.cases import WORKED_EXAMPLES
from tests.helm import BIN

REPO = Path(__file__).resolve().parents[2]
METAX = REPO / ".venv" / "bin" / "metax-operator"
EXAMPLES = {
    "rollout-10-nodes.yaml": (10, "10 nodes, seed 000 section 3.2.8"),
    "rollout-100-nodes.yaml": (100, "100 nodes, seed 001 scenario 2 (percent replicas, maxParallel 50%)"),
}


def test_every_example_is_listed():
    assert sorted(p.name for p in (REPO / "examples").glob("*.yaml")) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_is_valid_values(name):
    result = subprocess.run(
        [
            METAX,
            "validate",
            "--helm",
            BIN / "helm3",
            "-f",
            REPO / "examples" / name,
            "--set",
            "registry=r.example/metax",
            "--set-string",
            "driver.payload.version=2.32.0.6",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_example_gives_the_seed_worked_rollout(name):
    nodes, case_name = EXAMPLES[name]
    expect = next(c for c in WORKED_EXAMPLES if c["name"] == case_name)["expect"]
    result = subprocess.run(
        [METAX, "rollout", "simulate", "--nodes", str(nodes), "--policy", REPO / "examples" / name, "--output", "json"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["steps"] == expect
