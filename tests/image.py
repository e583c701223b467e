"""The tools image for tests: build it with `scripts/image`, read its OCI layout, run it under runc.

    result = build()                        # {"layout", "reference", "digest", "reference-ARCH", ...}
    image = Layout(result["layout"], arch)  # .config, .layers (tarfile members by path), .read(path)
    bundle = unpack(result, tmp_path, arch) # umoci unpack: rootfs + the runtime spec from the config
    out = runc(bundle)                      # run it as the spec says (the image config alone)
    out = run_as_pod(bundle, container, pod_security, args=[...], volumes={...}, mounts=[...])

The architecture is amd64 or arm64; the one the host is not runs under QEMU (image/emulate): runc
itself runs in the emulating namespaces, so the container's programs are the other architecture's.

`run_as_pod` turns the bundle's spec into what a kubelet asks the runtime for, from a container of
the rendered chart: its command and args (with `$(VAR)` expanded), its environment (downward API
fields given by the test), user and group, read-only root, dropped capabilities, no privilege
escalation, each emptyDir it mounts as a tmpfs of its size limit, and each other volume it
mounts from a host directory the test fills (a ServiceAccount token, a ConfigMap's files),
read-only. More mounts are given as (host path, container path) pairs, read-only. `host_network`
keeps the host's network (a pod with hostNetwork: true), so that the container reaches the local
API server.
"""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import tarfile
import uuid
from pathlib import Path

from image.lock import MACHINES
from image.oci import INDEX

REPO = Path(__file__).resolve().parents[1]
RUNC_STATE = Path("/run/metax-operator-tests/runc")
ARCHITECTURES = tuple(MACHINES)


def build(*args: str) -> dict:
    result = subprocess.run([REPO / "scripts/image", "build", *args], capture_output=True, text=True)
    assert result.returncode == 0, f"scripts/image build {' '.join(args)} failed:\n{result.stderr}"
    return dict(line.split("=", 1) for line in result.stdout.splitlines())


class Layout:
    """The image of one architecture in the OCI image layout `scripts/image build` writes: its
    index.json names an image index, which lists one manifest per architecture."""

    def __init__(self, layout: str | Path, arch: str = "amd64"):
        self.root, self.arch = Path(layout), arch
        (top,) = [m for m in self.json("index.json")["manifests"] if m["mediaType"] == INDEX]
        self.index = self.blob_json(top["digest"])
        (descriptor,) = [m for m in self.index["manifests"] if m["platform"]["architecture"] == arch]
        self.manifest = self.blob_json(descriptor["digest"])
        self.config = self.blob_json(self.manifest["config"]["digest"])
        self.layers = [self._members(layer["digest"]) for layer in self.manifest["layers"]]

    def json(self, name: str):
        return json.loads((self.root / name).read_text())

    def blob(self, digest: str) -> Path:
        return self.root / "blobs" / digest.replace(":", "/")

    def blob_json(self, digest: str):
        return json.loads(self.blob(digest).read_bytes())

    def _members(self, digest: str) -> dict[str, tuple[tarfile.TarInfo, bytes | None]]:
        with gzip.open(self.blob(digest)) as raw, tarfile.open(fileobj=raw, mode="r|") as tar:
            return {member.name: (member, tar.extractfile(member).read() if member.isreg() else None) for member in tar}

    def files(self) -> dict[str, tuple[tarfile.TarInfo, bytes | None]]:
        """The image's paths as the layers stack them (a later layer's entry wins)."""
        merged = {}
        for layer in self.layers:
            merged.update(layer)
        return merged


def unpack(result: dict, folder: Path, arch: str = "amd64") -> Path:
    """The image of arch unpacked by umoci into a runtime bundle; the spec umoci derived from the
    image config is kept as image-spec.json, which each run starts from, and the architecture
    as arch.txt."""
    bundle = folder / f"bundle-{arch}"
    subprocess.run(
        ["umoci", "unpack", "--image", result[f"reference-{arch}"].removeprefix("oci:"), bundle],
        check=True,
        capture_output=True,
    )
    (bundle / "config.json").rename(bundle / "image-spec.json")
    (bundle / "arch.txt").write_text(arch)
    return bundle


