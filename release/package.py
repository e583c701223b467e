"""`make package`: the offline package of a release, the same bytes from the same commit.

    scripts/package [--output DIR] [--sign NAME --keyring SECRING --public-key FILE]
    python -m release.package [--tools-image LAYOUT] ...

writes DIR/metax-operator-package.VERSION.tar.gz (default DIR: dist/), in the shape of the MetaX
package seed 001 §3.1.3 installs from, holding under metax-operator-package.VERSION/:

    metax-k8s-images.VERSION.run      the images and the command that pushes them (step 3):
                                      `./metax-k8s-images.VERSION.run [skopeo|nerdctl|ctr|docker]
                                      push DOMAIN/PROJECT [--plain-http]`; the tools image, both
                                      architectures (an OCI archive of the index `make image`
                                      built; scripts/package builds it and passes its layout as
                                      --tools-image), and its signatures once signed (sign.py)
    k8s/metax-operator-VERSION.tgz    the chart, as `helm package` writes it (steps 4 and 5)
    k8s/metax-operator-VERSION.tgz.prov
                                      its provenance (with --sign: `helm package --sign`)
    metax-operator-keyring.gpg        the public key that verifies it, as the OpenPGP keyring
                                      `helm verify --keyring` reads (with --sign)
    images.txt, images.json           the images the chart pulls, relative to the site's registry
                                      (`metax-operator images` with every component deployed)
    sbom.cdx.json                     CycloneDX SBOM: the chart, the Python package, and the
                                      Python wheels (image/pylock.toml) and Debian packages of
                                      the tools image, per architecture
    CHANGELOG.md

Runs with the project's .venv (`python -m release.package` from the repository: it renders the
chart for the image list as `metax-operator images` does).

Reproducible: every file of the chart and of the package gets the commit's time (or
$SOURCE_DATE_EPOCH) as its mtime, owner 0:0 and a fixed mode; entries are sorted; gzip records no
time or name. Helm 4 writes the chart's archive from its files' mtimes, so it is reproducible
too. A signature is not (it records when it was made): the provenance names the chart archive's
sha256, which a rebuild of the commit gives again.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from urllib.parse import quote

import yaml

from image import oci
from image.lock import MACHINES, locked_wheels
from metax_operator.chart import image_list, images, validate
from metax_operator.errors import UserError, UserErrors

REPO = Path(__file__).resolve().parent.parent
CHART = "metax-operator"  # the chart's name, and the Python package's
PACKAGE_PREFIX = "metax-operator-package."  # the package's name and top directory: PREFIX + VERSION
CHART_DIR = "k8s"  # where the package holds the chart, as seed 001 §3.1.3 steps 4 and 5 name it
CONTAINERD_NAME = "io.containerd.image.name"
#: The registry the image list is rendered for, then cut off: the list is relative to the site's.
PLACEHOLDER_REGISTRY = "registry.invalid/project"
#: Every component deployed, the payloads left out (the site picks their versions at install).
LIST_VALUES = ("--set", f"registry={PLACEHOLDER_REGISTRY}", "--set", "exporter.deploy=true", "--set", "driver.deployPolicy=Never")
#: The images' file (seed 001 §3.1.3 step 3's `metax-k8s-images.VERSION.run`): this shell header,
#: then a tar of the OCI image archives NAME+TAG.oci.tar it pushes. Each archive's index names its
#: image NAME:TAG for the runtimes that load an archive before they push (`io.containerd.image.name`).
RUN_NAME = "metax-k8s-images.{version}.run"
RUN_MARKER = b"\n__IMAGES__\n"
RUN = """#!/bin/sh
# metax-k8s-images.{version}.run: the images of metax-operator {version} (the tools image, and its
# signatures when the release is signed), and the command that pushes them into a registry
# (docs/release.md, "The offline package"):
#
#   ./metax-k8s-images.{version}.run [skopeo|nerdctl|ctr|docker] push DOMAIN/PROJECT [--plain-http]
#   ./metax-k8s-images.{version}.run list
#
# Each image goes to DOMAIN/PROJECT/NAME:TAG with every architecture it holds. Without a runtime
# named, the first found of skopeo, nerdctl, ctr and docker: the first three push every
# architecture of an image; docker pushes those its image store holds (the containerd image store
# holds all, the classic one only this machine's). --plain-http: a registry without TLS (docker
# takes it from its daemon's insecure-registries). Extra flags for the runtime's push (a private
# CA, credentials): SKOPEO_FLAGS (e.g. --dest-cert-dir DIR), CTR_FLAGS (e.g. --tlscacert CA),
# NERDCTL_FLAGS, DOCKER_FLAGS; ctr and nerdctl work in the containerd namespace metax-push
# (CONTAINERD_ADDRESS names another socket).
set -eu
self=$0
usage() {{ echo "usage: $self [skopeo|nerdctl|ctr|docker] push DOMAIN/PROJECT [--plain-http] | $self list" >&2; exit 2; }}
runtime=
case ${{1:-}} in skopeo|nerdctl|ctr|docker) runtime=$1; shift ;; esac
images() {{ tail -n +"$(($(awk '/^__IMAGES__$/ {{ print NR; exit }}' "$self") + 1))" "$self"; }}
case ${{1:-}} in
  list) images | tar -t | sed -n 's/+\\(.*\\)\\.oci\\.tar$/:\\1/p'; exit 0 ;;
  push) [ $# -ge 2 ] || usage ;;
  *) usage ;;
