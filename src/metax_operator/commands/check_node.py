"""`metax-operator check-node`: is the MetaX driver a node now runs the one it was given?

Runs in a validation pod on a GPU node right after its kernel driver was swapped, reading the
host's /sys (mounted read-only): the `metax` module is loaded; the version it reports matches
the driver payload image's tag (tags carry an OS/arch suffix: `2.32.0.6-amd64` runs 2.32.0.6);
at least one PCI function is bound to `metax` or to `vfio-pci` (GPUs handed to virtual
machines), since a module that loaded but claimed no GPU leaves the node with none to offer;
and every MetaX GPU on the bus (a physical function of PCI vendor 0x9999) is bound to one of
them: a driver swap changes no hardware, so a GPU left unbound is one the node had before and
lost. A passed check prints one line; the first failure ends the command with exit status 1, its line
on stderr and in the termination log, where `kubectl describe pod` shows it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

#: The name of a PCI function's entry in a driver's sysfs directory (domain:bus:device.function).
PCI_ADDRESS = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
#: MetaX's PCI vendor ID, as /sys/bus/pci/devices/*/vendor shows it.
METAX_VENDOR = "0x9999"
#: The drivers a MetaX GPU may be bound to.
GPU_DRIVERS = ("metax", "vfio-pci")


class _Failed(Exception):
    """A check failed: the one line that says how."""


def checks(root: Path, payload: str | None) -> Iterator[str]:
    """Each passed check's line, in order; raises _Failed at the first failure."""
    module = root / "module" / "metax"
    if not os.path.isdir(module):  # unlike Path.is_dir, no PermissionError
        raise _Failed(f"the metax kernel module is not loaded ({module} is missing)")
    yield "ok: the metax kernel module is loaded"
    yield _version(module / "version", payload)
    drivers = root / "bus" / "pci" / "drivers"
    metax, vfio = _bound(drivers / "metax"), _bound(drivers / "vfio-pci")
    if not metax + vfio:
        raise _Failed("no PCI device is bound to the metax driver (nor to vfio-pci)")
    yield f"ok: {metax} GPU functions bound to metax, {vfio} to vfio-pci"
    yield _every_gpu_bound(root / "bus" / "pci" / "devices")


def _every_gpu_bound(devices: Path) -> str:
    """Every MetaX physical function on the bus is bound to metax or vfio-pci (virtual functions,
    which carry a `physfn` link, come and go with the VF configuration and are not counted)."""
    try:
        names = sorted(name for name in os.listdir(devices) if PCI_ADDRESS.match(name))
    except OSError as err:
        raise _Failed(f"cannot read {devices}: {err.strerror}") from None
    gpus = [
        name
        for name in names
        if _read(devices / name / "vendor") == METAX_VENDOR and not os.path.lexists(devices / name / "physfn")
    ]
    if not gpus:
        return f"skipped: no PCI function of MetaX's vendor ID {METAX_VENDOR} in {devices}"
    unbound = [name for name in gpus if _driver(devices / name) not in GPU_DRIVERS]
    if unbound:
        raise _Failed(f"{len(unbound)} of {len(gpus)} MetaX GPUs are bound to neither metax nor vfio-pci: {', '.join(unbound)}")
    return f"ok: all {len(gpus)} MetaX GPUs on the bus are bound"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def _driver(device: Path) -> str:
    """The name of the driver `device` is bound to ("" none): its `driver` link's last part."""
    try:
        return os.path.basename(os.readlink(device / "driver"))
    except OSError:
        return ""


def _version(path: Path, payload: str | None) -> str:
    if not payload:
        return "skipped: no --driver-version to compare the driver's version with"
    try:
        reported = path.read_text(errors="replace").strip()
    except FileNotFoundError:
        reported = ""
    except OSError as err:
        raise _Failed(f"cannot read {path}: {err.strerror}") from None
    if not reported:
        return f"skipped: the driver reports no version ({path} is missing or empty)"
    if payload != reported and not payload.startswith(f"{reported}-"):
        raise _Failed(f"the loaded metax driver reports version {reported}, the payload is {payload}")
    return f"ok: driver version {reported} matches the payload {payload}"


def _bound(driver: Path) -> int:
    """How many PCI functions `driver` holds (its directory's entries, symlinks not followed)."""
    try:
        return sum(1 for name in os.listdir(driver) if PCI_ADDRESS.match(name))
    except FileNotFoundError:  # the driver is not registered: it holds none
        return 0
    except OSError as err:
        raise _Failed(f"cannot read {driver}: {err.strerror}") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check-node",
        help="check the MetaX driver a GPU node runs after a driver swap (validation pod)",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("--sys", default="/host/sys", metavar="PATH", help="the host's /sys (default: %(default)s)")
    parser.add_argument(
        "--driver-version", metavar="TAG", help="the driver payload image's tag, e.g. 2.32.0.6-amd64 (default: not compared)"
    )
    parser.add_argument(
        "--termination-log",
        default="/dev/termination-log",
        metavar="PATH",
        help="where a failure's line is written for the pod's status (default: %(default)s)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        for line in checks(Path(args.sys), args.driver_version):
            print(line)
    except _Failed as failed:
        line = str(failed)
        print(f"error: {line}", file=sys.stderr)
        if os.path.isdir(os.path.dirname(os.path.abspath(args.termination_log))):
            with contextlib.suppress(OSError):  # the line is on stderr anyway
                Path(args.termination_log).write_text(f"{line}\n")
        return 1
    return 0
