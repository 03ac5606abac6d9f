"""A TCP relay for fault tests: it carries one rank's control connection and can cut it.

``ControlRelay(target_port)`` listens on a free port of 127.0.0.1 and relays every
connection to the target, both ways, on threads of its own.  ``go_silent()`` stops
relaying while keeping both sockets open (a link that drops everything); ``close_all()``
closes both sides (a reset link).  ``stop()`` ends it; every blocking call is bounded.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

__all__ = ["ControlRelay"]


class ControlRelay:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self._target = (host, target_port)
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.2)
        self.port = int(self._listener.getsockname()[1])
        self._sockets: list[socket.socket] = []
        self._silent = threading.Event()
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(self._target, timeout=5)
            for s in (client, upstream):
                s.settimeout(0.2)
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                thread = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        while not self._stopped.is_set():
            try:
                data = source.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                if not self._silent.is_set():  # a silent link carries no end of stream either
                    with contextlib.suppress(OSError):
                        sink.shutdown(socket.SHUT_WR)
                return
            if self._silent.is_set():
                continue  # swallowed: the link drops everything
            try:
                sink.sendall(data)
            except OSError:
                return

    def go_silent(self) -> None:
        """Stop relaying in both directions; the connections stay open."""
        self._silent.set()

    def close_all(self) -> None:
        """Close both sides of every relayed connection (RST where data is pending)."""
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                with contextlib.suppress(OSError):
                    s.close()

    def stop(self) -> None:
        self._stopped.set()
        self.close_all()
        with contextlib.suppress(OSError):
            self._listener.close()
        for thread in self._threads:
            thread.join(timeout=2)
