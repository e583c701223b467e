"""`make image`: builds the tools image without Docker, reproducibly, as an OCI image layout.

    build.py [build] [--output DIR] [--base cached|refresh|fresh]
    build.py lock        rewrite image/pylock.toml from pyproject.toml

One image per architecture (linux/amd64 and linux/arm64, ARCHITECTURES), under one image index.
Each has two layers. The base: Debian bookworm of its architecture by image/mkbase (mmdebstrap),
cached under $METAX_CACHE/image/base/<key> with its layer blob; the key hashes mkbase, the package
list, the account script and the architecture, so the cache holds what those inputs made from the
mirror (`--base refresh` makes it anew to take Debian's updates). The package layer, /usr/local,
is made anew by every build that is not cached: the package's wheel built from the source tree
(pure Python: one for both), the locked wheels of the architecture (downloads checked by sha256,
kept in $METAX_CACHE/image/wheels), installed for the base's python3 and compiled to hash-checked
.pyc by that python3. The other architecture's programs run under QEMU (image/emulate). The image
config (user, entry point, command, working directory, environment, labels) comes from
image/Dockerfile's final stage, so both recipes give the same config.

Timestamps: the package layer and the config carry SOURCE_DATE_EPOCH (default: the time of the
checked-out commit); the base layer the time of the last commit that changed the base's inputs.

Prints `layout=DIR`, `reference=oci:DIR:TAG` and `digest=sha256:...` (the index) on stdout, and
per architecture `reference-ARCH=oci:DIR:TAG-ARCH` and `digest-ARCH=` (its manifest); the result
is $METAX_CACHE/image/builds/<key>/{oci/,digest,contents-ARCH.txt}, keyed by every input, with
$METAX_CACHE/image/metax-operator-tools-<appVersion> linking to the latest. Needs root (chroot
and a mount namespace), qemu-user-static for the foreign architecture and, the first time, the
Debian mirror and PyPI.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import oci
from lock import LOCK, MACHINES, locked_wheels, runs_on

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DOCKERFILE = REPO / "image/Dockerfile"
SOURCES = REPO / "src/metax_operator"
BASE_INPUTS = [HERE / "mkbase", HERE / "packages", HERE / "add-user"]
ARCHITECTURES = tuple(MACHINES)
EMULATE = HERE / "emulate"
NAME = "metax-operator-tools"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # Debian's default
INTERPRETER = "/usr/bin/python3"
EMPTY_IN_IMAGE = frozenset({"dev", "proc", "sys", "run", "tmp"})  # the runtime mounts these
KEEP_BUILDS = 3  # results kept in the cache (worktrees of one machine share it)
KEEP_BASES = 2 * len(MACHINES)  # the bases of each architecture, the current and the previous one
BUILD_TOOLS = ("setuptools", "installer", "dockerfile-parse")
GLIBC_MINOR = 36  # bookworm's glibc 2.36: the newest manylinux wheel the base runs


class BuildError(Exception):
    """A failure the user can act on: printed as one line."""


def step(message: str) -> None:
    print(f"==> {message}", file=sys.stderr, flush=True)


def run(args: list, log: Path | None = None, **kwargs) -> str:
    """Runs a command; its output goes to log (if given) or is returned."""
    try:
        if log is None:
            return subprocess.run(args, check=True, text=True, stdout=subprocess.PIPE, **kwargs).stdout
        with open(log, "a") as out:
            subprocess.run(args, check=True, stdout=out, stderr=subprocess.STDOUT, **kwargs)
        return ""
    except FileNotFoundError:
        raise BuildError(f"{args[0]} is not installed: run 'make image' (it installs the image tools)") from None
    except subprocess.CalledProcessError as err:
        where = f"see {log}" if log else "see its output above"
        raise BuildError(f"{Path(str(args[0])).name} failed (exit {err.returncode}): {where}") from None


def git_time(*paths: Path) -> int | None:
    try:
        out = run(["git", "-C", REPO, "log", "-1", "--format=%ct", "--", *paths], stderr=subprocess.DEVNULL)
    except BuildError:
        return None
    return int(out) if out.strip() else None


def source_date_epoch() -> int:
    if os.environ.get("SOURCE_DATE_EPOCH"):
        if not os.environ["SOURCE_DATE_EPOCH"].isdigit():
            raise BuildError(
                f"SOURCE_DATE_EPOCH={os.environ['SOURCE_DATE_EPOCH']} is not a number of seconds since 1970:"
                " set it to one, or unset it to take the commit's time"
            )
        return int(os.environ["SOURCE_DATE_EPOCH"])
    epoch = git_time()
    if epoch is None:
        raise BuildError("no git history to take the build time from: set SOURCE_DATE_EPOCH (seconds since 1970)")
    return epoch


def hash_files(paths) -> str:
    sha256 = hashlib.sha256()
    for path in sorted(paths):
        sha256.update(f"{path.relative_to(REPO)}\0".encode() + path.read_bytes() + b"\0")
    return sha256.hexdigest()


def source_files() -> list[Path]:
    """The package's files a wheel can contain (not caches or build leftovers)."""
    return [path for path in SOURCES.rglob("*") if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"]


def app_version() -> str:
    for line in (REPO / "Chart.yaml").read_text().splitlines():
        if line.startswith("appVersion:"):
            return line.split(":", 1)[1].strip().strip("\"'")
    raise BuildError("Chart.yaml has no appVersion: the image tag comes from it")


def image_config(epoch: int, base_epoch: int, arch: str) -> dict:
    """The image config from image/Dockerfile's final stage (exec-form ENTRYPOINT and CMD)."""
    from dockerfile_parse import DockerfileParser

    parser = DockerfileParser(path=str(DOCKERFILE))
    stages = [i for i, instruction in enumerate(parser.structure) if instruction["instruction"] == "FROM"]
    facts = {}
    for instruction in parser.structure[stages[-1] :]:
        name, value = instruction["instruction"], instruction["value"]
        if name in ("ENTRYPOINT", "CMD"):
            try:
                facts[name] = json.loads(value)
            except json.JSONDecodeError:
                raise BuildError(f'image/Dockerfile: {name} {value}: write it in exec form, {name} ["..."]') from None
        elif name in ("USER", "WORKDIR"):
            facts[name] = value
    missing = {"USER", "WORKDIR", "ENTRYPOINT", "CMD"} - facts.keys()
    if missing:
        raise BuildError(f"image/Dockerfile's final stage has no {', '.join(sorted(missing))}: the image config comes from it")
    return {
        "created": oci.rfc3339(epoch),
        **oci.platform(arch),
        "config": {
            "User": facts["USER"],
            "WorkingDir": facts["WORKDIR"],
            "Entrypoint": facts["ENTRYPOINT"],
            "Cmd": facts["CMD"],
            "Env": [PATH_ENV] + [f"{k}={v}" for k, v in parser.envs.items()],
            "Labels": parser.labels,
        },
        "history": [
            {"created": oci.rfc3339(base_epoch), "created_by": "image/mkbase: Debian bookworm"},
            {"created": oci.rfc3339(epoch), "created_by": "image/build.py: metax-operator and image/pylock.toml"},
        ],
    }


class Builder:
    def __init__(self, cache: Path, work: Path):
        self.cache, self.work = cache, work
        self.epoch = source_date_epoch()
        self.base_epoch = git_time(*BASE_INPUTS) or self.epoch

    def base_key(self, arch: str) -> str:
        return hashlib.sha256(f"{hash_files(BASE_INPUTS)} {self.base_epoch} {arch}".encode()).hexdigest()[:16]

    def key(self, base_layers: list[dict]) -> str:
        """Every input of the image: a build with the same key gives the same digest."""
        inputs = [*HERE.glob("*"), DOCKERFILE, REPO / "pyproject.toml", REPO / "Chart.yaml", *source_files()]
        tools = " ".join(f"{tool}=={importlib.metadata.version(tool)}" for tool in BUILD_TOOLS)
        files = [path for path in inputs if path.is_file() and path.suffix != ".pyc"]
        bases = " ".join(layer["digest"] for layer in base_layers)
        return hashlib.sha256(f"{hash_files(files)} {tools} {self.epoch} {bases}".encode()).hexdigest()[:16]

    def base(self, mode: str, arch: str) -> tuple[Path, dict]:
        """The base's directory (rootfs/ and packages.txt, made by mkbase once per key) and its
        layer's descriptor, the blob cached beside it under layer-<key of the layer writer>/.
        mode "cached" uses the cached one, "refresh" makes it anew, "fresh" makes one in the work
        directory and leaves the cache alone."""
        key = self.base_key(arch)
        base = self.work / f"base-{arch}" if mode == "fresh" else self.cache / "base" / key
        if mode != "cached" or not (base / "packages.txt").exists():
            log = self.cache / f"base-{key}.log"
            log.unlink(missing_ok=True)
            step(f"Debian base ({arch}) by image/mkbase (1-3 minutes; log: {log})")
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir(parents=True)
            env = {**os.environ, "SOURCE_DATE_EPOCH": str(self.base_epoch)}
            run([EMULATE, arch, HERE / "mkbase", base / "rootfs", arch], log=log, env=env)
            (base / "packages.txt").write_text(run([EMULATE, arch, "chroot", base / "rootfs", "dpkg-query", "--show"]))
            if mode != "fresh":
                _prune(base.parent, KEEP_BASES)
        writer = hashlib.sha256((HERE / "oci.py").read_bytes() + repr(sorted(EMPTY_IN_IMAGE)).encode()).hexdigest()[:16]
        blobs = base / f"layer-{writer}"
        if not (blobs / "layer.json").exists():
            step(f"base layer ({arch})")
            shutil.rmtree(blobs, ignore_errors=True)
            layer = oci.write_layer(base / "rootfs", blobs, self.base_epoch, EMPTY_IN_IMAGE)
            (blobs / "layer.json").write_text(json.dumps(layer))
        os.utime(base)
        layer = json.loads((blobs / "layer.json").read_text())
        return base, {**layer, "path": oci.blob_path(blobs, layer)}

    def wheels(self, arch: str) -> list[Path]:
        """The locked wheels of arch, downloaded once (pip checks each against the lock's sha256)."""
        store = self.cache / "wheels"
        locked = locked_wheels(arch=arch)
        missing = [
            wheel
            for wheel in locked
            if not (store / wheel.filename).exists()
            or hashlib.sha256((store / wheel.filename).read_bytes()).hexdigest() != wheel.sha256
        ]
        if missing:
            step(f"downloading {len(missing)} locked wheels ({arch})")
            requirements = self.work / "requirements.txt"
            requirements.write_text("\n".join(wheel.requirement() for wheel in missing) + "\n")
            run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--quiet",
                    "--no-deps",
                    "--require-hashes",
                    *pip_target(arch),
                    "--dest",
                    store,
                    "--requirement",
                    requirements,
                ]
            )
        return [store / wheel.filename for wheel in locked]

    def package_wheel(self) -> Path:
        """The package's wheel, built from a copy of the source tree (nothing written into it)."""
        src = self.work / "src"
        shutil.copytree(
            SOURCES, src / SOURCES.relative_to(REPO), ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
        )
        shutil.copy(REPO / "pyproject.toml", src)
        run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "--no-index",
                "--wheel-dir",
                self.work / "dist",
                src,
            ],
            env={**os.environ, "SOURCE_DATE_EPOCH": str(self.epoch)},
        )
        (wheel,) = (self.work / "dist").glob("*.whl")
        return wheel

    def package_layer(self, rootfs: Path, wheels: list[Path], arch: str) -> Path:
        """/usr/local: the wheels installed where the base's python3 looks, then compiled by it."""
        from installer import install
        from installer.destinations import SchemeDictionaryDestination
        from installer.sources import WheelFile

        app = self.work / f"app-{arch}"
        scheme = json.loads(
            run(
                [EMULATE, arch, "chroot", rootfs, INTERPRETER, "-c"]
                + ["import json, sysconfig; print(json.dumps(sysconfig.get_paths()))"]
            )
        )
        destination = SchemeDictionaryDestination(
            {**scheme, "headers": scheme["include"]}, interpreter=INTERPRETER, script_kind="posix", destdir=str(app)
        )
        for wheel in sorted(wheels):
            with WheelFile.open(wheel) as source:
                install(source, destination, additional_metadata={})
        local = rootfs / "usr/local"
        os.chmod(app / "usr/local", local.stat().st_mode)  # the layer must not change /usr/local itself
        os.chown(app / "usr/local", local.stat().st_uid, local.stat().st_gid)
        # The base's python3 compiles, in a mount namespace where the cached base is read-only.
        compile_all = (
            f"env -i PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1 SOURCE_DATE_EPOCH={self.epoch} "
            f"{INTERPRETER} -m compileall -q -f"
            f" --invalidation-mode checked-hash {scheme['purelib']}"
        )
        run(
            [
                EMULATE,
                arch,
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-euc",
                'mount --bind "$1" "$1"; mount -o remount,bind,ro "$1"; mount --bind "$2" "$1/usr/local";'
                f' exec chroot "$1" {compile_all}',
                "sh",
                rootfs,
                app / "usr/local",
            ]
        )
        return app


