"""`make package` (release/package.py): two builds of one commit are the same bytes; the package
has the shape of MetaX's (seed 001 §3.1.3): the images file `metax-k8s-images.VERSION.run` (the
tools image of both architectures and the command that pushes it) and the chart under `k8s/`,
with the image list `metax-operator images` gives, the SBOM and the CHANGELOG; a chart signed with
a key made for this run verifies under Helm 3 and Helm 4, and a tampered chart or another key fails
with Helm's sentence."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from urllib.parse import quote

import pytest
import yaml

from image.lock import locked_wheels
from metax_operator import cli
from release import package
from tests import image
from tests.helm import BIN, CHART_VERSION, HELM_VERSIONS, helm_path

TOP = f"metax-operator-package.{CHART_VERSION}"
CHART_TGZ = f"k8s/metax-operator-{CHART_VERSION}.tgz"
TOOLS_ARCHIVE = f"metax-operator-tools+{CHART_VERSION}.oci.tar"
RUN = package.RUN_NAME.format(version=CHART_VERSION)


@pytest.fixture(scope="session")
def tools_image() -> dict:
    return image.build()


def build(output: Path, tools_image: dict, sign: dict | None = None) -> Path:
    """The package as scripts/package builds it: with the tools image of this tree."""
    return package.build(package.REPO, output, str(helm_path("helm4")), sign, Path(tools_image["layout"]))


def members(path: Path) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(path) as archive:
        return {info.name: info for info in archive.getmembers()}


def read(path: Path, name: str) -> bytes:
    with tarfile.open(path) as archive:
        return archive.extractfile(f"{TOP}/{name}").read()


@pytest.fixture(scope="module")
def unsigned(tmp_path_factory, tools_image) -> Path:
    return build(tmp_path_factory.mktemp("package"), tools_image)


def test_two_builds_of_one_commit_are_the_same_bytes(unsigned, tools_image, tmp_path):
    again = build(tmp_path, tools_image)
    assert again.name == f"{TOP}.tar.gz"
    assert again.read_bytes() == unsigned.read_bytes()


def test_the_package_holds_the_release(unsigned):
    found = members(unsigned)
    assert set(found) == {
        TOP,
        f"{TOP}/k8s",
        *(f"{TOP}/{name}" for name in (CHART_TGZ, RUN, "images.txt", "images.json", "sbom.cdx.json", "CHANGELOG.md")),
    }
    assert {(i.uid, i.gid, i.mtime) for i in found.values()} == {(0, 0, package.source_date_epoch(package.REPO))}
    assert found[f"{TOP}/{RUN}"].mode == 0o755
    assert list(package.run_archives(read(unsigned, RUN))) == [TOOLS_ARCHIVE]
    with tarfile.open(fileobj=io.BytesIO(read(unsigned, CHART_TGZ))) as chart:
        meta = yaml.safe_load(chart.extractfile("metax-operator/Chart.yaml"))
        assert "metax-operator/templates/driver/daemonset.yaml" in chart.getnames()
    assert (meta["version"], meta["appVersion"]) == (CHART_VERSION, CHART_VERSION)
    assert read(unsigned, "CHANGELOG.md") == (package.REPO / "CHANGELOG.md").read_bytes()


def chart_files(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as chart:
        return {info.name: chart.extractfile(info).read() for info in chart.getmembers() if info.isfile()}


def test_the_chart_is_every_file_helm_package_of_the_checkout_keeps(unsigned, tmp_path):
    """files/ (the whole CRD the upgrade-crds hook applies) and alerts/ (the PrometheusRule's
    rules) too, so the package's chart renders with the hooks and the PrometheusRule on, as the
    checkout's chart does."""
    done = subprocess.run([helm_path("helm4"), "package", package.REPO, "--destination", tmp_path], capture_output=True)
    assert done.returncode == 0, done.stderr
    shipped = chart_files(read(unsigned, CHART_TGZ))
    assert shipped == chart_files((tmp_path / Path(CHART_TGZ).name).read_bytes())
    assert {
        "metax-operator/files/clusteroperators.gpu.metax-tech.com.yaml",
        "metax-operator/alerts/metax-operator-rules.yaml",
    } <= set(shipped)
    (tmp_path / "shipped.tgz").write_bytes(read(unsigned, CHART_TGZ))
    flags = [
        "--set",
        "registry=r.invalid/p",
        "--set",
        "driver.payload.version=2.32.0.6",
        "--set",
        "runner.prometheusRule.enabled=true",
    ]
    for helm in HELM_VERSIONS:
        render = [BIN / helm, "template", "site", tmp_path / "shipped.tgz", *flags]
        done = subprocess.run(render, capture_output=True, text=True)
        assert done.returncode == 0, f"{helm}: {done.stderr}"
        assert "kind: PrometheusRule" in done.stdout and "upgrade-crds" in done.stdout


