"""An OCI image layout written byte for byte the same from the same files.

Why not umoci or skopeo for this: their layers take the files' times, owners' names and the
build's clock from wherever they ran, and their gzip and JSON settings are theirs to change;
here each byte of a layer and of the JSON is fixed by the inputs, which is what makes two builds
give one digest. (umoci and skopeo read the result in the tests and publish it.) A layer is a tar
with entries in sorted order, numeric owners only, no user or group names, times clamped to
an epoch, no device nodes, then gzip with no name and no time in its header.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import tarfile
from datetime import datetime, timezone
from pathlib import Path

LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
CONFIG = "application/vnd.oci.image.config.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
INDEX = "application/vnd.oci.image.index.v1+json"
REF_NAME = "org.opencontainers.image.ref.name"


def rfc3339(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def canonical_json(data) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


class _Hashing:
    """A write-only file that hashes what it passes on."""

    def __init__(self, target):
        self.target, self.sha256 = target, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.target.write(data)


def _sorted_tree(root: Path, skip_contents: frozenset[str], rel: str = ""):
    """Every path under root, each directory followed by its contents, names in sorted order."""
    for entry in sorted(os.scandir(root / rel), key=lambda entry: entry.name):
        path = f"{rel}/{entry.name}" if rel else entry.name
        yield Path(entry.path), path
        if entry.is_dir(follow_symlinks=False) and path not in skip_contents:
            yield from _sorted_tree(root, skip_contents, path)


def write_layer(root: Path, blobs: Path, epoch: int, skip_contents: frozenset[str] = frozenset()) -> dict:
    """Writes the tree under root as a layer blob into blobs/sha256/; returns its descriptor and,
    under "diff_id", the digest of the uncompressed tar. The directories named in skip_contents
    (relative to root) are kept, empty."""
    (blobs / "sha256").mkdir(parents=True, exist_ok=True)
    partial = blobs / "sha256" / ".layer.partial"
    with open(partial, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz:
        uncompressed = _Hashing(gz)
        with tarfile.open(fileobj=uncompressed, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for path, arcname in _sorted_tree(root, skip_contents):
                info = tar.gettarinfo(str(path), arcname)
                if info is None or info.ischr() or info.isblk() or info.isfifo():
                    continue  # sockets and device nodes: the runtime provides /dev
                info.uname = info.gname = ""
                info.mtime = min(int(info.mtime), epoch)
                if info.isreg():
                    with open(path, "rb") as data:
                        tar.addfile(info, data)
                else:
                    tar.addfile(info)
    descriptor = _store(blobs, partial, LAYER)
    descriptor["diff_id"] = "sha256:" + uncompressed.sha256.hexdigest()
    return descriptor


def blob_path(blobs: Path, descriptor: dict) -> Path:
    return blobs / "sha256" / descriptor["digest"].removeprefix("sha256:")


def _store(blobs: Path, partial: Path, media_type: str) -> dict:
    sha256 = hashlib.sha256()
    with open(partial, "rb") as blob:
        for chunk in iter(lambda: blob.read(1 << 20), b""):
            sha256.update(chunk)
    size = partial.stat().st_size
    partial.rename(blobs / "sha256" / sha256.hexdigest())
    return {"mediaType": media_type, "digest": "sha256:" + sha256.hexdigest(), "size": size}


def write_blob(blobs: Path, data: bytes, media_type: str) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / "sha256").mkdir(parents=True, exist_ok=True)
    (blobs / "sha256" / digest).write_bytes(data)
    return {"mediaType": media_type, "digest": "sha256:" + digest, "size": len(data)}


def platform(arch: str) -> dict:
    return {"architecture": arch, "os": "linux"}


def write_layout(out: Path, images: dict[str, tuple[list[tuple[Path, dict]], dict]], tag: str) -> dict[str, str]:
    """Writes an OCI image layout into out (which must not exist) holding one image per
    architecture: images maps an architecture to its layers (each a blob file and its descriptor
    from write_layer) and its image config (the rootfs is filled in here). An image index lists
    the manifests with their platforms; index.json names the index `tag` and each manifest
    `tag-ARCH` (umoci reads one manifest, not an index). Returns the digests: "index", and one per
    architecture."""
    blobs = out / "blobs"
    (blobs / "sha256").mkdir(parents=True)
    manifests = []
    for arch, (layers, config) in sorted(images.items()):
        descriptors = []
        for path, layer in layers:
            shutil.copyfile(path, blob_path(blobs, layer))
            descriptors.append({key: layer[key] for key in ("mediaType", "digest", "size")})
        config = {**config, "rootfs": {"type": "layers", "diff_ids": [layer["diff_id"] for _, layer in layers]}}
        manifest = {
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": write_blob(blobs, canonical_json(config), CONFIG),
            "layers": descriptors,
        }
        manifests.append((arch, {**write_blob(blobs, canonical_json(manifest), MANIFEST), "platform": platform(arch)}))
    index = write_blob(
        blobs, canonical_json({"schemaVersion": 2, "mediaType": INDEX, "manifests": [m for _, m in manifests]}), INDEX
    )
    top = [{**index, "annotations": {REF_NAME: tag}}]
    top += [{**manifest, "annotations": {REF_NAME: f"{tag}-{arch}"}} for arch, manifest in manifests]
    (out / "index.json").write_bytes(canonical_json({"schemaVersion": 2, "mediaType": INDEX, "manifests": top}))
    (out / "oci-layout").write_bytes(canonical_json({"imageLayoutVersion": "1.0.0"}))
    return {"index": index["digest"], **{arch: manifest["digest"] for arch, manifest in manifests}}


def archive_files(layout: Path, tag: str) -> dict[str, bytes]:
    """The files of an OCI archive (a tar of an image layout) holding the image or image index
    tagged `tag` in layout, with every blob it reaches: its index.json names that one alone, so
    `skopeo copy --all oci-archive:FILE ...` needs no tag to pick it."""
    blobs = layout / "blobs"
    (top,) = [m for m in json.loads((layout / "index.json").read_bytes())["manifests"] if m["annotations"][REF_NAME] == tag]
    files, pending = {}, [top]
    while pending:
        descriptor = pending.pop()
        data = blob_path(blobs, descriptor).read_bytes()
        files[f"blobs/sha256/{descriptor['digest'].removeprefix('sha256:')}"] = data
        if descriptor["mediaType"] in (INDEX, MANIFEST):
            document = json.loads(data)
            pending += document.get("manifests", []) + document.get("layers", [])
            if "config" in document:
                pending.append(document["config"])
    files["index.json"] = canonical_json({"schemaVersion": 2, "mediaType": INDEX, "manifests": [top]})
    files["oci-layout"] = canonical_json({"imageLayoutVersion": "1.0.0"})
    return files
