"""The administrator's commands of docs/rollout-admin.md, run as the page writes them, with the real
kubectl against the real API server (the CRD, the chart's admission policies and the CR the
bootstrap hook writes): the seed's patches as corrected (start, pause, resume, forced rollback,
status) and its rollout policy typed into `kubectl edit` under `spec:`. The seed's own forms, as
the product manual prints them, fail as the errata say (docs/product/README.md).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from metax_operator import contract
from metax_operator.lookup import lookup
from tests.chart.test_admission import client, live_cr, spec_schema  # noqa: F401 - fixtures used by name
from tests.doc_blocks import blocks
from tests.helm import BIN, CHART

pytestmark = pytest.mark.e2e

PAGE = CHART / "docs" / "rollout-admin.md"
COMMANDS = {b.args[0]: b for b in blocks(PAGE) if b.kind == "admin-command"}
(CR_EDIT,) = [b for b in blocks(PAGE) if b.kind == "cr-edit"]
#: What each command leaves in the CR's spec.
EFFECTS = {
    "start": ("driver", "payload", "version", "2.33.0.9"),
    "pause": ("driver", "upgradePolicy", "pause", True),
    "resume": ("driver", "upgradePolicy", "pause", False),
    "rollback": ("driver", "upgradePolicy", "enableRollout", False),
}
#: An editor for `kubectl edit`: merges the YAML file $FRAGMENT into the object it is given, and
#: keeps the comments kubectl heads it with (the reasons of a refused edit) in $SEEN.
EDITOR = """
import os, sys, yaml
def merge(into, add):
    for key, value in add.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value
path = sys.argv[1]
text = open(path).read()
open(os.environ["SEEN"], "a").write("".join(line + "\\n" for line in text.splitlines() if line.startswith("#")))
obj = yaml.safe_load(text)
merge(obj, yaml.safe_load(open(os.environ["FRAGMENT"])))
open(path, "w").write(yaml.safe_dump(obj))
"""


def shell(control_plane, text: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`text` run by bash as an admin types it: kubectl on PATH, the cluster's kubeconfig."""
    return subprocess.run(
        ["bash", "-e", "-c", text],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "KUBECONFIG": str(control_plane.kubeconfig), **(env or {})},
    )


def spec(client) -> dict:
    return client.get(contract.CR_API_VERSION, contract.CR_KIND, contract.CR_NAME)["spec"]


def test_the_page_has_every_command_the_errata_point_to():
    assert set(COMMANDS) == set(EFFECTS) | {"status"}


@pytest.mark.parametrize("name", ["start", "pause", "resume", "pause", "rollback"])
def test_each_corrected_command_works_as_written(name, control_plane, client, live_cr):
    *path, value = EFFECTS[name]
    result = shell(control_plane, COMMANDS[name].text)
    assert result.returncode == 0, result.stderr
    assert lookup(spec(client), *path) == value


def test_the_status_commands_print_the_seed_s_shape(control_plane, client, live_cr):
    result = shell(control_plane, COMMANDS["status"].text)
    assert result.returncode == 0, result.stderr
    assert "PHASE" in result.stdout and contract.CR_NAME in result.stdout


def test_the_seed_s_policy_under_spec_goes_through_kubectl_edit(control_plane, client, live_cr, tmp_path):
    fragment = tmp_path / "fragment.yaml"
    fragment.write_text(CR_EDIT.text)
    editor = tmp_path / "editor.py"
    editor.write_text(EDITOR)
    env = {"KUBE_EDITOR": f"{sys.executable} {editor}", "FRAGMENT": str(fragment), "SEEN": str(tmp_path / "seen")}
    result = shell(control_plane, "kubectl edit clusteroperators.gpu.metax-tech.com cluster-operator", env)
    assert result.returncode == 0, result.stderr
    policy = spec(client)["driver"]["upgradePolicy"]
    typed = yaml.safe_load(CR_EDIT.text)["spec"]["driver"]["upgradePolicy"]
    assert policy["enableRollout"] is True
    assert [s["replicas"] for s in policy["upgradeSteps"]] == [2, 5, 8, "100%"]
    assert [s.get("pauseDuration") for s in policy["upgradeSteps"]] == [None, 10000, 10000, None]
    assert {k: policy[k] for k in ("maxParallel", "maxUnavailable", "maxFailureThreshold", "fallback")} == {
        k: typed[k] for k in ("maxParallel", "maxUnavailable", "maxFailureThreshold", "fallback")
    }
    assert spec(client)["registry"] == live_cr["spec"]["registry"], "the rest of the spec stays"


def test_the_seed_s_policy_at_the_top_level_is_refused_by_kubectl_edit(control_plane, client, live_cr, tmp_path):
    """As the seed prints it (`driver:` at the top level): refused, nothing changed."""
    fragment = tmp_path / "fragment.yaml"
    fragment.write_text(yaml.safe_dump(yaml.safe_load(CR_EDIT.text)["spec"]))
    editor = tmp_path / "editor.py"
    editor.write_text(EDITOR)
    before = spec(client)
    seen = tmp_path / "seen"
    env = {"KUBE_EDITOR": f"{sys.executable} {editor}", "FRAGMENT": str(fragment), "SEEN": str(seen)}
    result = shell(control_plane, "kubectl edit clusteroperators.gpu.metax-tech.com cluster-operator", env)
    assert result.returncode != 0 and '"cluster-operator" is invalid' in result.stderr, result.stderr
    assert 'unknown field "driver"' in seen.read_text(), seen.read_text()  # what the reopened editor shows
    assert spec(client) == before


#: The seed's patches as printed (their page and first characters), and the start of kubectl's
#: answer, which the errata quote.
SEED = {
    "000 §3.2.8 forced rollback": (
        "000-gpu-operator.txt",
        "kubectl patch clusteroperators.gpu.metax-tech.com clusteroperator type=json",
        'Error from server (NotFound): clusteroperators.gpu.metax-tech.com "clusteroperator" not found',
    ),
    "001 §3.1.4 resume": (
        "001-driver-and-firmware-upgrade.txt",
        "kubectl patch clusteroperators.gpu.metax-tech.com cluster-operator --type=json",
        "The request is invalid",
    ),
}


@pytest.mark.parametrize("name", sorted(SEED))
def test_the_seed_s_printed_patches_fail_as_the_errata_quote_and_change_nothing(name, control_plane, client, live_cr):
    page, start, answer = SEED[name]
    printed = next(line for line in (CHART / "docs" / "product" / page).read_text().splitlines() if line.startswith(start))
    before = spec(client)
    result = shell(control_plane, printed)
    assert result.returncode != 0 and result.stderr.startswith(answer), result.stderr
    assert spec(client) == before
    assert f"as printed: `{answer}" in (CHART / "docs" / "product" / "README.md").read_text()
