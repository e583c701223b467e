"""Linux network namespaces for the real node: create one with its addresses, delete it, and make
sockets or run code inside it from a process that stays in the host's namespace.

A socket belongs to the network namespace its creating thread was in when it was made, for its
whole life. `setns(2)` changes the namespace of the calling thread only, so a thread can step in,
make a socket (or run a whole function, e.g. an HTTP health check) and step out again while the
rest of the process stays where it was. Python 3.11 has no `os.setns`: libc's is called through
ctypes.

Creation and deletion use `ip netns` (iproute2); code runs inside with `setns`, and processes with
`nsenter --net=/run/netns/NAME`, never `ip netns exec`, which also remounts /sys and so hides the
cgroup mounts the kubelet and runc need.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
import threading
from pathlib import Path

RUN_NETNS = Path("/run/netns")
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


class NetnsError(Exception):
    """A namespace could not be made or entered; the message says what to do."""


def path(name: str) -> Path:
    return RUN_NETNS / name


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise NetnsError(
            f"ip {' '.join(args)} failed: {done.stderr.strip()}"
            + (" (creating network namespaces needs root)" if os.geteuid() else "")
        )


def create(name: str, interface: str, addresses: list[str]) -> None:
    """A new namespace `name` with loopback up and an interface holding `addresses` (CIDR
    strings): one end of a veth pair whose other end (`<interface>-peer`) stays in the same
    namespace, so nothing it holds is reachable from, or routed to, any other namespace (a
    `dummy` interface would do, but not every kernel has that driver)."""
    _ip("netns", "add", name)
    try:
        for command in (
            ["link", "set", "lo", "up"],
            ["link", "add", interface, "type", "veth", "peer", "name", f"{interface}-peer"],
            *(["addr", "add", a, "dev", interface] for a in addresses),
            ["link", "set", f"{interface}-peer", "up"],
            ["link", "set", interface, "up"],
        ):
            _ip("-n", name, *command)
    except NetnsError:
        delete(name)
        raise


def delete(name: str) -> None:
    """Remove the namespace's name; the kernel frees it once no process or mount holds it."""
    if path(name).exists():
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise NetnsError(f"setns into a network namespace failed: {os.strerror(errno)}")


@contextlib.contextmanager
def _entered(namespace: Path):
    """The calling thread inside `namespace` for the block, back where it was after."""
    with open("/proc/thread-self/ns/net") as home, open(namespace) as target:
        _setns(target.fileno())
        try:
            yield
        finally:
            _setns(home.fileno())


def socket_in(namespace: Path, family: int = socket.AF_INET) -> socket.socket:
    """A new TCP socket that lives in `namespace` (binds and connects happen there)."""
    with _entered(namespace):
        return socket.socket(family, socket.SOCK_STREAM)


def call_in(namespace: Path, function, *args):
    """`function(*args)` run by a thread inside `namespace`; its result, or its exception."""
    outcome: dict = {}

    def target() -> None:
        try:
            with _entered(namespace):
                outcome["value"] = function(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
