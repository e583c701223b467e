"""The package's images file (`metax-k8s-images.VERSION.run`, seed 001 §3.1.3 step 3) against real
OCI registries (the distribution registry: with TLS from a CA made for the test, and without TLS)
and real runtimes, from an empty state: skopeo, and ctr with a containerd of its own (a fresh
root). Each pushes every architecture of each image under its NAME+TAG, the index's digest kept;
then the seed's step 4, `helm push ./k8s/metax-operator-VERSION.tgz`, and the chart as pulled is
the package's, byte for byte; a signed chart pushed so verifies at the registry under Helm 4.

nerdctl and docker are not on the test machine: their branches of the script are not run here;
nor is ctr's with TLS (ctr talks plain HTTP to any loopback registry by itself)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import ssl
import subprocess
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from image import oci
from release import package
from tests.controlplane import free_port
from tests.helm import BIN, CHART_VERSION
from tests.registry import config
from tests.release.test_package import CHART_TGZ, RUN, keys, signed, tools_image, unsigned  # noqa: F401 (fixtures)
from tests.waiting import eventually

pytestmark = pytest.mark.e2e  # it serves the registry that `make e2e` builds
ARCHES = ("amd64", "arm64")


def serve(work: Path, tls: bool) -> tuple[subprocess.Popen, str, Path | None]:
    """The distribution registry on 127.0.0.1, with a certificate of a CA made here when `tls`."""
    binary = BIN / "registry"
    if not binary.exists():
        pytest.fail(f"{binary} is missing: run 'make e2e' (it builds the registry)", pytrace=False)
    cert = key = None
    if tls:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=registry",
             "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", "tls.key", "-out", "tls.crt"],
            cwd=work, check=True, capture_output=True,
        )  # fmt: skip
        cert, key = work / "tls.crt", work / "tls.key"
    port = free_port()
    process = subprocess.Popen([binary, "serve", config(work, port, cert, key)], cwd=work)
    host = f"127.0.0.1:{port}"
    context = ssl.create_default_context(cafile=cert) if tls else None
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{'https' if tls else 'http'}://{host}/v2/", context=context, timeout=2)
            return process, host, cert
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                pytest.fail("the registry did not answer within 30 s", pytrace=False)
            time.sleep(0.2)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """(host:port, CA file): the registry behind TLS, as a site with a private CA has it."""
    process, host, ca = serve(tmp_path_factory.mktemp("registry"), tls=True)
    yield host, ca
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def plain_registry(tmp_path_factory) -> str:
    """host:port of the registry without TLS (plain HTTP)."""
    process, host, _ = serve(tmp_path_factory.mktemp("plain-registry"), tls=False)
    yield host
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def containerd():
    """The socket of a containerd of its own, on a fresh root (no CRI: ctr needs none). The root is
    a short directory of its own: a unix socket's path has at most 107 bytes, and pytest's
    tmp_path is long. containerd's log is in the failure when it does not come up."""
    binary = shutil.which("containerd")
    if binary is None:
        pytest.fail("containerd is missing: run 'make e2e' (it sets up the real node's runtime)", pytrace=False)
    root = Path(tempfile.mkdtemp(prefix="containerd-"))
    socket = root / "containerd.sock"
    (root / "config.toml").write_text(
        f'version = 2\nroot = "{root}/root"\nstate = "{root}/state"\n'
        f'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n[grpc]\n  address = "{socket}"\n'
    )
    log = root / "containerd.log"
    with log.open("wb") as sink:
        process = subprocess.Popen([binary, "--config", str(root / "config.toml")], stderr=sink)
    try:
        try:
            eventually(lambda: socket.exists() or process.poll() is not None, 60, "containerd's socket")
        except AssertionError as error:
            raise AssertionError(f"{error}; containerd's log ends:\n{log.read_text()[-3000:]}") from None
        assert process.poll() is None, f"containerd exited with {process.returncode}:\n{log.read_text()[-3000:]}"
        yield socket
    finally:
        process.terminate()
        process.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)


def tiny_archive(directory: Path, name: str, tag: str, arches=("amd64",)) -> Path:
    """An OCI archive of a one-file image, an index of `arches`."""
    root = directory / "root"
    root.mkdir(exist_ok=True)
    (root / "hello").write_text("hello\n")
    layer = oci.write_layer(root, directory / "layer-blobs", 0)
    layout = directory / f"layout-{name}"
    images = {
        arch: ([(oci.blob_path(directory / "layer-blobs", layer), layer)], {"architecture": arch, "os": "linux"})
        for arch in arches
    }
    oci.write_layout(layout, images, tag)
    archive = directory / f"{name}+{tag}.oci.tar"
    archive.write_bytes(package.plain_tar(oci.archive_files(layout, tag), {}, 0))
    return archive


def tiny_run(directory: Path) -> tuple[Path, str]:
    """An images file holding one image of both architectures; (its path, the index's digest)."""
    archive = tiny_archive(directory, "tiny-tools", "1.0", ARCHES)
    with tarfile.open(archive) as tar:
        (digest,) = [m["digest"] for m in json.load(tar.extractfile("index.json"))["manifests"]]
    run = directory / RUN
    run.write_bytes(package.images_run({archive.name: archive.read_bytes()}, CHART_VERSION, 0))
    run.chmod(0o755)
    return run, digest


