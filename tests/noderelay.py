"""The relay between the host's loopback and the real node's network namespace: one small process
that stays in the host's namespace and makes each socket in the namespace it needs
(tests/netns.py), so nothing is added to the host's network (no interface, route or rule).

    python -m tests.noderelay --netns /run/netns/NAME \
        --forward 10.77.0.1:6443=127.0.0.1:6443 --forward 127.0.0.1:5000=127.0.0.1:5000 \
        --connect-proxy /path/egress.sock

--forward LISTEN=TARGET  listens at LISTEN inside the namespace and connects each client to
                         TARGET on the host's loopback: pods and the kubelet reach the API server
                         at the address it advertises, containerd reaches the local registry at
                         the same 127.0.0.1:PORT the host uses.
--connect-proxy PATH     an HTTP CONNECT proxy on a unix socket, dialling inside the namespace:
                         the API server's egress to the cluster (kubectl logs/exec reach the
                         kubelet through it, as through a konnectivity proxy). Only IP literals
                         are accepted, so no name is ever resolved.

It runs until SIGTERM. The proxy's socket is made last: once it accepts, every forward listens.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import signal
import socket
import sys
from pathlib import Path

from tests import netns

CONNECT_TIMEOUT = 10  # seconds to reach a target


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return str(ipaddress.ip_address(host)), int(port)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.transport.abort()


async def _splice(client: tuple, target: tuple) -> None:
    (client_reader, client_writer), (target_reader, target_writer) = client, target
    try:
        await asyncio.gather(_pipe(client_reader, target_writer), _pipe(target_reader, client_writer))
    except asyncio.CancelledError:
        pass  # the relay is stopping: its connections end with it
    finally:
        client_writer.close()
        target_writer.close()


async def _dial(sock: socket.socket, address: tuple[str, int]) -> tuple:
    sock.setblocking(False)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, address), CONNECT_TIMEOUT)
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


async def forward(namespace: Path, listen: tuple[str, int], target: tuple[str, int]) -> asyncio.Server:
    async def handle(reader, writer) -> None:
        try:
            upstream = await _dial(socket.socket(), target)  # a socket of the host's namespace
        except (OSError, asyncio.TimeoutError):
            writer.close()
            return
        await _splice((reader, writer), upstream)

    sock = netns.socket_in(namespace)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(listen)
    return await asyncio.start_server(handle, sock=sock)


async def connect_proxy(namespace: Path, path: str) -> asyncio.Server:
    async def handle(reader, writer) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CONNECT_TIMEOUT)
            method, authority, _ = head.split(b"\r\n", 1)[0].decode("ascii").split(" ", 2)
            if method != "CONNECT":
                raise ValueError(method)
            upstream = await _dial(netns.socket_in(namespace), _address(authority))
        except (OSError, ValueError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\n\r\n")
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await _splice((reader, writer), upstream)

    Path(path).unlink(missing_ok=True)
    return await asyncio.start_unix_server(handle, path=path)


async def serve(namespace: Path, forwards: list[tuple], proxy: str) -> None:
    servers = [await forward(namespace, listen, target) for listen, target in forwards]
    servers.append(await connect_proxy(namespace, proxy))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    for server in servers:
        server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.noderelay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--netns", required=True, type=Path, help="the namespace, e.g. /run/netns/NAME")
    parser.add_argument("--forward", action="append", default=[], metavar="LISTEN=TARGET")
    parser.add_argument("--connect-proxy", metavar="SOCKET", required=True)
    args = parser.parse_args(argv)
    forwards = [tuple(_address(side) for side in spec.split("=", 1)) for spec in args.forward]
    try:
        asyncio.run(serve(args.netns, forwards, args.connect_proxy))
    except (OSError, netns.NetnsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
