"""The tools image built by `scripts/image` (`make image`): one index of a linux/amd64 and a
linux/arm64 image, reproducible, small, the config of image/Dockerfile, and running under runc
exactly as the chart's pods run it: each test of an image runs for both architectures, the one
the host is not under QEMU (image/emulate)."""

from __future__ import annotations

import calendar
import filecmp
import json
import re
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

from image.lock import MACHINES
from metax_operator.chart.upgrade_policy import Validation
from metax_operator.contract import PAYLOAD_COPIER_CONTAINER
from metax_operator.rollout.decision import PodRef
from metax_operator.runtime import validation_pod
from tests.helm import helm_path, render_chart
from tests.image import ARCHITECTURES, INDEX, REPO, Layout, build, run_as_pod, runc, unpack

VALUES = {"registry": "cr.example.com/metax", "driver": {"payload": {"version": "2.32.0.6"}}}
PACKAGE_LAYER = "usr/local/"
MAX_COMPRESSED_MB = 60  # the whole image as pulled: Debian base + package layer


@pytest.fixture(scope="module")
def tools_image():
    return build()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def image(tools_image, request) -> Layout:
    return Layout(tools_image["layout"], request.param)


@pytest.fixture(scope="module")
def pods() -> list[dict]:
    """The pods of the rendered chart: those of the tools image are the hook Jobs, the test pod,
    the runner and the components' wait-for init containers."""
    specs = []
    for obj in render_chart(VALUES, helm="helm3"):
        spec = {
            "Pod": lambda o: o["spec"],
            "Job": lambda o: o["spec"]["template"]["spec"],
            "Deployment": lambda o: o["spec"]["template"]["spec"],
            "DaemonSet": lambda o: o["spec"]["template"]["spec"],
            "CronJob": lambda o: o["spec"]["jobTemplate"]["spec"]["template"]["spec"],
        }.get(obj["kind"])
        if spec:
            specs.append(spec(obj))
    return specs


def tools_containers(pods: list[dict]):
    for spec in pods:
        for container in spec.get("initContainers", []) + spec["containers"]:
            if "/metax-operator-tools:" in container["image"]:
                yield spec, container


@pytest.fixture(scope="module")
def preflight(pods) -> tuple[dict, dict]:
    """The preflight hook Job's pod spec and container: the way the chart runs the image."""
    return next((spec, c) for spec, c in tools_containers(pods) if c.get("args", [""])[0] == "preflight")


@pytest.fixture(scope="module", params=ARCHITECTURES)
def bundle(tools_image, tmp_path_factory, request):
    return unpack(tools_image, tmp_path_factory.mktemp("image"), request.param)


def run_image(bundle, preflight, args, **kwargs):
    """Runs `metax-operator ARGS` as the chart runs the preflight hook: its securityContext and its
    emptyDir at /tmp (its ConfigMap volume is left out: there is no API server here)."""
    spec, container = preflight
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    tmp_only = {**container, "volumeMounts": [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]}
    return run_as_pod(bundle, tmp_only, spec["securityContext"], args=args, volumes=volumes, **kwargs)


def dockerfile_final_stage() -> tuple[DockerfileParser, list[dict]]:
    parser = DockerfileParser(path=str(REPO / "image/Dockerfile"))
    stages = [i for i, instruction in enumerate(parser.structure) if instruction["instruction"] == "FROM"]
    return parser, parser.structure[stages[-1] :]


# --- reproducible -------------------------------------------------------------------------------


def test_two_builds_of_one_tree_give_one_digest_and_identical_files(tools_image, tmp_path):
    """Each --output build redoes every step the package goes through (wheel, install, compile,
    layer, config); only the Debian base layer comes from the cache (keyed by its inputs)."""
    first, second = build("--output", str(tmp_path / "a")), build("--output", str(tmp_path / "b"))
    assert first["digest"] == second["digest"] == tools_image["digest"]
    comparison = filecmp.dircmp(tmp_path / "a", tmp_path / "b")
    assert not comparison.left_only and not comparison.right_only and not comparison.diff_files
    blobs = filecmp.dircmp(tmp_path / "a/oci/blobs/sha256", tmp_path / "b/oci/blobs/sha256")
    assert not blobs.left_only and not blobs.right_only
    _, mismatch, errors = filecmp.cmpfiles(
        tmp_path / "a/oci/blobs/sha256", tmp_path / "b/oci/blobs/sha256", blobs.common_files, shallow=False
    )
    assert not mismatch and not errors


