"""A TCP relay on 127.0.0.1 in front of a local server (the API server), which a test can make
fail the ways a network does, for one client only (the control plane stays up for the others):

- `sever()`: reset every open connection (a watch dies), new ones still get through;
- `down()`: reset every connection and every new one (the server is unreachable); `up()` ends it;
- `freeze()`: accept and hold connections but pass no byte either way (a server, or a path to
  it, that stops answering without closing anything); `freeze(requests_only=True)`: hold the
  client's bytes only, so what the server sends on open connections (watch events) still
  arrives but no new request does; `thaw()` lets the bytes through again.
"""

from __future__ import annotations

import select
import socket
import struct
import threading


def _reset(sock: socket.socket) -> None:
    """Close with an RST (linger 0), as a dropped connection looks to the peer."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class Relay:
    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.refusing = False
        self.flowing = threading.Event()  # the server's bytes to the client
        self.flowing.set()
        self.requests = threading.Event()  # the client's bytes to the server
        self.requests.set()
        self.closed = False
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def sever(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, set()
        for client, upstream in pairs:
            _reset(client)
            _reset(upstream)

    def down(self) -> None:
        self.refusing = True
        self.sever()

    def up(self) -> None:
        self.refusing = False

    def freeze(self, requests_only: bool = False) -> None:
        self.requests.clear()
        if not requests_only:
            self.flowing.clear()

    def thaw(self) -> None:
        self.flowing.set()
        self.requests.set()

    def close(self) -> None:
        self.closed = True
        self.thaw()
        self.listener.close()
        self.sever()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.refusing:
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._pairs.add((client, upstream))
            for src, dst, gate in ((client, upstream, self.requests), (upstream, client, self.flowing)):
                threading.Thread(target=self._pump, args=(src, dst, gate, (client, upstream)), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, gate: threading.Event, pair) -> None:
        try:
            while True:
                gate.wait()
                readable, _, _ = select.select([src], [], [], 0.5)
                if not readable:
                    continue
                data = src.recv(65536)
                if not data:
                    break
                gate.wait()
                dst.sendall(data)
        except (OSError, ValueError):  # reset, or closed by sever() (fileno -1)
            pass
        with self._lock:
            self._pairs.discard(pair)
        for sock in pair:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
