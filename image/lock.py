"""The tools image's Python dependencies, locked: image/pylock.toml (PEP 751, written by
`pip lock`) names one wheel per package for CPython 3.11 on linux x86_64, with its URL and sha256.

Run as a script it prints them as pip requirement lines (`name @ URL --hash=sha256:...`), which
any pip downloads in hash-checking mode: image/Dockerfile does that. Standard library only.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

import tomllib

LOCK = Path(__file__).with_name("pylock.toml")
PROJECT = "metax-operator"  # the lock's root; its wheel is built from the source tree


class Wheel(NamedTuple):
    package: str
    version: str
    filename: str
    url: str
    sha256: str

    def requirement(self) -> str:
        return f"{self.package} @ {self.url} --hash=sha256:{self.sha256}"


def locked_wheels(lock: Path = LOCK) -> list[Wheel]:
    wheels = []
    for package in tomllib.loads(lock.read_text())["packages"]:
        if package["name"] == PROJECT:
            continue
        (wheel,) = package["wheels"]  # `pip lock --only-binary :all:` records the one it chose
        wheels.append(Wheel(package["name"], package["version"], wheel["name"], wheel["url"], wheel["hashes"]["sha256"]))
    return wheels


if __name__ == "__main__":
    print("\n".join(wheel.requirement() for wheel in locked_wheels(Path(sys.argv[1]) if sys.argv[1:] else LOCK)))
