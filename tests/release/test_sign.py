"""The tools image signed with cosign and its SBOM attested (`scripts/release sign-image`), then
verified as a site verifies it, against a real OCI registry and with no network but loopback: the
maintainer pushes the package to the release registry and signs the image there by digest with a
key pair made for this run; the signed package carries the signature, the attestation and the
public key, and the site's `push` puts them into its own registry beside the image. There the
released digest verifies, and so does each architecture's manifest the index lists (the digest a
runtime that resolves the index pins), and the attested SBOM is the package's, byte for byte as
JSON; another image pushed under the release's tag, and another key, fail saying so."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from release import package, sign
from tests.helm import BIN, CHART_VERSION, helm_path
from tests.release.test_package import RUN, TOP, keys, tools_image  # noqa: F401 (fixtures)
from tests.release.test_push import push_env, registry, tiny_archive  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.long_build, pytest.mark.xdist_group("cosign")]
COSIGN = BIN / "cosign"
PASSWORD = "release password"
NAME = "metax-operator-tools"
ARCHES = ("amd64", "arm64")


def cosign_env(ca: Path, tmp: Path) -> dict:
    """cosign as an offline site runs it: trusting the registry's CA; anything but the loopback
    registry goes to a proxy that refuses (so a call to the public Sigstore fails the test),
    and no TUF cache of the user's."""
    return {
        **os.environ,
        "SSL_CERT_FILE": str(ca),
        "COSIGN_PASSWORD": PASSWORD,
        "HTTPS_PROXY": "http://127.0.0.1:9",
        "HTTP_PROXY": "http://127.0.0.1:9",
        "NO_PROXY": "127.0.0.1",
        "TUF_ROOT": str(tmp / "tuf"),
        "DOCKER_CONFIG": str(tmp / "docker"),
    }


@pytest.fixture(scope="module")
def cosign_keys(tmp_path_factory) -> dict[str, Path]:
    """Two cosign key pairs made for this run, each a directory with cosign.key and cosign.pub:
    the release's and another."""
    if not COSIGN.exists():
        pytest.fail(f"{COSIGN} is missing: run 'make e2e' (scripts/setup.d/30-cosign builds it)", pytrace=False)
    out = {}
    for who in ("release", "other"):
        out[who] = tmp_path_factory.mktemp(f"cosign-{who}")
        env = {**os.environ, "COSIGN_PASSWORD": PASSWORD}
        subprocess.run([COSIGN, "generate-key-pair"], cwd=out[who], env=env, check=True, capture_output=True)
    return out


def entries(archive: Path) -> dict[str, tuple]:
    """Each member of a package: its owner, time, mode and content."""
    with tarfile.open(archive) as tar:
        return {
            i.name: (i.uid, i.gid, i.mtime, i.mode, tar.extractfile(i).read() if i.isfile() else None) for i in tar.getmembers()
        }


def extract(archive: Path, into: Path) -> Path:
    package.unpack(archive, into)
    return into / TOP


