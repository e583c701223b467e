"""Small helpers the e2e tests share: the real kubectl and helm, installing the chart the way the
tests do (no hooks: kwok runs no containers, so each hook's command runs here instead), polling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml
from kubernetes import client

from tests.helm import BIN, CHART

#: The seed's `kubectl patch --type=json` of one upgradePolicy field (seed 000 §3.2.8), corrected.
SEED_PATCH = '[{"op": "replace", "path": "/spec/driver/upgradePolicy/%s", "value": %s}]'


def seed_patch(cp, field: str, value) -> None:
    """The seed's admin command on spec.driver.upgradePolicy.<field>, with the real kubectl
    (docs/rollout-admin.md)."""
    kubectl(
        cp,
        "patch",
        "clusteroperators.gpu.metax-tech.com",
        "cluster-operator",
        "--type=json",
        "-p",
        SEED_PATCH % (field, json.dumps(value)),
    )


def more_passes(runner, count: int):
    """An `until` for `consistently`: true once `runner` (a process with a JSON log, `.lines`) has
    logged `count` more passes than now. The window of a check that the runner leaves something
    alone is counted in its passes, not in seconds."""
    start = len(runner.lines("pass"))
    return lambda: len(runner.lines("pass")) >= start + count


def kubectl(cp, *args: str, env: dict | None = None, check: bool = True) -> str:
    """The real kubectl against control plane `cp`; its stdout, or an AssertionError with stderr."""
    result = subprocess.run(
        [str(BIN / "kubectl"), "--kubeconfig", str(cp.kubeconfig), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=60,
    )
    if check and result.returncode:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr}")
    return result.stdout


def run(*command: str) -> str:
    """Run a command; its stdout, or an AssertionError carrying its stderr."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    if result.returncode:
        raise AssertionError(f"{' '.join(command)} failed: {result.stderr or result.stdout}")
    return result.stdout


CR = ("gpu.metax-tech.com", "v1", "clusteroperators", "cluster-operator")
METAX = str(Path(sys.executable).with_name("metax-operator"))


def helm3(cp) -> list[str]:
    """The Helm 3.18 command line for control plane `cp`."""
    return [str(BIN / "helm3"), "--kubeconfig", str(cp.kubeconfig)]


DRIVER_PODS = "app.kubernetes.io/component=driver"


def ready(obj) -> bool:
    """Whether a Pod's or a Node's (a client object) `Ready` condition is True."""
    return any(c.type == "Ready" and c.status == "True" for c in obj.status.conditions or [])


def driver_pods(api, namespace: str) -> list:
    """The driver pods of `namespace` not being deleted."""
    return [
        p
        for p in client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=DRIVER_PODS).items
        if p.metadata.deletion_timestamp is None
    ]


def driver_pods_ready(api, namespace: str, count: int) -> bool:
    """Whether `count` driver pods run in `namespace` (none being deleted), every one Ready."""
    pods = driver_pods(api, namespace)
    return len(pods) == count and all(ready(p) for p in pods)


def get_cr(api) -> dict | None:
    """The cluster-operator CR, or None while there is none."""
    try:
        return client.CustomObjectsApi(api).get_cluster_custom_object(*CR)
    except client.ApiException as err:
        if err.status == 404:
            return None
        raise


def cr_condition(api, kind: str) -> dict | None:
    """The CR's `status.conditions` entry of type `kind`, or None."""
    conditions = ((get_cr(api) or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), None)


def delete_cr(api) -> None:
    """Delete the cluster-operator CR if it is there (a module's leftover)."""
    try:
        client.CustomObjectsApi(api).delete_cluster_custom_object(*CR)
    except client.ApiException as err:
        if err.status != 404:
            raise


def install_chart(cp, api, tmp: Path, release: str, namespace: str, values: dict) -> None:
    """`helm install --no-hooks` of the chart with `values` (hook Jobs cannot run under kwok)."""
    delete_cr(api)
    path = tmp / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    run(*helm3(cp), "install", release, str(CHART), "-n", namespace, "--create-namespace", "--no-hooks", "-f", str(path))


def uninstall_chart(cp, api, release: str, namespace: str) -> None:
    subprocess.run([*helm3(cp), "uninstall", release, "-n", namespace, "--no-hooks"], capture_output=True, timeout=120)
    delete_cr(api)


def bootstrap(cp, tmp: Path, release: str, values: dict, revision: int | None = None) -> None:
    """What the bootstrap hook Job runs: `values` (a release's, all of them) into the CR; with
    `revision`, as the pre-upgrade hook of that release revision (the runner holds until Helm
    has applied it)."""
    path = tmp / "release-values.json"
    path.write_text(json.dumps(values))
    held = ["--release-revision", str(revision)] if revision is not None else []
    run(METAX, "bootstrap", "--values", str(path), "--release", release, *held, "--kubeconfig", str(cp.kubeconfig))


def release_values(cp, release: str, namespace: str) -> dict:
    """`helm get values --all`: the values the release's hooks get."""
    return json.loads(run(*helm3(cp), "get", "values", release, "-n", namespace, "--all", "-o", "json"))


def service_account_kubeconfig(cp, tmp: Path, account: str, namespace: str) -> Path:
    """A kubeconfig authenticating as ServiceAccount `account` (a TokenRequest token)."""
    token = kubectl(cp, "create", "token", account, "-n", namespace, "--duration", "2h").strip()
    config = yaml.safe_load(cp.kubeconfig.read_text())
    config["users"] = [{"name": account, "user": {"token": token}}]
    for context in config["contexts"]:
        context["context"]["user"] = account
    path = tmp / f"{account}.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def log_entries(path: Path, *actions: str) -> list[dict]:
    """The JSON log lines of a `metax-operator` process (its stderr in `path`) with one of these
    `actions`, in order."""
    found = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("action") in actions:
            found.append(entry)
    return found
