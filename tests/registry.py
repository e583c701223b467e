"""The local OCI registry: the CNCF distribution registry (built by scripts/setup.d/30-registry)
on 127.0.0.1 with TLS from the control plane's CA, and the two ways things get into it, as a
user publishes them: `helm push` of the packaged chart, `skopeo copy` of an OCI image layout.

Clients trust it as they would any registry with a private CA: Helm through SSL_CERT_FILE (Go's
TLS reads it), skopeo through a certificate directory, the real node's containerd through a
`hosts.toml` naming the CA. So `helm install oci://127.0.0.1:PORT/...` needs neither
`--plain-http` nor `--insecure-skip-tls-verify`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
PROJECT = "metax"  # the registry path the chart and the images go under (the seed's PROJECT)
TOOLS_IMAGE = "metax-operator-tools"
APP_VERSION = yaml.safe_load((REPO / "Chart.yaml").read_text())["appVersion"]


class RegistryError(Exception):
    """A push failed; the message is one line with the tool's own error."""


def config(workdir: Path, port: int, cert: Path | None, key: Path | None) -> Path:
    """The registry's configuration file: storage in workdir, TLS (plain HTTP without a
    certificate), quiet logs."""
    http: dict = {"addr": f"127.0.0.1:{port}"}
    if cert is not None:
        http["tls"] = {"certificate": str(cert), "key": str(key)}
    path = workdir / "registry.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "version": 0.1,
                "log": {"level": "warn", "accesslog": {"disabled": True}},
                "storage": {"filesystem": {"rootdirectory": str(workdir / "registry")}, "delete": {"enabled": True}},
                "http": http,
            }
        )
    )
    return path


def trust_dir(ca: Path) -> Path:
    """A directory holding only the CA as `ca.crt`: what skopeo's --dest-cert-dir reads (it takes
    every *.crt there as a root)."""
    path = ca.parent / "registry-trust"
    path.mkdir(exist_ok=True)
    (path / "ca.crt").write_bytes(ca.read_bytes())
    return path


def helm_env(ca: Path) -> dict:
    """The environment under which Helm trusts the registry as any registry with a private CA."""
    return {**os.environ, "SSL_CERT_FILE": str(ca)}


def _run(command: list[str], what: str, env: dict | None = None) -> str:
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode:
        last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "no output")
        raise RegistryError(f"{what} failed: {last}")
    return done.stdout


def push_image(layout: Path, tag: str, target: str, ca: Path) -> None:
    """Copy the image tagged `tag` in the OCI image layout directory `layout` to `target`
    (`127.0.0.1:PORT/PROJECT/NAME:TAG`): every architecture of an index, digests kept."""
    _run(
        ["skopeo", "copy", "--quiet", "--all", "--preserve-digests", "--dest-cert-dir", str(trust_dir(ca))]
        + [f"oci:{layout}:{tag}", f"docker://{target}"],
        f"skopeo copy of {layout}:{tag} to {target}",
    )


def push_chart(helm: Path, chart: Path, host: str, ca: Path, workdir: Path) -> str:
    """`helm package` the chart directory, `helm push` it to oci://host/PROJECT; return the
    `oci://` reference a user installs."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = _run([str(helm), "package", str(chart), "-d", str(workdir)], "helm package")
    package = Path(out.strip().rsplit(": ", 1)[-1])
    _run([str(helm), "push", str(package), f"oci://{host}/{PROJECT}"], "helm push", env=helm_env(ca))
    return f"oci://{host}/{PROJECT}/{yaml.safe_load((chart / 'Chart.yaml').read_text())['name']}"


def build_tools_image() -> dict[str, str]:
    """`scripts/image build`: the tools image of this working tree, cached by a hash of every
    input (a warm call only checks); {layout, reference, digest} from its output."""
    done = subprocess.run([str(REPO / "scripts" / "image"), "build"], capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RegistryError(f"scripts/image build failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def publish(helm: Path, host: str, ca: Path, workdir: Path) -> dict[str, str]:
    """What a user publishes before the seed's install: the tools image (built from this tree) as
    `host/PROJECT/metax-operator-tools:APPVERSION` and the chart as `oci://host/PROJECT/...`.
    Returns {chart, image, digest, registry (the `registry` value to set)}."""
    image = build_tools_image()
    target = f"{host}/{PROJECT}/{TOOLS_IMAGE}:{APP_VERSION}"
    push_image(Path(image["layout"]), image["reference"].rsplit(":", 1)[1], target, ca)
    return {
        "chart": push_chart(helm, REPO, host, ca, workdir),
        "image": target,
        "digest": image["digest"],
        "registry": f"{host}/{PROJECT}",
    }