def test_a_base_made_anew_from_the_mirror_gives_the_same_digest(tools_image, tmp_path):
    """The Debian base too is reproducible: made again by mmdebstrap, not taken from the cache.
    When the mirror has moved on since the cached base was made, a second base made anew is the
    comparison: the cached one is left alone, as other tests' builds (on other workers) use it."""
    fresh = build("--base", "fresh", "--output", str(tmp_path / "fresh"))
    other = tools_image
    if contents(fresh) != contents(other):  # the cached base predates updates on the mirror
        other = build("--base", "fresh", "--output", str(tmp_path / "again"))
        assert contents(fresh) == contents(other), "the Debian mirror changed during the test: run it again"
    assert fresh["digest"] == other["digest"]


def contents(result: dict) -> str:
    return "".join((Path(result["layout"]).parent / f"contents-{arch}.txt").read_text() for arch in ARCHITECTURES)


def test_one_index_names_an_image_per_architecture(tools_image):
    """The tag names the index; each image is tagged TAG-ARCH too (umoci reads no index)."""
    layout = Path(tools_image["layout"])
    top = json.loads((layout / "index.json").read_text())["manifests"]
    tag = tools_image["reference"].rsplit(":", 1)[1]
    manifest = "application/vnd.oci.image.manifest.v1+json"
    assert [(m["mediaType"], m["digest"], m["annotations"]["org.opencontainers.image.ref.name"]) for m in top] == [
        (INDEX, tools_image["digest"], tag),
        *[(manifest, tools_image[f"digest-{arch}"], f"{tag}-{arch}") for arch in ARCHITECTURES],
    ]
    index = json.loads((layout / "blobs" / tools_image["digest"].replace(":", "/")).read_bytes())
    assert [(m["digest"], m["platform"]) for m in index["manifests"]] == [
        (tools_image[f"digest-{arch}"], {"architecture": arch, "os": "linux"}) for arch in ARCHITECTURES
    ]


def test_skopeo_copies_every_architecture_keeping_the_digests(tools_image, tmp_path):
    """What a user runs to publish it (here into an archive: no registry is reachable); each
    platform's runtime picks its own image from the index."""
    archive = f"oci-archive:{tmp_path / 'tools.tar'}:{tools_image['reference'].rsplit(':', 1)[1]}"
    subprocess.run(
        ["skopeo", "copy", "--quiet", "--all", "--preserve-digests", tools_image["reference"], archive],
        check=True,
        capture_output=True,
    )
    for reference in (tools_image["reference"], archive):
        for arch in ARCHITECTURES:
            inspect = ["skopeo", "--override-arch", arch, "inspect", reference]
            inspected = json.loads(subprocess.run(inspect, check=True, capture_output=True, text=True).stdout)
            assert (inspected["Digest"], inspected["Architecture"]) == (tools_image["digest"], arch), reference
            raw = subprocess.run([*inspect, "--raw"], check=True, capture_output=True).stdout
            assert json.loads(raw)["mediaType"] == INDEX


#: The ELF header's e_machine of each architecture's extensions (EM_X86_64, EM_AARCH64).
ELF_MACHINE = {"amd64": 62, "arm64": 183}


def test_both_architectures_hold_the_same_compiled_modules(tools_image):
    """The arm64 package layer, compiled under QEMU, has byte for byte the .pyc files of the
    amd64 one (the sources are the same); only the compiled extensions differ: the same modules,
    each built for its layer's machine (a stable-ABI one, `*.abi3.so`, has one name for both)."""
    amd64, arm64 = (Layout(tools_image["layout"], arch).layers[1] for arch in ARCHITECTURES)
    pycs = sorted(name for name in amd64 if name.endswith(".pyc"))
    assert pycs == sorted(name for name in arm64 if name.endswith(".pyc")) and len(pycs) > 1000
    assert [name for name in pycs if amd64[name][1] != arm64[name][1]] == []
    extensions = {
        arch: {name: data for name, (_, data) in layer.items() if name.endswith(".so")}
        for arch, layer in (("amd64", amd64), ("arm64", arm64))
    }
    assert extensions["amd64"]
    assert {n.replace("x86_64", "aarch64") for n in extensions["amd64"]} == set(extensions["arm64"])
    for arch, found in extensions.items():
        machines = {name: int.from_bytes(data[18:20], "little") for name, data in found.items()}
        assert machines == dict.fromkeys(found, ELF_MACHINE[arch]), arch


