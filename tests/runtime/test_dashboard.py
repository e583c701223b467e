"""The Grafana dashboard the chart ships (the ConfigMap of `runner.dashboard.enabled`, as Grafana's
dashboard sidecar gets it), checked as Grafana reads it, without a Grafana:

- by the dashboard kind of the Grafana Foundation SDK (Go types generated from Grafana's dashboard
  schema, read strictly: scripts/dashboard-check, built by `make test`'s setup): a misspelt or unknown
  field, a value of the wrong type, a required field missing, a panel's options that do not fit
  its panel plugin or a query that does not fit the Prometheus data source, a gridPos outside the
  schema's bounds;
- by what Grafana's provisioning needs beyond the schema: a uid of at most 40 characters Grafana
  accepts, a title, no database id, a schemaVersion that already has data source references as
  objects, unique panel ids, panels inside the 24 columns and not overlapping, and every data
  source reference a `${name}` of a data source variable of that type.

Each check is shown to refuse a broken copy. What the queries read: tests/runtime/test_metrics.py
(every metric exported) and tests/e2e/test_prometheus.py (every query answered by Prometheus)."""

from __future__ import annotations

import copy
import json
import re
import subprocess

import pytest

from tests.helm import BIN, find, render_chart
from tests.runtime.test_metrics import ON

CHECKER = BIN / "dashboard-check"
GRID_COLUMNS = 24
UID = re.compile(r"[A-Za-z0-9_-]{1,40}")  # Grafana's rule for a dashboard uid
#: Data source references as {type, uid} objects (Grafana migrates older ones on load).
MIN_SCHEMA_VERSION = 33


@pytest.fixture(scope="module")
def board() -> dict:
    config = find(render_chart(helm="helm3", args=ON), "ConfigMap", "metax-operator-runner-dashboard")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"  # what the sidecar loads
    (key,) = config["data"]
    assert key.endswith(".json")  # the sidecar writes the key as the file Grafana provisions
    return json.loads(config["data"][key])


def schema_problems(board: dict, tmp_path) -> list[str]:
    """dashboard-check's lines: [] when the SDK's dashboard kind reads the dashboard."""
    if not CHECKER.exists():
        pytest.fail(f"{CHECKER} is missing: run 'make test' (scripts/setup.d/10-dashboard-check)", pytrace=False)
    path = tmp_path / "dashboard.json"
    path.write_text(json.dumps(board))
    done = subprocess.run([CHECKER, path], capture_output=True, text=True, timeout=60)
    assert done.returncode in (0, 1), done.stderr
    return [] if done.returncode == 0 else done.stdout.splitlines()


def refs(board: dict):
    """(where, reference) of every data source reference of the panels and their queries."""
    for panel in board.get("panels") or ():
        name = f"panel {panel.get('id')}"
        if "datasource" in panel:
            yield name, panel["datasource"]
        for target in panel.get("targets") or ():
            yield f"{name} query {target.get('refId')}", target.get("datasource")


def provisioning_problems(board: dict) -> list[str]:
    """What Grafana's provisioning needs beyond the schema, one line per problem."""
    found = []
    uid, title = board.get("uid"), board.get("title")
    if not isinstance(uid, str) or not UID.fullmatch(uid):
        found.append(f"uid {uid!r}: 1 to 40 letters, digits, '-' or '_'")
    if not isinstance(title, str) or not title.strip():
        found.append("no title")
    if board.get("id") is not None:
        found.append("an id: Grafana assigns it")
    version = board.get("schemaVersion")
    if not isinstance(version, int) or version < MIN_SCHEMA_VERSION:
        found.append(f"schemaVersion {version!r}: an integer, at least {MIN_SCHEMA_VERSION}")
    panels = board.get("panels") or []
    ids = [p.get("id") for p in panels]
    if len(set(ids)) != len(ids) or not all(isinstance(i, int) for i in ids):
        found.append(f"panel ids not unique integers: {ids}")
    cells: dict[tuple[int, int], object] = {}
    for panel in panels:
        pos = panel.get("gridPos") or {}
        x, y, w, h = (pos.get(k) for k in "xywh")
        if not all(isinstance(v, int) for v in (x, y, w, h)) or x < 0 or y < 0 or w < 1 or h < 1 or x + w > GRID_COLUMNS:
            found.append(f"panel {panel.get('id')}: gridPos {pos} is not inside the {GRID_COLUMNS} columns")
            continue
        for cell in ((cx, cy) for cx in range(x, x + w) for cy in range(y, y + h)):
            if cells.setdefault(cell, panel.get("id")) != panel.get("id"):
                found.append(f"panel {panel.get('id')} overlaps panel {cells[cell]} at {cell}")
                break
    variables = {v.get("name"): v for v in (board.get("templating") or {}).get("list") or ()}
    for where, ref in refs(board):
        name = re.fullmatch(r"\$\{(\w+)\}", str((ref or {}).get("uid")))
        variable = variables.get(name.group(1)) if name else None
        if variable is None or variable.get("type") != "datasource" or variable.get("query") != ref.get("type"):
            found.append(f"{where}: data source {ref} is not a ${{name}} of a data source variable of its type")
    return found


