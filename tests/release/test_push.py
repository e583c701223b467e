"""The package's `push` against a real OCI registry (the distribution registry, TLS from a CA made
for the test), as a site runs it: the chart goes to `oci://HOST/PROJECT` with its provenance, so
`helm pull --verify` against the shipped keyring passes, and the image archives beside the script
(the package's tools image, and one a site copies there) are pushed under their NAME+TAG."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from image import oci
from release import package
from tests.controlplane import free_port
from tests.helm import BIN, CHART_VERSION, helm_path
from tests.registry import config
from tests.release.test_package import CHART_TGZ, keys, signed, tools_image  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """(host:port, CA file): the distribution registry on 127.0.0.1 with a certificate of a CA made here."""
    binary = BIN / "registry"
    if not binary.exists():
        pytest.fail(f"{binary} is missing: run 'make e2e' (it builds the registry)", pytrace=False)
    work = tmp_path_factory.mktemp("registry")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=registry",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", "tls.key", "-out", "tls.crt"],
        cwd=work, check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    process = subprocess.Popen([binary, "serve", config(work, port, work / "tls.crt", work / "tls.key")], cwd=work)
    host = f"127.0.0.1:{port}"
    context = ssl.create_default_context(cafile=work / "tls.crt")
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"https://{host}/v2/", context=context, timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                pytest.fail("the registry did not answer within 30 s", pytrace=False)
            time.sleep(0.2)
    yield host, work / "tls.crt"
    process.terminate()
    process.wait(timeout=10)


def tiny_archive(directory: Path, name: str, tag: str) -> Path:
    """An OCI archive of a one-file image, as MetaX's image archives are copied beside `push`."""
    root = directory / "root"
    root.mkdir()
    (root / "hello").write_text("hello\n")
    layer = oci.write_layer(root, directory / "layer-blobs", 0)
    layout = directory / "layout"
    image = ([(oci.blob_path(directory / "layer-blobs", layer), layer)], {"architecture": "amd64", "os": "linux"})
    oci.write_layout(layout, {"amd64": image}, tag)
    archive = directory / f"{name}+{tag}.oci.tar"
    archive.write_bytes(package.plain_tar(oci.archive_files(layout, tag), {}, 0))
    return archive


def push_env(tmp_path: Path, ca: Path, **more: str) -> tuple[dict, Path]:
    """The environment a site with a private CA pushes and pulls under, and skopeo's cert dir."""
    certs = tmp_path / "certs"
    certs.mkdir(exist_ok=True)
    (certs / "ca.crt").write_bytes(ca.read_bytes())
    env = {
        **os.environ,
        "HELM": str(helm_path("helm4")),
        "SSL_CERT_FILE": str(ca),
        "SKOPEO_FLAGS": f"--dest-cert-dir {certs}",
        "HELM_CONFIG_HOME": str(tmp_path / "helm"),
        "HELM_CACHE_HOME": str(tmp_path / "helm-cache"),
        **more,
    }
    return env, certs


def pull(helm: str, ref: str, into: Path, env: dict, *flags: str) -> subprocess.CompletedProcess:
    into.mkdir()
    return subprocess.run(
        [BIN / helm, "pull", ref, "--version", CHART_VERSION, "--destination", into, *flags],
        capture_output=True, text=True, env=env,
    )  # fmt: skip


def test_push_puts_the_chart_and_the_archives_into_the_registry(signed, tools_image, registry, tmp_path):
    """By default the chart goes without its provenance, so Helm 3.18.0 pulls it too; the site
    verifies it from the package, and the pulled chart is that one, byte for byte."""
    host, ca = registry
    env, certs = push_env(tmp_path, ca)
    tiny_archive(tmp_path, "driver-image", "2.32.0.6").rename(signed / "driver-image+2.32.0.6.oci.tar")
    done = subprocess.run([signed / "push", f"{host}/site/metax"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    for helm in ("helm3", "helm4"):
        into = tmp_path / f"pulled-{helm}"
        done = pull(helm, f"oci://{host}/site/metax/metax-operator", into, env)
        assert done.returncode == 0, done.stderr
        assert (into / CHART_TGZ).read_bytes() == (signed / CHART_TGZ).read_bytes()
    inspect = subprocess.run(
        ["skopeo", "inspect", "--cert-dir", str(certs), f"docker://{host}/site/metax/driver-image:2.32.0.6"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert json.loads(inspect.stdout)["Architecture"] == "amd64"
    # The tools image: the index, both architectures, under the digest `make image` printed.
    tools = f"docker://{host}/site/metax/metax-operator-tools:{CHART_VERSION}"
    for arch in ("amd64", "arm64"):
        inspect = subprocess.run(
            ["skopeo", "--override-arch", arch, "inspect", "--cert-dir", str(certs), tools],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert (json.loads(inspect.stdout)["Digest"], json.loads(inspect.stdout)["Architecture"]) == (tools_image["digest"], arch)


def test_push_with_the_provenance_lets_helm_pull_verify(signed, registry, tmp_path):
    host, ca = registry
    env, _ = push_env(tmp_path, ca, PUSH_PROVENANCE="1")
    done = subprocess.run([signed / "push", f"{host}/signed/metax"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    keyring = signed / "metax-operator-keyring.gpg"
    done = pull("helm4", f"oci://{host}/signed/metax/metax-operator", tmp_path / "pulled", env, "--verify", "--keyring", keyring)
    assert done.returncode == 0, done.stderr
    assert "Signed by: metax-operator release <release@example.invalid>" in done.stderr + done.stdout