esac
target=${{2%/}}
plain=
case ${{3:-}} in --plain-http) plain=1 ;; '') ;; *) usage ;; esac
case $target in
  *://*) echo "error: $2: give the registry without a scheme, e.g. cr.example.com/metax" >&2; exit 2 ;;
  */*) ;;
  *) echo "error: $2: give DOMAIN/PROJECT, e.g. cr.example.com/metax" >&2; exit 2 ;;
esac
if [ -z "$runtime" ]; then
  for candidate in skopeo nerdctl ctr docker; do
    if command -v "$candidate" >/dev/null 2>&1; then runtime=$candidate; break; fi
  done
  [ -n "$runtime" ] || {{
    echo "error: none of skopeo, nerdctl, ctr, docker is on PATH: install one, or push from a machine that has one" >&2
    exit 1
  }}
fi
command -v "$runtime" >/dev/null 2>&1 || {{ echo "error: $runtime is not on PATH" >&2; exit 1; }}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
images | tar -x -C "$work"
for archive in "$work"/*+*.oci.tar; do
  base=$(basename "$archive" .oci.tar)
  name=${{base%%+*}}:${{base#*+}}
  echo "pushing $target/$name ($runtime)"
  # shellcheck disable=SC2086 # the flags are words
  case $runtime in
    skopeo)
      skopeo copy --all ${{plain:+--dest-tls-verify=false}} ${{SKOPEO_FLAGS:-}} "oci-archive:$archive" "docker://$target/$name" ;;
    ctr)
      ctr -n metax-push images import --all-platforms --no-unpack "$archive" >/dev/null
      ctr -n metax-push images push ${{plain:+--plain-http}} ${{CTR_FLAGS:-}} "$target/$name" "$name"
      ctr -n metax-push images rm "$name" >/dev/null ;;
    nerdctl)
      nerdctl -n metax-push load --all-platforms -i "$archive" >/dev/null
      nerdctl -n metax-push tag "$name" "$target/$name"
      nerdctl -n metax-push push --all-platforms ${{plain:+--insecure-registry}} ${{NERDCTL_FLAGS:-}} "$target/$name"
      nerdctl -n metax-push rmi "$name" "$target/$name" >/dev/null ;;
    docker)
      docker load -i "$archive" >/dev/null
      docker tag "$name" "$target/$name"
      docker push ${{DOCKER_FLAGS:-}} "$target/$name"
      docker rmi "$name" "$target/$name" >/dev/null ;;
  esac
done
echo "next: helm push ./k8s/metax-operator-{version}.tgz oci://$target${{plain:+ --plain-http}}"
exit 0
# shellcheck disable=SC2317 # not a command: the images follow this line
__IMAGES__
"""


class PackageError(Exception):
    """The package cannot be built; the message says why and the fix."""


def source_date_epoch(repo: Path) -> int:
    """$SOURCE_DATE_EPOCH, else the time of the checkout's last commit."""
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return int(os.environ["SOURCE_DATE_EPOCH"])
    done = subprocess.run(["git", "-C", str(repo), "log", "-1", "--format=%ct"], capture_output=True, text=True)
    if done.returncode or not done.stdout.strip():
        raise PackageError("no git commit to date the package: set SOURCE_DATE_EPOCH")
    return int(done.stdout)


def chart_archive(repo: Path, helm: str, out: Path, epoch: int, sign: dict | None) -> list[Path]:
    """`helm package` of the chart's files with the mtime `epoch`; with `sign`, its provenance
    too. Returns the files written. The files are the ones `helm package` of the checkout keeps
    (its .helmignore decides, not a list here that a new chart directory could miss), re-timed."""
    with tempfile.TemporaryDirectory(prefix="metax-package-") as tmp:
        (plain,) = helm_package(helm, repo, Path(tmp) / "plain", [])
        unpack(plain, Path(tmp) / "stage")
        stage = Path(tmp) / "stage" / CHART
        for path in [stage, *stage.rglob("*")]:
            os.utime(path, (epoch, epoch), follow_symlinks=False)
        flags = ["--sign", "--key", sign["name"], "--keyring", sign["keyring"]] if sign else []
        return helm_package(helm, stage, out, flags)


def unpack(archive: Path, into: Path) -> None:
    """Extract the tar `archive` (one this module or Helm wrote) into `into`, with tarfile's "data"
    filter where this Python has it: Python 3.11.4 added the filters, and Debian 12's python3,
    3.11.2, has none."""
    with tarfile.open(archive) as tar:
        tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))


def helm_package(helm: str, chart: Path, out: Path, flags: list[str]) -> list[Path]:
    """`helm package CHART --destination OUT FLAGS`; the files it wrote (the archive, its provenance)."""
    done = subprocess.run([helm, "package", str(chart), "--destination", str(out), *flags], capture_output=True, text=True)
    if done.returncode:
        raise PackageError(f"helm package failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return sorted(out.glob(f"{CHART}-*.tgz*"))


def image_list_files(repo: Path, helm: str) -> dict[str, bytes]:
    """images.txt and images.json: what `metax-operator images` lists for every component, each
    reference relative to the site's registry."""
    flags = list(LIST_VALUES)
    errors = validate.problems(repo, helm, flags)
    if errors:
        raise UserErrors(errors)
    pulled = image_list.pulled_images(yaml.safe_load_all(validate.render(repo, flags, helm)))
    prefix = PLACEHOLDER_REGISTRY + "/"
    listed = []
    for ref in sorted(pulled):
        relative = ref.removeprefix(prefix)
        repository, tag, digest = images.split(relative)
        listed.append({"image": relative, "name": repository, "tag": tag, "digest": digest})
    return {
        "images.txt": "".join(f"{entry['image']}\n" for entry in listed).encode(),
        "images.json": (json.dumps({"registry": "DOMAIN/PROJECT", "images": listed}, indent=2) + "\n").encode(),
    }


def debian_packages(layout: Path) -> dict[str, list[tuple[str, str]]]:
    """The Debian packages of each architecture's tools image, (name, version), from the
    contents-ARCH.txt `make image` writes beside the layout (`dpkg-query --show` of its base)."""
    found = {}
    for arch in MACHINES:
        contents = layout.parent / f"contents-{arch}.txt"
        if not contents.is_file():
            raise PackageError(
                f"--tools-image {layout}: no {contents.name} beside it; give the layout= line of 'scripts/image build'"
            )
        section = contents.read_text().split("# Debian packages\n", 1)[-1].split("# Python distributions\n", 1)[0]
        found[arch] = [(name.split(":")[0], version) for name, version in (line.split("\t") for line in section.splitlines())]
    return found


def sbom(repo: Path, version: str, debian: dict[str, list[tuple[str, str]]] | None = None) -> bytes:
    """A CycloneDX 1.5 SBOM of the release: the chart, the Python package, every wheel the tools
    image installs on each architecture (image/pylock.toml, with its sha256): a package compiled
    per architecture is one component per wheel, told apart by the purl's file_name; and, with
    `debian` (`debian_packages`), every Debian package of each architecture's image, a component
    per package and architecture (purl `pkg:deb/debian/NAME@VERSION?arch=ARCH&distro=debian-12`)."""
    lock = repo / "image" / "pylock.toml"
    wheels = {wheel for arch in MACHINES for wheel in locked_wheels(lock, arch)}
    components = [
        {
            "type": "library",
            "name": wheel.package,
            "version": wheel.version,
            "purl": f"pkg:pypi/{wheel.package.lower()}@{wheel.version}?file_name={wheel.filename}",
            "hashes": [{"alg": "SHA-256", "content": wheel.sha256}],
            "externalReferences": [{"type": "distribution", "url": wheel.url}],
        }
        for wheel in sorted(wheels, key=lambda w: (w.package.lower(), w.filename))
    ]
    components += [
        {
            "type": "library",
            "name": name,
            "version": deb_version,
            "purl": f"pkg:deb/debian/{quote(name, safe='')}@{quote(deb_version, safe='')}?arch={arch}&distro=debian-12",
        }
        for arch, packages in sorted((debian or {}).items())
        for name, deb_version in sorted(packages)
    ]
    document = {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "version": 1,
        "metadata": {
            "component": {"type": "application", "name": "metax-operator", "version": version},
        },
        "components": [
            {"type": "application", "name": "metax-operator-chart", "version": version, "purl": f"pkg:helm/{CHART}@{version}"},
            {"type": "library", "name": CHART, "version": version, "purl": f"pkg:pypi/{CHART}@{version}"},
            *components,
        ],
    }
    return (json.dumps(document, indent=2) + "\n").encode()


def reproducible_tar(files: dict[str, bytes], modes: dict[str, int], epoch: int) -> bytes:
    """A .tar.gz of `files` (name -> content) in name order, mtime `epoch`, owner 0:0, no gzip time."""
    out = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, mtime=0, compresslevel=9) as zipped:
        zipped.write(plain_tar(files, modes, epoch))
    return out.getvalue()


def plain_tar(files: dict[str, bytes], modes: dict[str, int], epoch: int) -> bytes:
    """The tar of reproducible_tar, uncompressed."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as archive:
        directories = sorted({str(Path(name).parent) for name in files} - {"."})
        for name in directories:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, epoch
            archive.addfile(info)
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), modes.get(name, 0o644), epoch
            archive.addfile(info, io.BytesIO(files[name]))
    return raw.getvalue()


def build(repo: Path, output: Path, helm: str, sign: dict | None = None, tools_image: Path | None = None) -> Path:
    """The package of the checkout `repo` in `output`, with the tools image of the OCI layout
    `tools_image` when given; returns its path."""
    chart = yaml.safe_load((repo / "Chart.yaml").read_text())
    version = chart["version"]
    epoch = source_date_epoch(repo)
    top = f"{PACKAGE_PREFIX}{version}"
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="metax-package-") as tmp:
        for path in chart_archive(repo, helm, Path(tmp), epoch, sign):
            files[f"{top}/{CHART_DIR}/{path.name}"] = path.read_bytes()
    if sign:
        files[f"{top}/metax-operator-keyring.gpg"] = Path(sign["public_key"]).read_bytes()
    files.update({f"{top}/{name}": content for name, content in image_list_files(repo, helm).items()})
    archives = {}
    if tools_image:
        name = yaml.safe_load((repo / "values.yaml").read_text())["tools"]["image"]["name"]  # the chart pulls it so
        tag = chart["appVersion"]
        archives[f"{name}+{tag}.oci.tar"] = tools_image_archive(tools_image, tag, epoch)
    run = f"{top}/{RUN_NAME.format(version=version)}"
    files[run] = images_run(archives, version, epoch)
    files[f"{top}/sbom.cdx.json"] = sbom(repo, version, debian_packages(tools_image) if tools_image else None)
    files[f"{top}/CHANGELOG.md"] = (repo / "CHANGELOG.md").read_bytes()
    output.mkdir(parents=True, exist_ok=True)
    package = output / f"{top}.tar.gz"
    package.write_bytes(reproducible_tar(files, {run: 0o755}, epoch))
    return package


def images_run(archives: dict[str, bytes], version: str, epoch: int) -> bytes:
    """The images' file: the RUN header, then the tar of `archives` (NAME+TAG.oci.tar -> an OCI
    archive), each archive's index naming its image NAME:TAG."""
    named = {name: named_archive(name, data, epoch) for name, data in archives.items()}
    return RUN.format(version=version).encode() + plain_tar(named, {}, epoch)


def run_archives(run: bytes) -> dict[str, bytes]:
    """The OCI archives the images' file holds (the inverse of `images_run`)."""
    _, marker, payload = run.partition(RUN_MARKER)
    if not marker:
        raise PackageError("not an images file of this release: no images after its script")
    with tarfile.open(fileobj=io.BytesIO(payload)) as tar:
        return {info.name: tar.extractfile(info).read() for info in tar.getmembers() if info.isfile()}


def named_archive(name: str, data: bytes, epoch: int) -> bytes:
    """The OCI archive `data` (file NAME+TAG.oci.tar) with its index naming its one image NAME:TAG
    (`io.containerd.image.name`), which containerd, nerdctl and docker load it as."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        files = {info.name: tar.extractfile(info).read() for info in tar.getmembers() if info.isfile()}
    index = json.loads(files["index.json"])
    image, tag = name.removesuffix(".oci.tar").split("+", 1)
    for descriptor in index["manifests"]:
        descriptor.setdefault("annotations", {})[CONTAINERD_NAME] = f"{image}:{tag}"
    files["index.json"] = oci.canonical_json(index)
    return plain_tar(files, {}, epoch)


def tools_image_archive(layout: Path, tag: str, epoch: int) -> bytes:
    """The OCI archive of the tools image index tagged `tag` in the layout `make image` wrote."""
    if not (layout / "index.json").is_file():
        raise PackageError(f"--tools-image {layout}: not an OCI image layout; give the layout= line of 'scripts/image build'")
    try:
        return plain_tar(oci.archive_files(layout, tag), {}, epoch)
    except ValueError:
        raise PackageError(f"--tools-image {layout}: holds no image tagged {tag}; run 'make image' for this checkout") from None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/package", description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(REPO / "dist"), metavar="DIR", help="where to write it (default: dist/)")
    parser.add_argument("--helm", default=None, metavar="PATH", help="Helm 4 (default: $HELM_BIN, else helm on PATH)")
    parser.add_argument("--sign", metavar="NAME", help="sign the chart with this key (helm package --sign --key NAME)")
    parser.add_argument("--keyring", metavar="SECRING", help="the secret keyring holding it (with --sign)")
    parser.add_argument("--public-key", metavar="FILE", help="the public keyring to ship, binary (gpg --export; with --sign)")
    parser.add_argument("--tools-image", metavar="LAYOUT", help="the OCI layout of the tools image to ship (scripts/image build)")
    args = parser.parse_args(argv)
    if args.sign and not (args.keyring and args.public_key):
        parser.error("--sign needs --keyring and --public-key")
    sign = {"name": args.sign, "keyring": args.keyring, "public_key": args.public_key} if args.sign else None
    try:
        tools_image = Path(args.tools_image) if args.tools_image else None
        print(build(REPO, Path(args.output), validate.find_helm(args.helm), sign, tools_image))
    except (PackageError, UserError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except UserErrors as err:
        for error in err.errors:
            print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
