"""GitOps tools against the local control plane (tests/controlplane.py), for the GitOps tests.

`ArgoCD.start(cp, workdir)` runs Argo CD's application-controller and repo-server (one binary
built by `scripts/setup.d/30-argocd` from the argo-cd Go module) and Redis (Debian's
redis-server, no persistence) as local processes on 127.0.0.1, after applying what an Argo CD
install puts in the cluster for them: its CRDs (Application, AppProject: from the same argo-cd
module), the `argocd` namespace, the `argocd-cm`, `argocd-rbac-cm` and `argocd-tls-certs-cm`
ConfigMaps, the `argocd-secret` Secret and the `default` AppProject (Argo CD's API server, which
the tests do not run, would create it). The in-cluster destination
(`https://kubernetes.default.svc`) is the control plane itself: `ARGOCD_FAKE_IN_CLUSTER` makes
the controller use the kubeconfig there instead of a pod's ServiceAccount.

`Flux.start(cp, workdir)` runs Flux's source-controller and helm-controller, from binaries built
by `make e2e` where it has helm-controller's source (FLUX_BUILD), or given by environment
variables (FLUX_ENV): helm-controller is not on the Go module proxy.

`snippet(name)` returns a code block of docs/gitops.md marked `<!-- snippet: NAME -->`: the
tests apply exactly what the docs tell users to write.

Logs of every process are in the work directory; failures raise GitOpsError with one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from kubernetes import client

from tests.controlplane import CACHE, REPO, Component, ControlPlane, free_port, stop_pid
from tests.helm import BIN
from tests.waiting import eventually

ARGOCD_VERSION = "v3.2.6"
ARGOCD_DIR = CACHE / "argocd" / ARGOCD_VERSION  # built by scripts/setup.d/30-argocd
ARGOCD_NAMESPACE = "argocd"
APPLICATIONS = ("argoproj.io", "v1alpha1", ARGOCD_NAMESPACE, "applications")
DOCS = REPO / "docs" / "gitops.md"


class GitOpsError(Exception):
    """A GitOps tool could not start or act; the message is one line saying what to do."""


def snippet(name: str, doc: Path = DOCS) -> str:
    """The fenced code block that follows the line `<!-- snippet: NAME -->` in `doc`."""
    match = re.search(rf"^<!-- snippet: {re.escape(name)} -->\n```[a-z]*\n(.*?)^```", doc.read_text(), re.MULTILINE | re.DOTALL)
    if not match:
        raise GitOpsError(f"{doc} has no code block marked '<!-- snippet: {name} -->'")
    return match.group(1)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def scrape(url: str) -> dict[str, float]:
    """Prometheus metrics at `url`: value by series (`name{label="value",...}`)."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values