def build(cache: Path, output: Path | None, base_mode: str) -> dict:
    started = time.monotonic()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock, tempfile.TemporaryDirectory(dir=cache, prefix="work-") as tmp:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time: they share the base and the wheels
        builder = Builder(cache, Path(tmp))
        tag = app_version()
        if output and output.exists() and not (output / "digest").exists():
            raise BuildError(f"--output {output} exists and is not an earlier image build: name a new directory")
        bases = {arch: builder.base(base_mode, arch) for arch in ARCHITECTURES}
        result = output or cache / "builds" / builder.key([layer for _, layer in bases.values()])
        if output is None and (result / "digest").exists():
            os.utime(result)
            return _report(result, tag, cached=True)
        new = builder.work / "result"
        new.mkdir()
        package = builder.package_wheel()
        images, sizes = {}, []
        for arch, (base, base_layer) in bases.items():
            step(f"package layer ({arch}): the package's wheel and the locked wheels, installed and compiled")
            app = builder.package_layer(base / "rootfs", [package, *builder.wheels(arch)], arch)
            layer = oci.write_layer(app, builder.work, builder.epoch)
            layers = [(base_layer["path"], base_layer), (oci.blob_path(builder.work, layer), layer)]
            images[arch] = (layers, image_config(builder.epoch, builder.base_epoch, arch))
            (new / f"contents-{arch}.txt").write_text(_contents(base, app))
            sizes.append(f"{arch} {base_layer['size'] / 1e6:.1f} MB + {layer['size'] / 1e6:.1f} MB")
        digests = oci.write_layout(new / "oci", images, tag)
        for arch in ARCHITECTURES:
            (new / f"digest-{arch}").write_text(digests[arch] + "\n")
        (new / "digest").write_text(digests["index"] + "\n")  # written last: the build is complete
        if result.exists():
            shutil.rmtree(result)
        result.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(new, result)
        if output is None:
            _link_latest(cache, result, tag)
        step(f"built in {time.monotonic() - started:.0f} s; layers compressed: {'; '.join(sizes)}")
        return _report(result, tag, cached=False)