def test_grafanas_dashboard_kind_reads_the_shipped_dashboard_strictly(board, tmp_path):
    assert schema_problems(board, tmp_path) == []


def test_the_shipped_dashboard_meets_grafanas_provisioning_rules(board):
    assert provisioning_problems(board) == []
    assert len(board["panels"]) >= 10 and len(list(refs(board))) > len(board["panels"])


def broken(board: dict, change) -> dict:
    copied = copy.deepcopy(board)
    change(copied)
    return copied


SCHEMA_BREAKS = {
    "a misspelt field": (lambda b: b.update(titel=b.pop("title")), "Dashboard: unexpected field 'titel'"),
    "a panel id as a string": (
        lambda b: b["panels"][0].update(id="1"),
        "panels[0].id: json: cannot unmarshal string into Go value of type uint32",
    ),
    "a misspelt Prometheus query field": (
        lambda b: b["panels"][0]["targets"][0].update(exp=b["panels"][0]["targets"][0].pop("expr")),
        "panels[0].targets[0].Dataquery: unexpected field 'exp'",
    ),
    "stat options that are not the stat panel's": (
        lambda b: b["panels"][0].update(options={"reduceOption": {}}),
        "panels[0].options.reduceOptions: required field is missing from input",
    ),
    "a panel wider than the grid": (lambda b: b["panels"][9]["gridPos"].update(w=30), "panels[9].Panel.gridPos.w: must be <= 24"),
    "no annotations": (lambda b: b.pop("annotations"), "annotations: required field is missing from input"),
}


@pytest.mark.parametrize("case", SCHEMA_BREAKS)
def test_grafanas_dashboard_kind_refuses_a_broken_copy(board, tmp_path, case):
    change, line = SCHEMA_BREAKS[case]
    assert line in schema_problems(broken(board, change), tmp_path)


PROVISIONING_BREAKS = {
    "a uid of 41 characters": (lambda b: b.update(uid="m" * 41), "uid 'mmmmm"),
    "a uid with a dot": (lambda b: b.update(uid="metax.rollout"), "uid 'metax.rollout'"),
    "no title": (lambda b: b.update(title=" "), "no title"),
    "a database id": (lambda b: b.update(id=7), "an id: Grafana assigns it"),
    "an old schemaVersion": (lambda b: b.update(schemaVersion=27), "schemaVersion 27"),
    "two panels with one id": (lambda b: b["panels"][1].update(id=1), "panel ids not unique integers"),
    "a panel past column 24": (lambda b: b["panels"][3]["gridPos"].update(x=20), "panel 4: gridPos"),
    "overlapping panels": (lambda b: b["panels"][1]["gridPos"].update(x=3), "panel 2 overlaps panel 1"),
    "a data source by name": (
        lambda b: b["panels"][2].update(datasource={"type": "prometheus", "uid": "Prometheus"}),
        "panel 3: data source",
    ),
    "a query's data source of another type": (
        lambda b: b["panels"][4]["targets"][0]["datasource"].update(type="loki"),
        "panel 5 query A: data source",
    ),
    "no data source variable": (lambda b: b["templating"].update(list=[]), "panel 1: data source"),
}


@pytest.mark.parametrize("case", PROVISIONING_BREAKS)
def test_each_provisioning_rule_refuses_a_broken_copy(board, case):
    change, start = PROVISIONING_BREAKS[case]
    assert any(line.startswith(start) for line in provisioning_problems(broken(board, change))), case
