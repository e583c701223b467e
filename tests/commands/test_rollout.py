"""`metax-operator rollout simulate`, run as the admin runs it: the installed CLI in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cases import WORKED_EXAMPLES

CLI = Path(sys.executable).parent / "metax-operator"
CASES = WORKED_EXAMPLES
# The seed's own text (000 section 3.2.8): steps written `pause:`, unquoted percentages.
SEED_EXAMPLE = """\
driver:
   upgradePolicy:
      enableRollout: true
      upgradeSteps:
      - replicas: 2
        pause:
      - replicas: 5
        pauseDuration: 10000
      - replicas: 8
        pauseDuration: 10000
      - replicas: 100%
        pause:
      pause: false
      maxParallel: 50%
      maxUnavailable: 0
      maxFailureThreshold: 3
      fallback: pause
"""


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), "rollout", "simulate", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_worked_examples_as_json(case, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"upgradePolicy": case["policy"]}))
    done = cli("--nodes", str(case["nodes"]), "--policy", str(policy), "--output", "json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"steps": case["expect"]}


@pytest.mark.parametrize("wrap", ["values", "cr", "bare"])
def test_policy_from_values_cr_or_bare_mapping(wrap, tmp_path):
    policy = yaml.safe_load(SEED_EXAMPLE)["driver"]["upgradePolicy"]
    doc = {
        "values": {"driver": {"upgradePolicy": policy}},
        "cr": {"apiVersion": "gpu.metax-tech.com/v1", "kind": "ClusterOperator", "spec": {"driver": {"upgradePolicy": policy}}},
        "bare": policy,
    }[wrap]
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(doc))
    done = cli("--nodes", "10", "--policy", str(path), "--output", "json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"steps": CASES[0]["expect"]}


def test_table_shows_steps_and_estimated_duration(tmp_path):
    path = tmp_path / "values.yaml"
    path.write_text(SEED_EXAMPLE)
    done = cli("--nodes", "10", "--policy", str(path), "--ready-latency", "60")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[1].split() == ["step", "target", "deletions", "after", "ready", "at"]
    assert lines[2].split()[:4] == ["0", "2", "1,", "1"]
    assert "wait for admin" in lines[2] and "pause 10s" in lines[3]
    # 8 waves of 60 s plus two 10 s pauses, each wave within a 5 s loop interval (+1 s termination)
    assert lines[-1].startswith("Estimated duration: 9m")
    assert "8 waves" in lines[-1] and "2 manual pauses" in lines[-1]


def test_invalid_policy_exits_1_with_one_line_per_problem(tmp_path):
    path = tmp_path / "values.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "driver": {
                    "upgradePolicy": {
                        "enableRollout": True,
                        "maxParallel": "-5%",
                        "upgradeSteps": [{"replicas": "150%"}, {"replicas": "abc"}, {"replicas": 4}],
                    }
                }
            }
        )
    )
    done = cli("--nodes", "10", "--policy", str(path))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        line for line in done.stderr.splitlines() if line.startswith("error: driver.upgradePolicy.")
    ]
    fields = [line.split(":")[1].strip() for line in done.stderr.splitlines()]
    assert fields == [
        "driver.upgradePolicy.maxParallel",
        "driver.upgradePolicy.upgradeSteps[0].replicas",
        "driver.upgradePolicy.upgradeSteps[1].replicas",
        "driver.upgradePolicy.upgradeSteps[2].replicas",
    ]


def test_int_last_step_is_checked_against_the_node_count(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        yaml.safe_dump(
            {"spec": {"driver": {"upgradePolicy": {"enableRollout": True, "upgradeSteps": [{"replicas": 2}, {"replicas": 10}]}}}}
        )
    )
    assert cli("--nodes", "10", "--policy", str(path)).returncode == 0
    done = cli("--nodes", "12", "--policy", str(path))
    assert done.returncode == 1
    assert done.stderr.startswith("error: spec.driver.upgradePolicy.upgradeSteps[1].replicas: ")


@pytest.mark.parametrize(
    "args,field", [(["--nodes", "0"], "--nodes"), (["--nodes", "3", "--ready-latency", "0"], "--ready-latency")]
)
def test_bad_arguments_name_the_flag(args, field, tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(SEED_EXAMPLE)
    done = cli(*args, "--policy", str(path))
    assert done.returncode == 1 and done.stderr.startswith(f"error: metax-operator rollout simulate: argument {field}: ")


def test_unreadable_or_broken_file(tmp_path):
    missing = cli("--nodes", "3", "--policy", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1 and missing.stderr.startswith(f"error: {tmp_path / 'nope.yaml'}: cannot be read")
    broken = tmp_path / "broken.yaml"
    broken.write_text("driver: [unclosed\n")
    done = cli("--nodes", "3", "--policy", str(broken))
    assert done.returncode == 1 and done.stderr.startswith(f"error: {broken}:2: is not valid YAML")


def test_a_dry_run_too_large_to_compute_says_so(tmp_path):
    """Regression: --nodes 10000000 ran out of memory; a policy of one pod per wave on 50,000
    nodes would compute for hours."""
    path = tmp_path / "p.yaml"
    path.write_text(
        yaml.safe_dump({"upgradePolicy": {"enableRollout": True, "maxParallel": 1, "upgradeSteps": [{"replicas": "100%"}]}})
    )
    done = cli("--nodes", "50000", "--policy", str(path))
    assert done.returncode == 1 and done.stderr.splitlines() == [
        "error: --nodes: 50000 nodes in 50000 waves is more than this dry run computes (nodes x waves at most "
        "2,000,000); simulate fewer nodes (percentages keep the shape of the steps) or a larger maxParallel"
    ]
