"""A TCP relay on 127.0.0.1 in front of a local server (the API server), which a test can make
fail the ways a network does, for one client only (the control plane stays up for the others):

- `sever()`: reset every open connection (a watch dies), new ones still get through;
- `down()`: reset every connection and every new one (the server is unreachable); `up()` ends it;
- `freeze()`: accept and hold connections but pass no byte either way (a server, or a path to
  it, that stops answering without closing anything); `freeze(requests_only=True)`: hold the
  client's bytes only, so what the server sends on open connections (watch events) still
  arrives but no new request does; `thaw()` lets the bytes through again;
- `delay_answers(seconds)`: every request gets through at once, the server's bytes reach the
  client `seconds` after the relay read them (a slow path back: the request has taken effect,
  the client hears of it late); `delay_answers(0)` ends it. The bytes keep their order.
"""

from __future__ import annotations

import queue
import select
import socket
import struct
import threading
import time


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
        self.answer_delay = 0.0
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

    def delay_answers(self, seconds: float) -> None:
        self.answer_delay = seconds

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
            pair = (client, upstream)
            requests, answers = _Out(upstream, self.requests, lambda: 0.0), _Out(client, self.flowing, lambda: self.answer_delay)
            for src, out in ((client, requests), (upstream, answers)):
                threading.Thread(target=self._pump, args=(src, out, pair), daemon=True).start()

    def _pump(self, src: socket.socket, out: _Out, pair) -> None:
        try:
            while True:
                out.gate.wait()
                readable, _, _ = select.select([src], [], [], 0.5)
                if not readable:
                    continue
                data = src.recv(65536)
                if not data:
                    break
                out.send(data)
        except (OSError, ValueError):  # reset, or closed by sever() (fileno -1)
            pass
        out.finish()  # what is held still reaches the peer before the connection closes
        with self._lock:
            self._pairs.discard(pair)
        for sock in pair:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class _Out:
    """One direction's bytes to `dst`, in order, each sent `delay()` seconds after it was read and
    only while `gate` is open."""

    def __init__(self, dst: socket.socket, gate: threading.Event, delay):
        self.dst, self.gate, self.delay = dst, gate, delay
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._deliver, name="relay-out", daemon=True)
        self.thread.start()

    def send(self, data: bytes) -> None:
        self.queue.put((time.monotonic() + self.delay(), data))

    def finish(self) -> None:
        self.queue.put(None)
        self.thread.join()

    def _deliver(self) -> None:
        while (item := self.queue.get()) is not None:
            due, data = item
            time.sleep(max(0.0, due - time.monotonic()))  # the injected latency itself, not a wait for a condition
            self.gate.wait()
            try:
                self.dst.sendall(data)
            except (OSError, ValueError):
                return