def _contents(base: Path, app: Path) -> str:
    """What the image holds, for audits: the Debian packages and the Python distributions."""
    dists = sorted(path.name.removesuffix(".dist-info") for path in app.rglob("*.dist-info"))
    return (
        "# Debian packages\n"
        + (base / "packages.txt").read_text()
        + "# Python distributions\n"
        + "".join(f"{dist}\n" for dist in dists)
    )


def _link_latest(cache: Path, result: Path, tag: str) -> None:
    link = cache / f"{NAME}-{tag}"
    new = cache / f".{NAME}-{tag}.new"
    new.unlink(missing_ok=True)
    new.symlink_to(result.relative_to(cache))
    new.rename(link)
    _prune(cache / "builds", KEEP_BUILDS)


def _prune(folder: Path, keep: int) -> None:
    """Removes all but the `keep` most recently made or used entries of folder."""
    for old in sorted(folder.iterdir(), key=lambda path: path.stat().st_mtime, reverse=True)[keep:]:
        shutil.rmtree(old)


def _report(result: Path, tag: str, cached: bool) -> dict:
    if cached:
        step(f"up to date (nothing changed since it was built): {result}")
    layout = result / "oci"
    report = {"layout": str(layout), "reference": f"oci:{layout}:{tag}", "digest": (result / "digest").read_text().strip()}
    for arch in ARCHITECTURES:
        report[f"reference-{arch}"] = f"oci:{layout}:{tag}-{arch}"
        report[f"digest-{arch}"] = (result / f"digest-{arch}").read_text().strip()
    return report