def _redis_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def kubectl(cp: ControlPlane, *args: str, stdin: str | None = None) -> str:
    """The real kubectl against `cp`; its stdout, or GitOpsError with kubectl's last line."""
    result = subprocess.run(
        [str(BIN / "kubectl"), "--kubeconfig", str(cp.kubeconfig), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise GitOpsError(f"kubectl {' '.join(args[:2])} failed: {last}")
    return result.stdout


def apply(cp: ControlPlane, objects: list[dict], manager: str = "metax-gitops-test") -> None:
    """Server-side apply `objects` (as a GitOps tool's installer would)."""
    kubectl(
        cp,
        "apply",
        "--server-side",
        f"--field-manager={manager}",
        "--force-conflicts",
        "-f",
        "-",
        stdin=yaml.safe_dump_all(objects),
    )


def install_crds(cp: ControlPlane, path: Path, deadline: float) -> None:
    """Apply the CRDs in `path` (a file or directory) and wait until each is Established."""
    names = kubectl(cp, "apply", "--server-side", "--force-conflicts", "-f", str(path), "-o", "name").split()
    crds = client.ApiextensionsV1Api(cp.api())

    def established(name: str) -> bool:
        conditions = crds.read_custom_resource_definition(name).status.conditions or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    pending = [n.split("/", 1)[1] for n in names]
    while True:
        pending = [name for name in pending if not established(name)]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise GitOpsError(f"the CRDs {', '.join(pending)} were not Established in time: see the API server's log")
        time.sleep(0.2)


@dataclass
class Processes:
    """Local processes with logs in `workdir/logs`, each with a readiness check."""

    workdir: Path
    components: dict[str, Component] = field(default_factory=dict)

    def run(self, name: str, argv: list[str], ready, env: dict | None = None) -> None:
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            process = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        self.components[name] = Component(name, process, log, healthy=ready, exe=argv[0])

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.components)
        while pending:
            for c in self.components.values():
                code = c.process.poll()
                if code is not None:
                    last = next((line for line in reversed(c.tail(40).splitlines()) if line.strip()), "no output")
                    raise GitOpsError(f"{c.name} exited with status {code} ({last[:300]}); log: {c.log}")
            pending = [name for name in pending if not self.components[name].healthy()]
            if pending and time.monotonic() > deadline:
                raise GitOpsError(f"{', '.join(pending)} not ready after {timeout:.0f} s; logs in {self.workdir / 'logs'}")
            if pending:
                time.sleep(0.2)

    def stop(self) -> None:
        for c in reversed(list(self.components.values())):
            stop_pid(c.process.pid, c.process)
        self.components.clear()

    def rss(self) -> dict[str, int]:
        return {name: c.rss_bytes() for name, c in self.components.items()}


def _settings(reconciliation: str) -> list[dict]:
    """What Argo CD's install manifests put in its namespace that the controller and the
    repo-server read, with the `default` AppProject its API server would create."""
    part_of = {"app.kubernetes.io/part-of": "argocd"}

    def configmap(name: str, data: dict) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "data": data,
            "metadata": {"name": name, "namespace": ARGOCD_NAMESPACE, "labels": part_of},
        }

    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ARGOCD_NAMESPACE}},
        configmap("argocd-cm", {"timeout.reconciliation": reconciliation, "timeout.reconciliation.jitter": "0s"}),
        configmap("argocd-rbac-cm", {}),
        configmap("argocd-tls-certs-cm", {}),
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {"name": "argocd-secret", "namespace": ARGOCD_NAMESPACE, "labels": part_of},
            "stringData": {"server.secretkey": secrets.token_urlsafe(32)},
        },
        {
            "apiVersion": "argoproj.io/v1alpha1",
            "kind": "AppProject",
            "metadata": {"name": "default", "namespace": ARGOCD_NAMESPACE},
            "spec": {
                "sourceRepos": ["*"],
                "destinations": [{"server": "*", "namespace": "*"}],
                "clusterResourceWhitelist": [{"group": "*", "kind": "*"}],
            },
        },
    ]