def test_layers_have_sorted_entries_numeric_owners_and_clamped_times(image):
    created = [calendar.timegm(time.strptime(h["created"], "%Y-%m-%dT%H:%M:%SZ")) for h in image.config["history"]]
    for layer, epoch in zip(image.layers, created, strict=True):
        names = list(layer)
        assert names == sorted(names, key=lambda name: name.split("/"))
        for info, _ in layer.values():
            assert info.uname == info.gname == "" and info.mtime <= epoch, info.name


def test_no_machine_specific_or_timestamped_files(image):
    files = image.files()
    for path in (
        "etc/machine-id",
        "etc/hostname",
        "etc/resolv.conf",
        "var/lib/dbus/machine-id",
        "var/cache/ldconfig/aux-cache",
        "var/log/dpkg.log",
        "var/log/apt/history.log",
    ):
        assert path not in files or not files[path][1], f"{path} is in the image"
    pycs = {name: data for name, (_, data) in files.items() if name.endswith(".pyc")}
    assert len(pycs) > 1000
    # PEP 552 flags: 0b11 = validated by source hash; 0 would embed the source's mtime.
    assert {name for name, data in pycs.items() if data[4:8] != b"\x03\x00\x00\x00"} == set()


def test_every_module_is_compiled_so_no_import_compiles(image):
    files = image.files()
    for name in files:
        if name.startswith(PACKAGE_LAYER) and name.endswith(".py") and "/" in name:
            folder, _, module = name.rpartition("/")
            assert f"{folder}/__pycache__/{module[:-3]}.cpython-311.pyc" in files, name


# --- small --------------------------------------------------------------------------------------


def test_image_is_small_with_no_package_manager_caches_docs_or_compilers(image, capsys):
    files = image.files()
    forbidden = re.compile(
        r"^(var/lib/apt/lists/.|var/cache/apt/.|usr/share/(doc|man|info|locale)/.*[^/]$"
        r"|usr/bin/(gcc|cc|c\+\+|g\+\+|make|pip3?)$|usr/lib/gcc/)"
    )
    assert sorted(name for name in files if forbidden.match(name)) == []
    sizes = [layer["size"] / 1e6 for layer in image.manifest["layers"]]
    unpacked = sum(info.size for info, _ in files.values()) / 1e6
    with capsys.disabled():
        print(
            f"\ntools image: {sum(sizes):.1f} MB compressed (base {sizes[0]:.1f} MB, package "
            f"{sizes[1]:.1f} MB), {unpacked:.0f} MB unpacked"
        )
    assert sum(sizes) < MAX_COMPRESSED_MB


# --- one config: image/Dockerfile, the image, the chart -----------------------------------------