def lock() -> None:
    """Rewrites pylock.toml: pyproject.toml's dependencies resolved by pip, wheels only, then the
    arm64 wheels of the same versions beside each compiled package's x86_64 one."""
    if (sys.implementation.name, sys.version_info[:2], sys.platform, os.uname().machine) != (
        "cpython",
        (3, 11),
        "linux",
        "x86_64",
    ):
        raise BuildError("the lock is for the image's CPython 3.11 on linux x86_64: run it on such a machine")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(SOURCES, src / SOURCES.relative_to(REPO), ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(REPO / "pyproject.toml", src)
        run(
            [sys.executable, "-m", "pip", "lock", "--quiet", "--only-binary", ":all:", "--output", Path(tmp) / "pylock.toml", src]
        )
        text = (Path(tmp) / "pylock.toml").read_text().replace('path = "src"', 'path = "../.."')  # the repository root
    LOCK.write_text(with_wheels_for(text, "arm64"))
    step(f"wrote {LOCK.relative_to(REPO)}: {len(locked_wheels())} wheels per architecture")


def with_wheels_for(text: str, arch: str) -> str:
    """The lock text with, after each package that has no wheel for arch yet, the wheel pip picks
    for arch (CPython 3.11, manylinux up to bookworm's glibc) at the locked version, with its
    sha256 from PyPI. pip's TOML is kept as it wrote it: a wheel is one more table appended."""
    wanted = [f"{package['name']}=={package['version']}" for package in _lacking(text, arch)]
    if not wanted:
        return text
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "requirements.txt").write_text("\n".join(wanted) + "\n")
        run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--no-deps"]
            + pip_target(arch)
            + ["--report", Path(tmp) / "report.json", "--requirement", Path(tmp) / "requirements.txt"]
        )
        report = json.loads((Path(tmp) / "report.json").read_text())
    added = {}
    for item in report["install"]:
        url = item["download_info"]["url"]
        added[_normalized(item["metadata"]["name"])] = (
            f'\n[[packages.wheels]]\nname = "{url.rsplit("/", 1)[1]}"\nurl = "{url}"\n\n'
            f'[packages.wheels.hashes]\nsha256 = "{item["download_info"]["archive_info"]["hashes"]["sha256"]}"\n'
        )
    blocks = text.split("\n[[packages]]\n")
    for i, block in enumerate(blocks[1:], 1):
        name = tomllib.loads(block.split("\n[[", 1)[0])["name"]
        blocks[i] = block + added.pop(_normalized(name), "")
    if added:
        raise BuildError(f"pip found {arch} wheels for packages the lock does not have: {', '.join(sorted(added))}")
    result = "\n[[packages]]\n".join(blocks)
    missing = [package["name"] for package in _lacking(result, arch)]
    if missing:
        raise BuildError(f"no {arch} wheel on PyPI for {', '.join(missing)}: build one or replace the package")
    return result