def pushed(reference: str, *flags: str) -> dict[str, str]:
    """The image at `reference` as the registry serves it: its digest, and each architecture's."""
    raw = subprocess.run(["skopeo", "inspect", "--raw", *flags, f"docker://{reference}"], capture_output=True, check=True)
    digest = "sha256:" + hashlib.sha256(raw.stdout).hexdigest()
    index = json.loads(raw.stdout)
    return {"index": digest, **{m["platform"]["architecture"]: m["digest"] for m in index.get("manifests", [])}}


def push_env(tmp_path: Path, ca: Path, **more: str) -> tuple[dict, Path]:
    """The environment a site with a private CA pushes and pulls under, and skopeo's cert dir."""
    certs = tmp_path / "certs"
    certs.mkdir(exist_ok=True)
    (certs / "ca.crt").write_bytes(ca.read_bytes())
    env = {
        **os.environ,
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


def site(package_file: Path, into: Path) -> Path:
    """The package unpacked at the site (step 1)."""
    package.unpack(package_file, into)
    return into / f"{package.PACKAGE_PREFIX}{CHART_VERSION}"


def test_the_package_pushes_its_images_and_then_its_chart_as_the_seed_s_steps_3_and_4(unsigned, tools_image, registry, tmp_path):
    host, ca = registry
    env, certs = push_env(tmp_path, ca)
    here = site(unsigned, tmp_path / "site")
    target = f"{host}/site/metax"
    done = subprocess.run([f"./{RUN}", "push", target], cwd=here, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert f"pushing {target}/metax-operator-tools:{CHART_VERSION} (skopeo)" in done.stdout  # the first runtime found
    image = pushed(f"{target}/metax-operator-tools:{CHART_VERSION}", "--cert-dir", str(certs))
    assert image == {"index": tools_image["digest"], **{arch: tools_image[f"digest-{arch}"] for arch in ARCHES}}
    # Step 4, as printed (and as the images file says next), with Helm 3.
    step4 = [BIN / "helm3", "push", f"./{CHART_TGZ}", f"oci://{target}"]
    done = subprocess.run(step4, cwd=here, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    for helm in ("helm3", "helm4"):
        into = tmp_path / f"pulled-{helm}"
        done = pull(helm, f"oci://{target}/metax-operator", into, env)
        assert done.returncode == 0, done.stderr
        assert (into / Path(CHART_TGZ).name).read_bytes() == (here / CHART_TGZ).read_bytes()


def test_a_signed_chart_pushed_by_step_4_verifies_at_the_registry_under_helm4(signed, registry, tmp_path):
    """`helm push` takes the provenance beside the chart (k8s/), so Helm 4 verifies at the
    registry. (Helm 3.18.0 cannot pull a chart pushed with its provenance, helm/helm#30890:
    docs/release.md says to verify from the package then.)"""
    host, ca = registry
    env, _ = push_env(tmp_path, ca)
    done = subprocess.run(
        [BIN / "helm4", "push", f"./{CHART_TGZ}", f"oci://{host}/signed/metax"],
        cwd=signed,
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    keyring = signed / "metax-operator-keyring.gpg"
    done = pull("helm4", f"oci://{host}/signed/metax/metax-operator", tmp_path / "pulled", env, "--verify", "--keyring", keyring)
    assert done.returncode == 0, done.stderr
    assert "Signed by: metax-operator release <release@example.invalid>" in done.stderr + done.stdout


def test_skopeo_pushes_every_architecture_into_a_plain_http_registry(plain_registry, tmp_path):
    run, digest = tiny_run(tmp_path)
    done = subprocess.run(
        [run, "skopeo", "push", f"{plain_registry}/plain/metax", "--plain-http"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    image = pushed(f"{plain_registry}/plain/metax/tiny-tools:1.0", "--tls-verify=false")
    assert image["index"] == digest and set(image) == {"index", *ARCHES}


def test_ctr_pushes_every_architecture_from_an_empty_containerd(containerd, plain_registry, tmp_path):
    run, digest = tiny_run(tmp_path)
    env = {**os.environ, "CONTAINERD_ADDRESS": str(containerd)}
    target = f"{plain_registry}/ctr/metax"
    done = subprocess.run([run, "ctr", "push", target, "--plain-http"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    image = pushed(f"{target}/tiny-tools:1.0", "--tls-verify=false")
    assert image["index"] == digest and set(image) == {"index", *ARCHES}
    left = subprocess.run(["ctr", "-n", "metax-push", "images", "ls", "-q"], capture_output=True, text=True, env=env)
    assert left.returncode == 0 and left.stdout == "", "the images file leaves nothing in containerd"


def test_without_any_runtime_it_names_them(tmp_path):
    """On a machine with none of skopeo, nerdctl, ctr and docker: one line, nothing pushed."""
    run, _ = tiny_run(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "awk", "tail", "tar", "mktemp", "rm", "basename", "sed"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    done = subprocess.run(["sh", run, "push", "cr.example.com/metax"], capture_output=True, text=True, env={"PATH": str(bin_dir)})
    assert done.returncode == 1
    assert done.stderr == (
        "error: none of skopeo, nerdctl, ctr, docker is on PATH: install one, or push from a machine that has one\n"
    )
