"""`scripts/release sign-image`: signs the tools image of an offline package in the registry it
was pushed to, attests its SBOM, and puts both and the public key into the package.

    COSIGN_PASSWORD=... scripts/release sign-image --key cosign.key DOMAIN/PROJECT PACKAGE.tar.gz

The package's images file (`metax-k8s-images.VERSION.run push`) has put the tools image into
DOMAIN/PROJECT (digests kept). This signs it by
the digest the package holds (never by a tag, which may have moved since), with the key pair and
no transparency log (an offline site has no Rekor to check against): `cosign sign --recursive`,
which signs the index and each architecture's manifest (the digest a runtime or an admission
policy that resolves the index checks), then `cosign attest --type cyclonedx` of the package's
sbom.cdx.json on the index, a signed in-toto statement. Then it copies cosign's signature images
(tag `sha256-HEX.sig`, one per digest) and the attestation image (`sha256-HEX.att`) out of the
registry into the package's images file as OCI archives, `NAME+sha256-HEX.sig.oci.tar` and `.att`,
which it pushes under those tags into the site's registry beside the image, with `cosign.pub` in
the package; the site verifies after its push (docs/release.md). The package is rewritten as package.py writes it
(sorted, 0:0, its files' time). Prints each signed reference: the index, then each architecture's
manifest followed by its platform.

The registry is reached as cosign and skopeo reach it: their logins, SSL_CERT_FILE for a private CA.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from image import oci
from release.package import PACKAGE_PREFIX, images_run, plain_tar, reproducible_tar, run_archives

#: The SBOM's predicate type for `cosign attest`/`verify-attestation`: https://cyclonedx.org/bom.
PREDICATE = "cyclonedx"
#: No transparency log (an offline site has no Rekor to check an entry against) and no prompt.
OFFLINE = ("--tlog-upload=false", "--yes")


class SignError(Exception):
    """The image cannot be signed; the message says why and the fix."""


def run(command: list[str], what: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "no output")
        raise SignError(f"{what} failed: {last}")
    return done.stdout


def read_package(path: Path) -> tuple[dict[str, bytes], dict[str, int], int]:
    """The package's files (name -> content), their modes and their one mtime."""
    if not path.is_file():
        raise SignError(f"{path}: no such file; give the package 'make package' wrote in dist/")
    files, modes, times = {}, {}, set()
    with tarfile.open(path) as archive:
        for info in archive.getmembers():
            times.add(info.mtime)
            if info.isfile():
                files[info.name] = archive.extractfile(info).read()
                modes[info.name] = info.mode
    return files, modes, min(times)


def images_file(files: dict[str, bytes]) -> str:
    """The path of the package's images file (package.RUN_NAME)."""
    found = [name for name in files if name.count("/") == 1 and name.endswith(".run")]
    if len(found) != 1:
        raise SignError("the package holds no images file: build it with scripts/package")
    return found[0]


def tools_image(archives: dict[str, bytes]) -> tuple[str, str, dict[str, str]]:
    """(the tools image's name, the digest of its index, and each manifest's digest the index
    lists -> its platform, OS/ARCH) from the archive NAME+TAG.oci.tar of the images file."""
    found = [name for name in archives if name.endswith(".oci.tar") and "+sha256-" not in name]
    if len(found) != 1:
        raise SignError("the package holds no tools image archive: build it with scripts/package (it builds the image)")
    with tarfile.open(fileobj=io.BytesIO(archives[found[0]])) as archive:
        (descriptor,) = json.load(archive.extractfile("index.json"))["manifests"]
        index = json.load(archive.extractfile(f"blobs/sha256/{descriptor['digest'].removeprefix('sha256:')}"))
    platforms = {m["digest"]: f"{m['platform']['os']}/{m['platform']['architecture']}" for m in index["manifests"]}
    return found[0].split("+", 1)[0], descriptor["digest"], platforms


