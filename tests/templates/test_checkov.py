"""Checkov, as administrators run it before a chart reaches their cluster, over what the chart renders.

Checkov 3.3.30 (pinned, installed by scripts/setup.d/30-checkov in its own virtualenv) scans the
`helm template` output of four scenarios, each rendered by Helm 3.18 and Helm 4.1:
- `default`: the seed's install command (registry and driver version only);
- `all-components`: every component on (exporter with Service and ServiceMonitor) and most options
  set (tests/data/values-all.yaml), NetworkPolicies off;
- `cronjob`: the same with NetworkPolicies on and the runner as a CronJob;
- `hardened`: the same with NetworkPolicies on and every value a skip depends on set so that
  the check can pass (`imagePullPolicy: Always`, CPU limits on the driver and maca).
Beside each render lies its twin without the `checkov.io/skipN` annotations. Checkov scans each
file in a process of its own (in one run, a NetworkPolicy of one file satisfies the pods of
another), two at a time; a render byte-identical to one already scanned (Helm 4's is, so far, to
Helm 3's) is scanned once. Then: nothing fails in a render; every
check skipped in a render fails in its twin and the other way round (a skip covers a real finding,
and goes when its condition is lifted); and each skip shows the reason the chart's table gives.

The table (`metax-operator.checkov.table` in templates/_security.tpl) is plain YAML, read here
as it is; docs/security.md must list the same exceptions with the same reasons.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helm import BIN, CHART, HELM_VERSIONS, NAMESPACE, RELEASE, run_helm

# e2e: Checkov's own virtualenv (about 95 dependencies from PyPI) is set up by `make e2e`; in `make
# test` its install and scans would take a minute cold and a third of the warm run.
pytestmark = pytest.mark.e2e
PINS = CHART / "scripts" / "checkov" / "requirements.txt"
CHECKOV = BIN.parent / "checkov" / hashlib.sha256(PINS.read_bytes()).hexdigest()[:16] / "bin" / "checkov"
SKIP_KEY = re.compile(r"^checkov\.io/skip\d+$")
SEED_INSTALL = ("--set", "registry=domain.example/project", "--set", "driver.payload.version=2.32.0.6")
ALL_ON = ("--values", str(CHART / "tests" / "data" / "values-all.yaml"))
POLICIES = ("--set", "networkPolicy.enabled=true")
SCENARIOS = {
    "default": SEED_INSTALL,
    "all-components": ALL_ON,
    "cronjob": ALL_ON + POLICIES + ("--set", "runner.mode=cronjob"),
    "hardened": ALL_ON
    + POLICIES
    + ("--set", "imagePullPolicy=Always", "--set", "driver.resources.limits.cpu=2", "--set", "maca.resources.limits.cpu=2"),
}
# The table's keys (templates/_security.tpl) and the objects that carry their skips.
TABLE_OBJECTS = {
    "gpuLabel": {("DaemonSet", "metax-gpu-label")},
    "runtime": {("DaemonSet", "metax-container-runtime")},
    "driver": {("DaemonSet", "metax-driver")},
    "maca": {("DaemonSet", "metax-maca")},
    "gpuDevice": {("DaemonSet", "metax-gpu-device")},
    "exporter": {("DaemonSet", "metax-data-exporter")},
    "vfioManager": {("DaemonSet", "metax-vfio-manager")},
    "tests": {("Pod", "metax-operator-test")},
    "runnerEvents": {("Role", "metax-operator-runner-events"), ("RoleBinding", "metax-operator-runner-events")},
}


def render(helm: str, scenario: str) -> str:
    return run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *SCENARIOS[scenario])


def skips(obj: dict) -> dict[str, str]:
    """The object's skip annotations as {check id: reason}."""
    annotations = obj["metadata"].get("annotations") or {}
    return dict(value.split("=", 1) for key, value in annotations.items() if SKIP_KEY.match(key))


def without_skips(text: str) -> str:
    objects = [o for o in yaml.safe_load_all(text) if o]
    for obj in objects:
        annotations = obj["metadata"].get("annotations") or {}
        for key in [k for k in annotations if SKIP_KEY.match(k)]:
            del annotations[key]
    return yaml.safe_dump_all(objects, sort_keys=False)  # Checkov names a pod after its labels in order