def _lacking(text: str, arch: str) -> list[dict]:
    """The lock's packages (not the project itself) with no wheel for arch."""
    packages = [package for package in tomllib.loads(text)["packages"] if "wheels" in package]
    return [package for package in packages if not any(runs_on(wheel["name"], arch) for wheel in package["wheels"])]


def pip_target(arch: str) -> list[str]:
    """pip's options for wheels of the image's python3 on arch, whatever machine pip runs on."""
    machine = MACHINES[arch]
    platforms = [f"manylinux_2_{minor}_{machine}" for minor in range(17, GLIBC_MINOR + 1)] + [f"manylinux2014_{machine}"]
    return (
        ["--only-binary", ":all:", "--python-version", "3.11", "--implementation", "cp"]
        + ["--abi", "cp311", "--abi", "abi3", "--abi", "none"]
        + [argument for platform in platforms for argument in ("--platform", platform)]
    )


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/image", description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", default="build", choices=["build", "lock"])
    parser.add_argument("--output", type=Path, help="write the result here (not cached; replaced if it exists)")
    parser.add_argument(
        "--base",
        choices=["cached", "refresh", "fresh"],
        default="cached",
        help="the Debian base: the cached one (default); refresh: make the cached one anew from the"
        " mirror (takes Debian's updates); fresh: make one in a temporary directory, leaving"
        " the cache alone",
    )
    args = parser.parse_args(argv)
    os.umask(0o022)  # files the build writes get the same modes on every machine
    os.environ["PATH"] += ":/usr/sbin:/sbin"  # chroot, where a user's PATH has no sbin
    try:
        if args.command == "lock":
            lock()
            return 0
        if os.geteuid() != 0:
            raise BuildError("building the image needs root (mmdebstrap, chroot, a mount namespace): run it as root")
        cache = Path(os.environ.get("METAX_CACHE", Path.home() / ".cache/metax-operator")) / "image"
        result = build(cache, args.output.resolve() if args.output else None, args.base)
    except (BuildError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for name, value in result.items():
        print(f"{name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