def fetch_archive(skopeo: str, source: str, tag: str, epoch: int, work: Path) -> bytes:
    """The image at `source` (docker://...) as an OCI archive of the package's kind: its one image
    tagged `tag`, the files' time `epoch`."""
    layout = work / tag
    run([skopeo, "copy", "--quiet", "--preserve-digests", source, f"oci:{layout}:{tag}"], f"skopeo copy of {source}")
    return plain_tar(oci.archive_files(layout, tag), {}, epoch)


def sign(package: Path, registry: str, key: str, cosign: str, skopeo: str) -> list[str]:
    """Sign the package's tools image in `registry` (DOMAIN/PROJECT), its index and each
    architecture's manifest, attest its index and rewrite the package with the signatures, the
    attestation and the public key; returns the signed references, each platform's followed by it."""
    for tool in (cosign, skopeo):
        if shutil.which(tool) is None:
            raise SignError(
                f"{tool} is missing: run scripts/setup.d/30-cosign and scripts/setup.d/30-image-tools to install them"
            )
    if "://" not in key and "COSIGN_PASSWORD" not in os.environ:  # a key file, not a KMS URI
        raise SignError("COSIGN_PASSWORD is not set: export the key's password (empty for a key without one)")
    files, modes, epoch = read_package(package)
    images_path = images_file(files)
    top = images_path.split("/", 1)[0]
    archives = run_archives(files[images_path])
    name, digest, platforms = tools_image(archives)
    registry = registry.rstrip("/")
    reference = f"{registry}/{name}@{digest}"
    hex_digest = digest.removeprefix("sha256:")
    with tempfile.TemporaryDirectory(prefix="metax-sign-") as tmp:
        work = Path(tmp)
        sbom = work / "sbom.cdx.json"
        sbom.write_bytes(files[f"{top}/sbom.cdx.json"])
        try:
            run([skopeo, "inspect", "--raw", f"docker://{reference}"], f"skopeo inspect of {reference}")
        except SignError as err:
            if "manifest unknown" not in str(err):
                raise
            raise SignError(f"{reference} is not in the registry: run the package's push to {registry} first") from None
        run([cosign, "sign", "--key", key, "--recursive", *OFFLINE, reference], f"cosign sign of {reference}")
        run(
            [cosign, "attest", "--key", key, *OFFLINE, "--type", PREDICATE, "--predicate", str(sbom), reference],
            f"cosign attest of {reference}",
        )
        tags = [f"sha256-{hex_digest}.att"] + [f"{signed.replace(':', '-')}.sig" for signed in (digest, *platforms)]
        for tag in tags:
            archives[f"{name}+{tag}.oci.tar"] = fetch_archive(skopeo, f"docker://{registry}/{name}:{tag}", tag, epoch, work)
        files[images_path] = images_run(archives, top.removeprefix(PACKAGE_PREFIX), epoch)
        files[f"{top}/cosign.pub"] = run([cosign, "public-key", "--key", key], "cosign public-key").encode()
    package.write_bytes(reproducible_tar(files, modes, epoch))
    return [reference] + [f"{registry}/{name}@{manifest} {platform}" for manifest, platform in platforms.items()]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/release sign-image", description=__doc__.splitlines()[0])
    parser.add_argument("--key", required=True, help="cosign's private key: a file (cosign generate-key-pair) or a KMS URI")
    parser.add_argument("registry", metavar="DOMAIN/PROJECT", help="where the package's push put the tools image")
    parser.add_argument("package", help="the offline package (dist/metax-operator-package.VERSION.tar.gz), rewritten")
    parser.add_argument("--cosign", default=os.environ.get("COSIGN", "cosign"), help="cosign (default: $COSIGN, else on PATH)")
    parser.add_argument("--skopeo", default=os.environ.get("SKOPEO", "skopeo"), help="skopeo (default: $SKOPEO, else on PATH)")
    args = parser.parse_args(argv)
    if "://" in args.registry or "/" not in args.registry.strip("/"):
        parser.error(f"{args.registry}: give DOMAIN/PROJECT without a scheme, e.g. cr.example.com/metax")
    try:
        print(*sign(Path(args.package), args.registry, args.key, args.cosign, args.skopeo), sep="\n")
    except SignError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