def checkov(path: Path) -> dict:
    """Checkov's JSON report on one file (alone: its graph checks such as CKV2_K8S_6 join the
    objects of every file a run scans)."""
    env = {**os.environ, "CKV_SKIP_PACKAGE_UPDATE_CHECK": "true", "BC_SKIP_MAPPING": "TRUE"}
    # --skip-download: Checkov asks its vendor's platform for metadata otherwise; nothing leaves the machine.
    result = subprocess.run(
        [str(CHECKOV), "--file", path.name, "--framework", "kubernetes", "--skip-download", "--compact", "--output", "json"],
        cwd=path.parent,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if not result.stdout.startswith("{"):
        raise AssertionError(f"checkov failed (exit {result.returncode}): {result.stderr[-2000:]}")
    return json.loads(result.stdout)


def scan(directory: Path) -> dict:
    """Renders every scenario with both Helm versions into `directory`, each distinct render with
    its twin without skips, and runs Checkov on each file, two at a time. One JSON report, plus
    the renders and which file holds each."""
    jobs = [(helm, scenario) for scenario in SCENARIOS for helm in HELM_VERSIONS]
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        rendered = pool.map(lambda job: render(*job), jobs)
        texts = {f"{helm}-{scenario}": text for (helm, scenario), text in zip(jobs, rendered, strict=True)}
        files, first = {}, {}
        for name, text in texts.items():
            files[name] = first.setdefault(text, name)
        paths = []
        for name in set(files.values()):
            paths.append(directory / f"{name}.yaml")
            paths[-1].write_text(texts[name])
            paths.append(directory / f"{name}.noskips.yaml")
            paths[-1].write_text(without_skips(texts[name]))
        rendered = time.monotonic()
        reports = list(pool.map(checkov, paths))
    return {
        "results": {
            f"{outcome}_checks": [r for part in reports for r in part["results"][f"{outcome}_checks"]]
            for outcome in ("passed", "failed", "skipped")
        },
        "summary": {
            key: sum(part["summary"][key] for part in reports)
            for key in ("passed", "failed", "skipped", "parsing_errors", "resource_count")
        },
        "versions": sorted({part["summary"]["checkov_version"] for part in reports}),
        "timing": {
            "renders": round(rendered - started, 1),
            "checkov": round(time.monotonic() - rendered, 1),
            "files": len(paths),
        },
        "renders": texts,
        "files": files,
    }


@pytest.fixture(scope="session")
def report(tmp_path_factory, request) -> dict:
    """One scan per test session, shared by the xdist workers through a file under a lock."""
    if not CHECKOV.exists():
        pytest.fail(f"{CHECKOV} is missing: run 'make e2e'", pytrace=False)
    worker = getattr(request.config, "workerinput", {}).get("workerid")
    shared = tmp_path_factory.getbasetemp().parent if worker else tmp_path_factory.getbasetemp()
    with open(shared / "checkov.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cached = shared / "checkov-report.json"
        if not cached.exists():
            directory = shared / "checkov-renders"
            directory.mkdir(exist_ok=True)  # a worker whose scan failed may have made it
            report = scan(directory)
            print(
                f"\nCheckov: {len(report['renders'])} renders in {report['timing']['renders']} s; "
                f"{report['timing']['files']} files (distinct renders and their twins), "
                f"{report['summary']['resource_count']} resources, in {report['timing']['checkov']} s"
            )
            cached.write_text(json.dumps(report))
    return json.loads(cached.read_text())


def results(report: dict, outcome: str) -> list[dict]:
    return report["results"][f"{outcome}_checks"]


def findings(report: dict, outcome: str, file: str) -> set[tuple[str, str]]:
    """(resource, check id) of the results of one scanned file, e.g. "helm3-default.yaml"."""
    return {(r["resource"], r["check_id"]) for r in results(report, outcome) if r["file_path"] == f"/{file}"}


def test_checkov_scans_every_render_without_parsing_errors(report):
    scanned = {r["file_path"] for outcome in ("passed", "failed", "skipped") for r in results(report, outcome)}
    expected = {f"/{name}{suffix}.yaml" for name in report["files"].values() for suffix in ("", ".noskips")}
    assert scanned == expected
    for name, file in report["files"].items():
        assert report["renders"][name] == report["renders"][file], name
    assert report["summary"]["parsing_errors"] == 0 and report["versions"] == ["3.3.30"]


def test_checkov_reports_no_unjustified_finding(report):
    failed = sorted(
        f"{r['file_path']}: {r['resource']} {r['check_id']} ({r['check_name']})"
        for r in results(report, "failed")
        if not r["file_path"].endswith(".noskips.yaml")
    )
    assert not failed, "fix these, or add them with a reason to metax-operator.checkov.table:\n" + "\n".join(failed)


@pytest.mark.parametrize("render", [f"{h}-{s}" for h in HELM_VERSIONS for s in SCENARIOS])
def test_every_skip_covers_a_finding_checkov_reports_without_it(report, render):
    """A skip that does not cover a failure (a check that passes, or does not apply to the object)
    is as wrong as a failure without one."""
    file = report["files"][render]
    skipped = findings(report, "skipped", f"{file}.yaml")
    failing = findings(report, "failed", f"{file}.noskips.yaml")
    assert skipped, render
    assert sorted(skipped - failing) == [], "skipped but passing without the skip"
    assert sorted(failing - skipped) == [], "failing without the skips but not skipped"


def test_the_hardened_values_pass_the_checks_the_defaults_skip(report):
    for helm in HELM_VERSIONS:
        file = report["files"][f"{helm}-hardened"]
        skipped = {check for _, check in findings(report, "skipped", f"{file}.yaml")}
        assert skipped.isdisjoint({"CKV_K8S_15", "CKV2_K8S_6", "CKV_K8S_11"}), skipped
        passed = findings(report, "passed", f"{file}.yaml")
        assert ("DaemonSet.metax-operator.metax-driver", "CKV_K8S_11") in passed
        assert ("DaemonSet.metax-operator.metax-gpu-label", "CKV_K8S_15") in passed
        assert {r for r, check in passed if check == "CKV2_K8S_6"}, "no pod passed the NetworkPolicy check"


def test_every_skip_shows_the_reason_its_annotation_gives(report):
    for render, text in report["renders"].items():
        reasons = {}
        for obj in yaml.safe_load_all(text):
            if obj:
                for check, reason in skips(obj).items():
                    assert reason.strip() and "\n" not in reason, (render, obj["metadata"]["name"], check)
                    reasons.setdefault(check, set()).add(reason)
        for result in results(report, "skipped"):
            if result["file_path"] == f"/{report['files'][render]}.yaml":
                assert result["check_result"]["suppress_comment"] in reasons[result["check_id"]], result["resource"]


# -- the table and docs/security.md --------------------------------------------------------------


def table() -> dict:
    """`metax-operator.checkov.table`: the YAML between its define and its end."""
    text = (CHART / "templates" / "_security.tpl").read_text()
    body = re.search(r'\{\{- define "metax-operator\.checkov\.table" -\}\}\n(.*?)\{\{- end \}\}', text, re.S)
    return yaml.safe_load(body.group(1))


def test_the_table_renders_where_it_says(report):
    """Each unconditional entry is on its objects in every render that has them, with its reason;
    and no reason contains `=` (Checkov cuts the annotation there)."""
    entries = {key: value for key, value in table().items() if key not in ("reasons", "pods")}
    assert set(entries) == set(TABLE_OBJECTS)
    for render, text in report["renders"].items():
        objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(text) if o}
        for key, checks in entries.items():
            for where in TABLE_OBJECTS[key] & set(objects):
                on_object = skips(objects[where])
                for check, entry in checks.items():
                    assert "=" not in entry["reason"], check
                    if "when" not in entry:
                        assert on_object.get(check) == entry["reason"], (render, where, check)


def documented_exceptions() -> dict[tuple[str, str], tuple[set[str], str]]:
    """docs/security.md's exceptions table: (table key, reason) -> (checks, when)."""
    text = (CHART / "docs" / "security.md").read_text()
    section = text.split("## What a scanner reports", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`"):
            continue
        key = cells[0].split("`")[1]
        rows[(key, cells[3])] = (set(re.findall(r"CKV2?_K8S_\d+", cells[1])), cells[2])
    return rows


def test_docs_security_md_lists_every_exception_with_its_reason():
    expected = {}
    for key, checks in table().items():
        if key == "reasons":
            continue
        for check, entry in checks.items():
            ids, _ = expected.setdefault((key, entry["reason"]), (set(), entry.get("when")))
            ids.add(check)
    documented = documented_exceptions()
    assert set(documented) == set(expected), "docs/security.md's exceptions table and the chart's table differ"
    for row, (ids, when) in expected.items():
        assert documented[row][0] == ids, row
        assert (documented[row][1] == "always") == (when is None), row