def test_the_tools_image_archive_is_the_built_index_of_both_architectures(unsigned, tools_image, tmp_path):
    """What the images file pushes: an OCI archive whose one image is the index `make image` built,
    named as containerd, nerdctl and docker load it."""
    archive = tmp_path / TOOLS_ARCHIVE
    archive.write_bytes(package.run_archives(read(unsigned, RUN))[TOOLS_ARCHIVE])
    for arch in ("amd64", "arm64"):
        inspect = ["skopeo", "--override-arch", arch, "inspect", f"oci-archive:{archive}"]
        inspected = json.loads(subprocess.run(inspect, capture_output=True, text=True, check=True).stdout)
        assert (inspected["Digest"], inspected["Architecture"]) == (tools_image["digest"], arch)
    with tarfile.open(archive) as tar:
        index = json.load(tar.extractfile("index.json"))
        assert [m["digest"] for m in index["manifests"]] == [tools_image["digest"]]
        assert index["manifests"][0]["annotations"][package.CONTAINERD_NAME] == f"metax-operator-tools:{CHART_VERSION}"
        layout = Path(tools_image["layout"])
        blobs = {f"blobs/sha256/{path.name}" for path in (layout / "blobs/sha256").iterdir()}
        assert set(tar.getnames()) - {"blobs", "blobs/sha256"} == blobs | {"index.json", "oci-layout"}


def test_a_tools_image_layout_without_the_release_tag_is_refused(tmp_path):
    (tmp_path / "index.json").write_text('{"schemaVersion": 2, "manifests": []}')
    with pytest.raises(package.PackageError, match=f"holds no image tagged {CHART_VERSION}; run 'make image'"):
        package.tools_image_archive(tmp_path, CHART_VERSION, 0)
    with pytest.raises(package.PackageError, match="not an OCI image layout"):
        package.tools_image_archive(tmp_path / "missing", CHART_VERSION, 0)


def test_the_image_list_is_metax_operator_images_relative_to_the_registry(unsigned, capsys):
    assert cli.main(["images", "--helm", str(helm_path("helm4")), *package.LIST_VALUES]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed and all(ref.startswith(package.PLACEHOLDER_REGISTRY + "/") for ref in listed)
    relative = [ref.removeprefix(package.PLACEHOLDER_REGISTRY + "/") for ref in listed]
    assert read(unsigned, "images.txt").decode().splitlines() == relative
    assert f"metax-operator-tools:{CHART_VERSION}" in relative and f"data-exporter:{CHART_VERSION}" in relative
    entries = json.loads(read(unsigned, "images.json"))["images"]
    assert [e["image"] for e in entries] == relative
    assert all(e["name"] + ":" + e["tag"] == e["image"] for e in entries)


def test_the_sbom_names_the_release_and_every_locked_wheel(unsigned):
    bom = json.loads(read(unsigned, "sbom.cdx.json"))
    assert (bom["bomFormat"], bom["specVersion"], bom["metadata"]["component"]["version"]) == ("CycloneDX", "1.5", CHART_VERSION)
    listed = {
        (c["name"], c["version"], c["purl"].split("?file_name=")[1], c["hashes"][0]["content"])
        for c in bom["components"]
        if c["purl"].startswith("pkg:pypi/") and c["name"] != "metax-operator"
    }
    lock = package.REPO / "image" / "pylock.toml"
    locked = {(w.package, w.version, w.filename, w.sha256) for arch in ("amd64", "arm64") for w in locked_wheels(lock, arch)}
    assert listed == locked
    # the 5 compiled packages twice: charset-normalizer, google-re2, pysimdjson, pyyaml, rpds-py
    assert len(locked) == len({w.package for w in locked_wheels(lock)}) + 5


def test_the_images_file_refuses_a_target_that_is_not_domain_and_project(unsigned, tmp_path):
    script = tmp_path / RUN
    script.write_bytes(read(unsigned, RUN))
    script.chmod(0o755)
    for target, words in (("https://cr.example.com/metax", "without a scheme"), ("cr.example.com", "give DOMAIN/PROJECT")):
        done = subprocess.run([script, "push", target], capture_output=True, text=True)
        assert done.returncode == 2 and words in done.stderr, done.stderr
    done = subprocess.run([script, "podman", "push", "cr.example.com/metax"], capture_output=True, text=True)
    assert done.returncode == 2 and "usage:" in done.stderr
    done = subprocess.run([script, "list"], capture_output=True, text=True)
    assert done.stdout.splitlines() == [f"metax-operator-tools:{CHART_VERSION}"]


def gpg(home: Path, *args: str) -> bytes:
    return subprocess.run(
        ["gpg", "--batch", "--quiet", *args], check=True, capture_output=True, env={**os.environ, "GNUPGHOME": str(home)}
    ).stdout


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, Path]:
    """Two RSA signing keys made for this run (Helm 3 reads no EdDSA keys): the release's and
    another; their secret and public keyrings, binary, as Helm reads them."""
    if shutil.which("gpg") is None:
        pytest.fail("gpg is missing: run 'make e2e' (scripts/setup.d/30-release-tools)", pytrace=False)
    out = {}
    for who in ("release", "other"):
        home = tmp_path_factory.mktemp(f"gnupg-{who}")
        home.chmod(0o700)
        user = f"metax-operator {who} <{who}@example.invalid>"
        try:
            gpg(home, "--passphrase", "", "--quick-gen-key", user, "rsa3072", "sign", "never")
            out[f"{who}-secret"] = home.parent / f"{who}-secring.gpg"
            out[f"{who}-secret"].write_bytes(gpg(home, "--export-secret-keys"))
            out[f"{who}-public"] = home.parent / f"{who}-pubring.gpg"
            out[f"{who}-public"].write_bytes(gpg(home, "--export"))
        finally:  # gpg started an agent for the home: end it
            subprocess.run(["gpgconf", "--homedir", str(home), "--kill", "gpg-agent"], check=True)
    return out


