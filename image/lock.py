"""The tools image's Python dependencies, locked: image/pylock.toml (PEP 751, written by
`pip lock`, then given the other architecture's wheels by `scripts/image lock`) names, for CPython
3.11 on Linux, each package's wheels with their URLs and sha256: one wheel for every architecture
(`py3-none-any`), or one per architecture (a compiled extension: `..._x86_64`, `..._aarch64`).

Run as a script it prints one architecture's as pip requirement lines (`name @ URL
--hash=sha256:...`), which any pip downloads in hash-checking mode: image/Dockerfile does that.
    lock.py [--arch amd64|arm64] [LOCK]
Standard library only.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import NamedTuple

LOCK = Path(__file__).with_name("pylock.toml")
PROJECT = "metax-operator"  # the lock's root; its wheel is built from the source tree
#: The image's architectures (OCI and Debian names) and the machine their wheels' platform tags name.
MACHINES = {"amd64": "x86_64", "arm64": "aarch64"}


class Wheel(NamedTuple):
    package: str
    version: str
    filename: str
    url: str
    sha256: str

    def requirement(self) -> str:
        return f"{self.package} @ {self.url} --hash=sha256:{self.sha256}"


def runs_on(filename: str, arch: str) -> bool:
    """Whether the wheel runs on arch: one of its platform tags is `any` or names arch's machine
    (`manylinux2014_aarch64.manylinux_2_17_aarch64` are two tags of one wheel)."""
    platforms = filename.removesuffix(".whl").rsplit("-", 1)[1].split(".")
    return any(platform == "any" or platform.endswith("_" + MACHINES[arch]) for platform in platforms)


def locked_wheels(lock: Path = LOCK, arch: str = "amd64") -> list[Wheel]:
    """The wheel of each locked package that runs on arch."""
    wheels = []
    for package in tomllib.loads(lock.read_text())["packages"]:
        if package["name"] == PROJECT:
            continue
        fitting = [wheel for wheel in package["wheels"] if runs_on(wheel["name"], arch)]
        if len(fitting) != 1:
            raise ValueError(
                f"{lock.name}: {package['name']} has {len(fitting)} wheels for {arch}, not one: run 'scripts/image lock'"
            )
        (wheel,) = fitting
        wheels.append(Wheel(package["name"], package["version"], wheel["name"], wheel["url"], wheel["hashes"]["sha256"]))
    return wheels


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="lock.py", description="the locked wheels of one architecture as pip requirements")
    parser.add_argument("--arch", choices=sorted(MACHINES), default="amd64")
    parser.add_argument("lock", nargs="?", type=Path, default=LOCK)
    args = parser.parse_args()
    print("\n".join(wheel.requirement() for wheel in locked_wheels(args.lock, args.arch)))