def test_config_is_the_dockerfiles_final_stage(image):
    parser, final = dockerfile_final_stage()
    facts = {instruction["instruction"]: instruction["value"] for instruction in final}
    config = image.config["config"]
    assert config["User"] == facts["USER"] == "65532:65532"
    assert config["WorkingDir"] == facts["WORKDIR"] == "/tmp"
    assert config["Entrypoint"] == yaml.safe_load(facts["ENTRYPOINT"]) == ["metax-operator"]
    assert config["Cmd"] == yaml.safe_load(facts["CMD"]) == ["--help"]
    assert parser.envs == {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
    assert config["Env"][1:] == [f"{k}={v}" for k, v in parser.envs.items()]
    assert config["Env"][0].startswith("PATH=/usr/local/sbin:/usr/local/bin:")
    assert config["Labels"] == parser.labels
    assert (image.config["architecture"], image.config["os"]) == (image.arch, "linux")


def test_dockerfile_installs_the_same_wheels_and_account(image):
    """Both recipes install the package and exactly the wheels of image/pylock.toml, checked
    by hash, and the account of image/add-user."""
    parser, final = dockerfile_final_stage()
    text = (REPO / "image/Dockerfile").read_text()
    assert "ARG TARGETARCH=amd64" in text and 'python image/lock.py --arch "$TARGETARCH" > /tmp/requirements.txt' in text
    assert "pip download --no-deps --require-hashes --dest /wheels --requirement /tmp/requirements.txt" in text
    assert "pip wheel --no-deps --wheel-dir /wheels ." in text
    run = " ".join(i["value"] for i in final if i["instruction"] == "RUN")
    assert "pip install --no-index --no-deps /wheels/*.whl" in run and "sh /add-user" in run
    assert "source=image/add-user" in run

    lock = tomllib.loads((REPO / "image/pylock.toml").read_text())
    locked = {
        (p["name"].replace("-", "_").replace(".", "_").lower(), p["version"])
        for p in lock["packages"]
        if p["name"] != "metax-operator"
    }
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    dist_info = re.compile(r".*/([^/]+)-([^-/]+)\.dist-info$")
    installed = {
        (match[1].replace(".", "_").lower(), match[2])
        for name, (info, _) in image.layers[1].items()
        if info.isdir() and (match := dist_info.match(name))
    }
    assert installed == locked | {("metax_operator", project["version"])}
    passwd = image.files()["etc/passwd"][1].decode()
    assert "metax:x:65532:65532:metax-operator tools:/nonexistent:/usr/sbin/nologin\n" in passwd


def test_docker_build_context_holds_what_the_dockerfile_uses():
    """.dockerignore keeps .venv and the rest out of `docker build .`, but not what is copied."""
    parser = DockerfileParser(path=str(REPO / "image/Dockerfile"))
    used = set()
    for instruction in parser.structure:
        if instruction["instruction"] == "COPY" and "--from" not in instruction["value"]:
            used.update(instruction["value"].split()[:-1])
        used.update(re.findall(r"--mount=type=bind,source=([^,\s]+)", instruction["value"]))
    allowed = {line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    assert used and used <= allowed, f"add {sorted(used - allowed)} to .dockerignore as !PATH lines"


def test_lock_has_one_wheel_of_each_package_per_architecture(monkeypatch):
    """Compiled packages have an x86_64 and an aarch64 wheel of one version; the rest one wheel
    for both. `scripts/image lock` adds nothing to a complete lock (so it asks PyPI nothing)."""
    monkeypatch.syspath_prepend(str(REPO / "image"))  # the recipe's scripts import each other by name
    import build as image_build
    from lock import LOCK, locked_wheels

    wheels = {arch: {w.package: w for w in locked_wheels(arch=arch)} for arch in ARCHITECTURES}
    assert wheels["amd64"].keys() == wheels["arm64"].keys()
    differing = {name for name, wheel in wheels["amd64"].items() if wheels["arm64"][name] != wheel}
    assert differing == {name for name, wheel in wheels["amd64"].items() if not wheel.filename.endswith("-none-any.whl")}
    assert {"google-re2", "pyyaml", "rpds-py", "charset-normalizer"} <= differing
    assert all(wheels["arm64"][name].version == wheels["amd64"][name].version for name in differing)
    assert all("aarch64" in wheels["arm64"][name].filename for name in differing)
    text = LOCK.read_text()
    assert all(image_build.with_wheels_for(text, arch) == text for arch in ARCHITECTURES)


def test_lock_pins_what_pyproject_pins():
    lock = {p["name"]: p.get("version") for p in tomllib.loads((REPO / "image/pylock.toml").read_text())["packages"]}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for dependency in project["dependencies"]:
        name, version = dependency.split("==")
        assert lock.get(name.lower().replace(".", "-")) == version, (
            f"{dependency} is not what image/pylock.toml holds: run 'scripts/image lock'"
        )


def test_chart_runs_the_image_as_its_config_says(image, pods):
    config = image.config["config"]
    uid, gid = (int(n) for n in config["User"].split(":"))
    containers = list(tools_containers(pods))
    commands = {(c["command"] + c.get("args", []))[1] for _, c in containers}
    assert commands >= {"preflight", "upgrade-crds", "bootstrap", "cleanup", "test", "run", "wait-for"}
    for spec, container in containers:
        security = {**spec.get("securityContext", {}), **container["securityContext"]}
        if container["name"] == PAYLOAD_COPIER_CONTAINER:
            # It runs the image's cp on the image's static busybox, not the metax-operator command
            # (its run on the real node: tests/e2e/test_payload_contract.py).
            assert container["command"][:2] == ["cp", "/bin/busybox"], container["command"]
        else:
            assert container["command"][:1] == config["Entrypoint"], container["name"]
        assert (security["runAsUser"], security["runAsGroup"]) == (uid, gid), container["name"]
        assert security["readOnlyRootFilesystem"] is True
        if container["name"] not in ("wait-for", PAYLOAD_COPIER_CONTAINER):  # they write nothing but their volume, if any
            assert config["WorkingDir"] in {m["mountPath"] for m in container["volumeMounts"]}, (
                f"{container['name']}: the working directory must be its writable emptyDir"
            )


# --- runs under runc as the chart runs it --------------------------------------------------------


def test_default_command_prints_help_as_the_images_user(bundle):
    """No pod settings: the runtime spec umoci derives from the image config alone."""
    out = runc(bundle)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: metax-operator") and "validate" in out.stdout
    process = json.loads((bundle / "image-spec.json").read_text())["process"]
    assert process["user"] == {"uid": 65532, "gid": 65532} and process["cwd"] == "/tmp"
    assert "HOME=/nonexistent" in process["env"]  # umoci found the account in /etc/passwd


def test_each_image_runs_programs_of_its_architecture(bundle, preflight):
    """The arm64 image's python3 is an aarch64 program (under QEMU on an x86 host), not the host's."""
    spec, container = preflight
    probe = {**container, "command": ["python3", "-c", "import platform; print(platform.machine())"]}
    out = run_image(bundle, (spec, probe), [])
    machine = MACHINES[(bundle / "arch.txt").read_text()]
    assert (out.returncode, out.stdout.strip()) == (0, machine), out.stderr


def test_runs_as_65532_with_only_tmp_writable(bundle, preflight):
    out = run_image(bundle, preflight, ["--help"])
    assert out.returncode == 0 and out.stdout.startswith("usage: metax-operator"), out.stderr
    probe = (
        "id -u; id -g; echo ok > /tmp/probe && cat /tmp/probe; "
        "for path in /probe /etc/probe /usr/local/probe /nonexistent/probe; do "
        "  (echo x > $path) 2>&1 | sed 's/^.*: //'; done"
    )
    spec, container = preflight
    out = run_image(bundle, ({**spec}, {**container, "command": ["sh", "-c", probe]}), [])
    lines = out.stdout.splitlines()
    assert lines[:3] == ["65532", "65532", "ok"], out.stdout + out.stderr
    assert lines[3:] == ["Read-only file system"] * 3 + ["Directory nonexistent"], out.stdout


def test_validate_with_the_chart_and_helm_mounted_read_only(bundle, preflight, tmp_path):
    """`validate` in the image: Helm merges the values (the image carries no Helm: a user mounts
    theirs), then the shared rules run; nothing is written outside /tmp."""
    values = tmp_path / "values"
    values.mkdir()
    (values / "good.yaml").write_text(yaml.safe_dump(VALUES))
    mounts = [(REPO, "/chart"), (values, "/values"), (helm_path("helm3"), "/usr/local/bin/helm")]
    out = run_image(bundle, preflight, ["validate", "-f", "/values/good.yaml", "--chart", "/chart"], mounts=mounts)
    assert (out.returncode, out.stdout.strip()) == (0, "values are valid"), out.stderr
    (values / "bad.yaml").write_text("driver: {deployPolicy: Sometimes}\n")
    out = run_image(
        bundle, preflight, ["validate", "-f", "/values/good.yaml", "-f", "/values/bad.yaml", "--chart", "/chart"], mounts=mounts
    )
    assert out.returncode == 1 and out.stderr.startswith("error: ") and "driver.deployPolicy" in out.stderr
    assert "Traceback" not in out.stderr


def test_every_module_and_extension_imports_in_the_image(bundle, preflight):
    """Each module of the package and each compiled extension of its dependencies loads: no
    system library a wheel needs is missing from the Debian base."""
    code = (
        "import importlib, pathlib, pkgutil, metax_operator\n"
        "for m in pkgutil.walk_packages(metax_operator.__path__, 'metax_operator.'):\n"
        "    importlib.import_module(m.name)\n"
        "site = pathlib.Path(metax_operator.__path__[0]).parent\n"
        "for so in sorted(site.rglob('*.cpython-311-*.so')) + sorted(site.rglob('*.abi3.so')):\n"
        "    importlib.import_module('.'.join(so.relative_to(site).with_suffix('').with_suffix('').parts))\n"
        "    print(so.name)\n"
    )
    spec, container = preflight
    out = run_image(bundle, (spec, {**container, "command": ["python3", "-c", code]}), [])
    assert out.returncode == 0, out.stderr
    assert any(line.startswith("_re2.") for line in out.stdout.splitlines()), out.stdout


def test_the_image_brings_the_static_busybox_the_payload_containers_run(image):
    """The driver and MXMACA pods copy /bin/busybox into their payload init containers, which run
    it inside payload images that may hold no libc: it is a static executable of the image's
    architecture (ELF e_machine), needing no program interpreter."""
    files = image.files()
    link, _ = files["bin"]  # merged /usr: /bin is a link to usr/bin, where the package puts it
    assert link.issym() and link.linkname == "usr/bin"
    info, data = files["usr/bin/busybox"]
    assert info.isfile() and info.mode & 0o111
    assert data[:4] == b"\x7fELF"
    machine = int.from_bytes(data[18:20], "little")
    assert machine == {"amd64": 62, "arm64": 183}[image.arch]
    program_headers = (
        int.from_bytes(data[32:40], "little"),
        int.from_bytes(data[54:56], "little"),
        int.from_bytes(data[56:58], "little"),
    )
    offset, size, count = program_headers
    kinds = [int.from_bytes(data[offset + i * size : offset + i * size + 4], "little") for i in range(count)]
    assert 3 not in kinds, "busybox asks for a program interpreter (PT_INTERP): not static"


def test_the_validation_pods_check_runs_in_the_image_as_the_runner_makes_it(bundle, pods, tmp_path):
    """`check-node` in the image, in the container the runner makes from the driver's rendered
    template (`validation_pod.manifest`): the tools container's user and restricted settings, the
    host's /sys read-only at /host/sys (here a tree the test writes, as the metax module shows it)."""
    driver = next(spec for spec in pods if any(c["name"] == "driver-manager" for c in spec["containers"]))
    driver_pod = PodRef("metax-driver-x1", "uid-1", "gpu-node-1")
    pod = validation_pod.manifest(driver_pod, "metax-operator", {"spec": driver}, Validation())
    [check] = pod["spec"]["containers"]
    assert check["command"][-2:] == ["--driver-version", "2.32.0.6"]
    host_sys = tmp_path / "sys"
    (host_sys / "module" / "metax").mkdir(parents=True)
    (host_sys / "module" / "metax" / "version").write_text("2.32.0.6\n")
    (host_sys / "bus" / "pci" / "drivers" / "metax").mkdir(parents=True)
    for name in ("bind", "uevent"):
        (host_sys / "bus" / "pci" / "drivers" / "metax" / name).touch()
    for function in ("0000:3b:00.0", "0000:5e:00.0"):  # as the kernel links a bound GPU both ways
        device = host_sys / "bus" / "pci" / "devices" / function
        device.mkdir(parents=True)
        (device / "vendor").write_text("0x9999\n")
        (device / "driver").symlink_to("../../../../bus/pci/drivers/metax")
        (host_sys / "bus" / "pci" / "drivers" / "metax" / function).symlink_to(f"../../devices/{function}")
    out = run_as_pod(bundle, check, pod["spec"]["securityContext"], volumes={"host-sys": host_sys})
    assert (out.returncode, out.stdout.splitlines()) == (
        0,
        [
            "ok: the metax kernel module is loaded",
            "ok: driver version 2.32.0.6 matches the payload 2.32.0.6",
            "ok: 2 GPU functions bound to metax, 0 to vfio-pci",
            "ok: all 2 MetaX GPUs on the bus are bound",
        ],
    ), out.stderr
    (host_sys / "module" / "metax" / "version").write_text("2.31.0.2\n")  # the old driver still loaded
    out = run_as_pod(bundle, check, pod["spec"]["securityContext"], volumes={"host-sys": host_sys})
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip() == "error: the loaded metax driver reports version 2.31.0.2, the payload is 2.32.0.6"