@pytest.fixture(scope="module")
def released(keys, cosign_keys, tools_image, registry, tmp_path_factory) -> dict:
    """The maintainer's release: the package (chart signed with GnuPG) pushed to the release
    registry, its tools image signed there and the SBOM attested; then the site's push of the
    signed package into its registry. Returns what the site has."""
    host, ca = registry
    work = tmp_path_factory.mktemp("release")
    gpg = {"name": "metax-operator release", "keyring": str(keys["release-secret"]), "public_key": str(keys["release-public"])}
    built = package.build(package.REPO, work / "dist", str(helm_path("helm4")), gpg, Path(tools_image["layout"]))
    unsigned = entries(built)
    env, _ = push_env(work, ca)
    maintainer = extract(built, work / "maintainer")
    done = subprocess.run([maintainer / RUN, "push", f"{host}/release/metax"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    sign_env = {**cosign_env(ca, work), "COSIGN": str(COSIGN)}
    key = cosign_keys["release"] / "cosign.key"
    command = [package.REPO / "scripts/release", "sign-image", "--key", key, f"{host}/release/metax", built]
    done = subprocess.run(command, capture_output=True, text=True, env=sign_env)
    assert done.returncode == 0, done.stderr
    signed = f"{host}/release/metax/{NAME}@"
    assert done.stdout.splitlines() == [signed + tools_image["digest"]] + [
        f"{signed}{tools_image[f'digest-{arch}']} linux/{arch}" for arch in ARCHES
    ]
    site = extract(built, work / "site")
    done = subprocess.run([site / RUN, "push", f"{host}/site/metax"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return {
        "package": built,
        "unsigned": unsigned,
        "dir": site,
        "host": host,
        "ca": ca,
        "env": env,
        "cosign_env": cosign_env(ca, work),
    }


def cosign(released: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([COSIGN, *args], capture_output=True, text=True, env=released["cosign_env"], timeout=120)


def verify(released: dict, reference: str, key: Path) -> subprocess.CompletedProcess:
    return cosign(released, "verify", "--key", str(key), "--insecure-ignore-tlog=true", reference)


def attestation(released: dict, reference: str, key: Path) -> subprocess.CompletedProcess:
    """`cosign verify-attestation` of the SBOM, as docs/release.md gives it."""
    return cosign(
        released, "verify-attestation", "--key", str(key), "--insecure-ignore-tlog=true", "--type", "cyclonedx", reference
    )


def test_the_signed_package_carries_the_signature_the_attestation_and_the_public_key(released, cosign_keys, tools_image):
    """The images file holds the signatures and the attestation beside the tools image, the
    package the public key; the rest is what the unsigned package held, unchanged (the chart's
    GnuPG keyring among it), written as it was: owner 0:0, the package's one time."""
    hexes = [tools_image[key].removeprefix("sha256:") for key in ("digest", *(f"digest-{arch}" for arch in ARCHES))]
    signed, unsigned = entries(released["package"]), released["unsigned"]
    images = f"{TOP}/{RUN}"
    assert set(signed) == set(unsigned) | {f"{TOP}/cosign.pub"} and f"{TOP}/metax-operator-keyring.gpg" in unsigned
    assert {name: signed[name] for name in unsigned if name != images} == {n: e for n, e in unsigned.items() if n != images}
    added = {f"{NAME}+sha256-{hex_digest}.sig.oci.tar" for hex_digest in hexes} | {f"{NAME}+sha256-{hexes[0]}.att.oci.tar"}
    before, after = package.run_archives(unsigned[images][4]), package.run_archives(signed[images][4])
    assert set(after) == set(before) | added
    assert {name: after[name] for name in before} == before
    (epoch,) = {e[2] for e in unsigned.values()}
    assert {e[:3] for e in signed.values()} == {(0, 0, epoch)}
    assert (released["dir"] / "cosign.pub").read_bytes() == (cosign_keys["release"] / "cosign.pub").read_bytes()


def test_the_site_verifies_the_released_digest_and_the_tag_that_names_it(released, tools_image):
    key = released["dir"] / "cosign.pub"
    digest = tools_image["digest"]
    for reference in (f"{released['host']}/site/metax/{NAME}@{digest}", f"{released['host']}/site/metax/{NAME}:{CHART_VERSION}"):
        done = verify(released, reference, key)
        assert done.returncode == 0, done.stderr
        (claim,) = json.loads(done.stdout)
        assert claim["critical"]["image"]["docker-manifest-digest"] == digest
        assert "The signatures were verified against the specified public key" in done.stderr


def test_the_site_verifies_each_architecture_s_manifest(released, tools_image):
    """By the digest a runtime pins once it has resolved the index for its node: a signature of
    its own, which the package carried to the site's registry."""
    key = released["dir"] / "cosign.pub"
    for arch in ARCHES:
        digest = tools_image[f"digest-{arch}"]
        done = verify(released, f"{released['host']}/site/metax/{NAME}@{digest}", key)
        assert done.returncode == 0, done.stderr
        (claim,) = json.loads(done.stdout)
        assert claim["critical"]["image"]["docker-manifest-digest"] == digest
        assert "The signatures were verified against the specified public key" in done.stderr


def test_the_attested_sbom_is_the_package_s(released, tools_image):
    reference = f"{released['host']}/site/metax/{NAME}@{tools_image['digest']}"
    done = attestation(released, reference, released["dir"] / "cosign.pub")
    assert done.returncode == 0, done.stderr
    (envelope,) = [json.loads(line) for line in done.stdout.splitlines()]
    statement = json.loads(base64.b64decode(envelope["payload"]))
    assert statement["predicateType"] == "https://cyclonedx.org/bom"
    assert [s["digest"]["sha256"] for s in statement["subject"]] == [tools_image["digest"].removeprefix("sha256:")]
    assert statement["predicate"] == json.loads((released["dir"] / "sbom.cdx.json").read_bytes())


def test_another_image_under_the_release_tag_fails_verification(released, tmp_path):
    """A re-tagged image: the site's registry serves another image under the release's tag."""
    host = released["host"]
    done = subprocess.run(
        [released["dir"] / RUN, "push", f"{host}/retag/metax"], capture_output=True, text=True, env=released["env"]
    )
    assert done.returncode == 0, done.stderr
    other = tiny_archive(tmp_path, NAME, CHART_VERSION)
    certs = tmp_path / "certs"
    certs.mkdir()
    (certs / "ca.crt").write_bytes(released["ca"].read_bytes())
    subprocess.run(
        ["skopeo", "copy", "--quiet", "--dest-cert-dir", str(certs), f"oci-archive:{other}", f"docker://{host}/retag/metax/{NAME}:{CHART_VERSION}"],
        check=True, capture_output=True,
    )  # fmt: skip
    done = verify(released, f"{host}/retag/metax/{NAME}:{CHART_VERSION}", released["dir"] / "cosign.pub")
    assert done.returncode != 0
    assert "no signatures found" in done.stderr, done.stderr


def test_another_key_fails_verification_saying_so(released, cosign_keys, tools_image):
    reference = f"{released['host']}/site/metax/{NAME}@{tools_image['digest']}"
    other = cosign_keys["other"] / "cosign.pub"
    done = verify(released, reference, other)
    assert done.returncode != 0
    assert "no matching signatures" in done.stderr, done.stderr
    done = attestation(released, reference, other)
    assert done.returncode != 0
    assert "no matching attestations" in done.stderr, done.stderr
    for arch in ARCHES:
        done = verify(released, f"{released['host']}/site/metax/{NAME}@{tools_image[f'digest-{arch}']}", other)
        assert done.returncode != 0
        assert "no matching signatures" in done.stderr, done.stderr


def test_sign_image_refuses_a_package_without_the_tools_image_and_a_registry_without_project(tmp_path, capsys):
    with pytest.raises(sign.SignError, match="holds no tools image archive: build it with scripts/package"):
        sign.tools_image({f"{TOP}/sbom.cdx.json": b"{}"})
    with pytest.raises(SystemExit):
        sign.main(["--key", "cosign.key", "cr.example.com", str(tmp_path / "package.tar.gz")])
    assert "give DOMAIN/PROJECT without a scheme" in capsys.readouterr().err


def test_sign_image_refuses_an_image_not_pushed_yet(released, cosign_keys, tools_image, tmp_path):
    """The maintainer forgot the push: one line naming it, and the package is left as it was."""
    unsigned = tmp_path / "package.tar.gz"
    unsigned.write_bytes(released["package"].read_bytes())
    target = f"{released['host']}/empty/metax"
    command = [package.REPO / "scripts/release", "sign-image", "--key", cosign_keys["release"] / "cosign.key", target, unsigned]
    done = subprocess.run(command, capture_output=True, text=True, env={**released["cosign_env"], "COSIGN": str(COSIGN)})
    assert done.returncode == 1
    reference = f"{target}/{NAME}@{tools_image['digest']}"
    assert done.stderr == f"error: {reference} is not in the registry: run the package's push to {target} first\n"
    assert unsigned.read_bytes() == released["package"].read_bytes()