@dataclass
class ArgoCD:
    cp: ControlPlane
    processes: Processes
    metrics_port: int
    start_seconds: float = 0.0

    @property
    def workdir(self) -> Path:
        return self.processes.workdir

    @classmethod
    def start(cls, cp: ControlPlane, workdir: Path, reconciliation: str = "120s", timeout: float = 120) -> ArgoCD:
        """Apply Argo CD's CRDs and settings to `cp`, start Redis, the repo-server and the
        application-controller, and return once all three answer; on failure stop what was
        started and raise GitOpsError."""
        binary = ARGOCD_DIR / "argocd"
        for needed in (binary, ARGOCD_DIR / "crds", BIN / "helm3", BIN / "kubectl"):
            if not needed.exists():
                raise GitOpsError(f"{needed} is missing: run 'make e2e' (it builds Argo CD {ARGOCD_VERSION})")
        redis = shutil.which("redis-server")
        if redis is None:
            raise GitOpsError("redis-server is not on PATH: run 'make e2e' (it installs Debian's redis-server with Argo CD)")
        workdir = Path(workdir)
        argocd = cls(cp, Processes(workdir), metrics_port=free_port())
        try:
            argocd._start(binary, redis, reconciliation, timeout)
        except BaseException:
            argocd.stop()
            raise
        return argocd

    def _start(self, binary: Path, redis: str, reconciliation: str, timeout: float) -> None:
        started = time.monotonic()
        install_crds(self.cp, ARGOCD_DIR / "crds", started + timeout)
        self.apply(_settings(reconciliation))
        for d in ("home", "tmp", "tls", "path"):
            (self.workdir / d).mkdir(parents=True, exist_ok=True)
        # The repo-server runs `helm` (Argo CD 3.2 renders with Helm 3) and `git` from PATH.
        with contextlib.suppress(FileExistsError):
            (self.workdir / "path" / "helm").symlink_to(BIN / "helm3")
        redis_port, repo_port, repo_metrics = free_port(), free_port(), free_port()
        common = {
            "HOME": str(self.workdir / "home"),
            "TMPDIR": str(self.workdir / "tmp"),
            "PATH": f"{self.workdir / 'path'}{os.pathsep}{os.environ.get('PATH', '')}",
            "KUBECONFIG": str(self.cp.kubeconfig),
            "ARGOCD_FAKE_IN_CLUSTER": "true",
            "ARGOCD_GPG_ENABLED": "false",
            "ARGOCD_TLS_DATA_PATH": str(self.workdir / "tls"),
            "ARGOCD_CONTROLLER_REPLICAS": "1",
            "ARGOCD_CONTROLLER_SHARD": "0",
        }
        p = self.processes
        p.run(
            "redis",
            [
                redis,
                "--bind",
                "127.0.0.1",
                "--port",
                str(redis_port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            lambda: _redis_ok(redis_port),
        )
        p.run(
            "repo-server",
            [
                str(binary),
                "--address",
                "127.0.0.1",
                "--port",
                str(repo_port),
                "--metrics-address",
                "127.0.0.1",
                "--metrics-port",
                str(repo_metrics),
                "--redis",
                f"127.0.0.1:{redis_port}",
                "--disable-tls",
                "--loglevel",
                "info",
            ],
            lambda: _http_ok(f"http://127.0.0.1:{repo_metrics}/healthz"),
            env={**common, "ARGOCD_BINARY_NAME": "argocd-repo-server"},
        )
        p.run(
            "application-controller",
            [
                str(binary),
                "--kubeconfig",
                str(self.cp.kubeconfig),
                "--namespace",
                ARGOCD_NAMESPACE,
                "--repo-server",
                f"127.0.0.1:{repo_port}",
                "--repo-server-plaintext",
                "--redis",
                f"127.0.0.1:{redis_port}",
                "--metrics-port",
                str(self.metrics_port),
                "--status-processors",
                "4",
                "--operation-processors",
                "2",
                "--loglevel",
                "info",
                "--persist-resource-health",
            ],  # each resource's health in the Application, for the tests' messages
            lambda: _http_ok(f"http://127.0.0.1:{self.metrics_port}/healthz"),
            # timeout.reconciliation of argocd-cm, as Argo CD's StatefulSet passes it: how often
            # each Application is compared with its source (Argo CD's default: 120 s + up to 60 s).
            env={
                **common,
                "ARGOCD_BINARY_NAME": "argocd-application-controller",
                "ARGOCD_RECONCILIATION_TIMEOUT": reconciliation,
                "ARGOCD_RECONCILIATION_JITTER": "0s",
            },
        )
        p.wait_ready(max(1.0, timeout - (time.monotonic() - started)))
        self.start_seconds = time.monotonic() - started

    def stop(self) -> None:
        self.processes.stop()

    def rss(self) -> dict[str, int]:
        return self.processes.rss()

    # -- the cluster side --

    def apply(self, objects: list[dict]) -> None:
        apply(self.cp, objects)

    def trust(self, host: str, ca_pem: str) -> None:
        """Trust `ca_pem` for TLS to `host` (a registry or repository), as an entry of
        argocd-tls-certs-cm does: the repo-server reads them from ARGOCD_TLS_DATA_PATH, where
        a pod has that ConfigMap mounted."""
        self.apply(
            [
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": "argocd-tls-certs-cm", "namespace": ARGOCD_NAMESPACE},
                    "data": {host: ca_pem},
                }
            ]
        )
        (self.workdir / "tls" / host).write_text(ca_pem)

    def application(self, name: str) -> dict | None:
        api = self.cp.api()
        try:
            return client.CustomObjectsApi(api).get_namespaced_custom_object(*APPLICATIONS, name)
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def wait_application(self, name: str, check, timeout: float, what: str) -> dict:
        """Poll Application `name` until `check(app)` is truthy; AssertionError naming `what`
        and the Application's sync, health and conditions otherwise."""

        def state() -> dict | None:
            app = self.application(name)
            return app if app is not None and check(app) else None

        try:
            return eventually(state, timeout, what, interval=1)
        except AssertionError:
            raise AssertionError(
                f"Application {name}: timed out after {timeout:.0f} s waiting for {what}; "
                f"now {summary(self.application(name))}; logs in {self.workdir / 'logs'}"
            ) from None

    def metrics(self) -> dict[str, float]:
        """The application-controller's Prometheus metrics."""
        return scrape(f"http://127.0.0.1:{self.metrics_port}/metrics")


# Flux: helm-controller is not on the Go module proxy; `make e2e` builds it, with
# source-controller, where METAX_HELM_CONTROLLER_SOURCE names its source tarball
# (scripts/setup.d/35-flux, into FLUX_BUILD). Each of these, set, points at another build instead:
# a source-controller and a helm-controller binary, and a directory with both controllers' CRDs.
FLUX_ENV = ("METAX_SOURCE_CONTROLLER_BIN", "METAX_HELM_CONTROLLER_BIN", "METAX_FLUX_CRDS")
FLUX_BUILD = CACHE / "flux" / "current"
FLUX_NAMESPACE = "flux-system"
HELMRELEASES = ("helm.toolkit.fluxcd.io", "v2")


def flux_paths() -> dict[str, Path]:
    """The Flux controllers' binaries and CRDs, by FLUX_ENV name: the environment's, else the build's."""
    built = dict(
        zip(FLUX_ENV, (FLUX_BUILD / "source-controller", FLUX_BUILD / "helm-controller", FLUX_BUILD / "crds"), strict=True)
    )
    return {name: Path(os.environ.get(name) or built[name]) for name in FLUX_ENV}


def flux_unavailable() -> str | None:
    """Why the Flux controllers cannot run here (one line), or None."""
    for name, path in flux_paths().items():
        if not (path.is_dir() if name == "METAX_FLUX_CRDS" else os.access(path, os.X_OK)):
            if not os.environ.get(name):
                return (
                    f"no Flux build in {FLUX_BUILD}: helm-controller is not on the Go module proxy; make e2e builds"
                    " it where METAX_HELM_CONTROLLER_SOURCE names its source tarball (docs/gitops.md)"
                )
            return f"{name}={path} is not {'a directory' if name == 'METAX_FLUX_CRDS' else 'an executable'}"
    return None


@dataclass
class Flux:
    cp: ControlPlane
    processes: Processes
    metrics_ports: dict[str, int] = field(default_factory=dict)
    start_seconds: float = 0.0

    @property
    def workdir(self) -> Path:
        return self.processes.workdir

    @classmethod
    def start(cls, cp: ControlPlane, workdir: Path, timeout: float = 120) -> Flux:
        """Apply Flux's CRDs, start source-controller and helm-controller (binaries from
        FLUX_ENV) watching all namespaces, and return once both are ready."""
        reason = flux_unavailable()
        if reason:
            raise GitOpsError(reason)
        flux = cls(cp, Processes(Path(workdir)))
        try:
            flux._start(timeout)
        except BaseException:
            flux.stop()
            raise
        return flux

    def _start(self, timeout: float) -> None:
        started = time.monotonic()
        install_crds(self.cp, flux_paths()["METAX_FLUX_CRDS"], started + timeout)
        apply(self.cp, [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": FLUX_NAMESPACE}}])
        env = {
            "KUBECONFIG": str(self.cp.kubeconfig),
            "RUNTIME_NAMESPACE": FLUX_NAMESPACE,
            "HOME": str(self.workdir),
            "TMPDIR": str(self.workdir),
        }
        storage = free_port()
        (self.workdir / "storage").mkdir(parents=True, exist_ok=True)
        for name, extra in (
            (
                "source-controller",
                [
                    f"--storage-path={self.workdir / 'storage'}",
                    f"--storage-addr=127.0.0.1:{storage}",
                    f"--storage-adv-addr=127.0.0.1:{storage}",
                ],
            ),
            ("helm-controller", []),
        ):
            health, self.metrics_ports[name] = free_port(), free_port()
            self.processes.run(
                name,
                [
                    str(flux_paths()[f"METAX_{name.upper().replace('-', '_')}_BIN"]),
                    *extra,
                    f"--metrics-addr=127.0.0.1:{self.metrics_ports[name]}",
                    f"--health-addr=127.0.0.1:{health}",
                    "--enable-leader-election=false",
                    "--watch-all-namespaces=true",
                    "--log-level=info",
                ],
                lambda health=health: _http_ok(f"http://127.0.0.1:{health}/readyz"),
                env=env,
            )
        self.processes.wait_ready(max(1.0, timeout - (time.monotonic() - started)))
        self.start_seconds = time.monotonic() - started

    def stop(self) -> None:
        self.processes.stop()

    def rss(self) -> dict[str, int]:
        return self.processes.rss()

    def reconciles(self, release: str) -> int:
        """How many times helm-controller has reconciled HelmRelease `release`."""
        metrics = scrape(f"http://127.0.0.1:{self.metrics_ports['helm-controller']}/metrics")
        return int(
            sum(
                v
                for k, v in metrics.items()
                if k.startswith("gotk_reconcile_duration_seconds_count{")
                and 'kind="HelmRelease"' in k
                and f'name="{release}"' in k
            )
        )


def synced_healthy(app: dict) -> bool:
    status = app.get("status") or {}
    return (
        (status.get("sync") or {}).get("status") == "Synced"
        and (status.get("health") or {}).get("status") == "Healthy"
        and (status.get("operationState") or {}).get("phase") in (None, "Succeeded")
    )


def summary(app: dict | None) -> str:
    """One line: sync and health status, the last operation, and any conditions."""
    if app is None:
        return "no Application"
    status = app.get("status") or {}
    operation = status.get("operationState") or {}
    unhealthy = [
        f"{r['kind']}/{r['name']}: {(r.get('health') or {}).get('status')}"
        for r in status.get("resources") or []
        if (r.get("health") or {}).get("status") not in (None, "Healthy")
    ]
    out_of_sync = [f"{r['kind']}/{r['name']}" for r in status.get("resources") or [] if r.get("status") == "OutOfSync"]
    return json.dumps(
        {
            "sync": (status.get("sync") or {}).get("status"),
            "health": (status.get("health") or {}).get("status"),
            "operation": [operation.get("phase"), (operation.get("message") or "")[:300]],
            "unhealthy": unhealthy[:8],
            "outOfSync": out_of_sync[:8],
            "conditions": [c.get("message", "")[:300] for c in status.get("conditions") or []],
        }
    )