@pytest.fixture(scope="module")
def signed(keys, tools_image, tmp_path_factory) -> Path:
    sign = {"name": "metax-operator release", "keyring": str(keys["release-secret"]), "public_key": str(keys["release-public"])}
    out = tmp_path_factory.mktemp("signed")
    package.unpack(build(out, tools_image, sign), out)
    return out / TOP


def verify(helm: str, chart: Path, keyring: Path) -> subprocess.CompletedProcess:
    return subprocess.run([BIN / helm, "verify", str(chart), "--keyring", str(keyring)], capture_output=True, text=True)


@pytest.mark.parametrize("helm", HELM_VERSIONS)
def test_the_signed_chart_verifies_with_the_shipped_key(signed, unsigned, helm):
    done = verify(helm, signed / CHART_TGZ, signed / "metax-operator-keyring.gpg")
    assert done.returncode == 0, done.stderr
    assert "Signed by: metax-operator release <release@example.invalid>" in done.stdout
    rebuilt = hashlib.sha256(read(unsigned, CHART_TGZ)).hexdigest()
    assert f"Chart Hash Verified: sha256:{rebuilt}" in done.stdout  # the unsigned rebuild is the signed chart


@pytest.mark.parametrize("helm", HELM_VERSIONS)
def test_a_tampered_chart_fails_verification_saying_so(signed, helm, tmp_path):
    tampered = tmp_path / Path(CHART_TGZ).name
    tampered.write_bytes((signed / CHART_TGZ).read_bytes() + b"\0")
    shutil.copyfile(signed / f"{CHART_TGZ}.prov", tmp_path / f"{tampered.name}.prov")
    done = verify(helm, tampered, signed / "metax-operator-keyring.gpg")
    assert done.returncode == 1
    assert f"Error: sha256 sum does not match for {tampered.name}" in done.stderr


@pytest.mark.parametrize("helm", HELM_VERSIONS)
def test_another_key_fails_verification_saying_so(signed, keys, helm):
    done = verify(helm, signed / CHART_TGZ, keys["other-public"])
    assert done.returncode == 1
    assert "signature made by unknown entity" in done.stderr, done.stderr


def test_the_sbom_names_every_debian_package_of_each_architecture_s_image(unsigned, tools_image):
    bom = json.loads(read(unsigned, "sbom.cdx.json"))
    listed = {
        (c["purl"].split("arch=")[1].split("&")[0], c["name"], c["version"])
        for c in bom["components"]
        if c["purl"].startswith("pkg:deb/debian/")
    }
    layout = Path(tools_image["layout"])
    for arch in ("amd64", "arm64"):
        contents = (layout.parent / f"contents-{arch}.txt").read_text()
        debian = contents.split("# Debian packages\n")[1].split("# Python distributions\n")[0].splitlines()
        packages = {(name.split(":")[0], version) for name, version in (line.split("\t") for line in debian)}
        assert {(name, version) for a, name, version in listed if a == arch} == packages, arch
        assert {"python3", "libstdc++6", "base-files"} <= {name for name, _ in packages}
    libc = next(c for c in bom["components"] if c["name"] == "libc6" and "arch=arm64" in c["purl"])
    assert libc["purl"] == f"pkg:deb/debian/libc6@{quote(libc['version'], safe='')}?arch=arm64&distro=debian-12"


def test_a_tools_image_layout_without_its_contents_lists_is_refused(tmp_path):
    (tmp_path / "oci").mkdir()
    with pytest.raises(package.PackageError, match="no contents-amd64.txt beside it"):
        package.debian_packages(tmp_path / "oci")