def run_as_pod(
    bundle: Path,
    container: dict,
    pod_security: dict,
    args: list[str] | None = None,
    volumes: dict | None = None,
    mounts: list[tuple[Path, str]] = (),
    host_network: bool = False,
    fields: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Runs the bundle under runc as the kubelet would run `container` (a rendered pod container
    with the pod's securityContext `pod_security` and `volumes` by name: a volume dict, or the
    host directory holding a non-emptyDir volume's files); `args` replace its args; `fields`
    are the downward API's values by fieldPath, `env` the variables the kubelet adds
    (KUBERNETES_SERVICE_HOST...). Returns the completed process (stdout and stderr as text)."""
    spec = json.loads((bundle / "image-spec.json").read_text())
    security = {**pod_security, **container.get("securityContext", {})}
    process = spec["process"]
    variables = dict(env or {})
    for variable in container.get("env", []):
        if "value" in variable:
            variables[variable["name"]] = variable["value"]
        else:
            variables[variable["name"]] = (fields or {})[variable["valueFrom"]["fieldRef"]["fieldPath"]]
    process["env"] += [f"{name}={value}" for name, value in variables.items()]
    command = list(container.get("command", [])) + list(container.get("args", []) if args is None else args)
    process["args"] = [re.sub(r"\$\((\w+)\)", lambda m: variables.get(m[1], m[0]), word) for word in command]
    process["user"] = {"uid": security["runAsUser"], "gid": security["runAsGroup"]}
    process["noNewPrivileges"] = security.get("allowPrivilegeEscalation") is False
    if security.get("capabilities", {}).get("drop") == ["ALL"]:
        process["capabilities"] = {kind: [] for kind in process["capabilities"]}
    spec["root"]["readonly"] = bool(security.get("readOnlyRootFilesystem"))
    for mount in container.get("volumeMounts", []):
        source = (volumes or {})[mount["name"]]
        if isinstance(source, Path):
            mounts = [*mounts, (source, mount["mountPath"])]
            continue
        assert "emptyDir" in source, f"volume {mount['name']}: give the host directory of its files"
        size = source["emptyDir"].get("sizeLimit", "16Mi").removesuffix("i").lower()
        spec["mounts"].append(
            {
                "destination": mount["mountPath"],
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "nodev", f"size={size}", "mode=1777"],
            }
        )
    for host, path in mounts:
        spec["mounts"].append({"destination": path, "type": "bind", "source": str(host), "options": ["rbind", "ro"]})
    if host_network:
        spec["linux"]["namespaces"] = [ns for ns in spec["linux"]["namespaces"] if ns["type"] != "network"]
        # sysfs can be mounted only in a network namespace of one's own: the host's, bound.
        for mount in spec["mounts"]:
            if mount["type"] == "sysfs":
                mount.update(type="bind", source="/sys", options=["rbind", "ro", "nosuid", "noexec", "nodev"])
    return runc(bundle, spec)


def runc(bundle: Path, spec: dict | None = None) -> subprocess.CompletedProcess:
    """Runs the bundle with spec (default: the image's) to completion, without a terminal;
    stdout and stderr as text."""
    spec = spec or json.loads((bundle / "image-spec.json").read_text())
    spec["process"]["terminal"] = False
    (bundle / "config.json").write_text(json.dumps(spec))
    RUNC_STATE.mkdir(parents=True, exist_ok=True)
    emulate = [REPO / "image/emulate", (bundle / "arch.txt").read_text()]
    return subprocess.run(
        [*emulate, "runc", "--root", RUNC_STATE, "run", "--bundle", bundle, f"metax-test-{uuid.uuid4().hex[:12]}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
