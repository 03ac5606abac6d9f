"""A child signalled between its fork and lamploop's hook does not signal its parent's event loop.

``python tests/workers/fork_in_the_window.py``: sets a wake-up socket as an event loop does
(``signal.set_wakeup_fd``) with a SIGTERM handler, enters
:func:`lamploop.forked_children.signals_stay_with_this_process`, and forks from a thread
other than the main one (as a ``DataLoader`` forks from a rank's worker thread).  A hook that
runs in the child before lamploop's (``os.register_at_fork`` runs them in the order
registered) sends the child a SIGTERM: the moment a ``kill -TERM -PGID`` can land on a loaded
machine.  Prints one JSON line: the bytes the parent's wake-up socket received (none: the
signal stayed with the child) and the child's exit status.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

signal.signal(signal.SIGTERM, lambda *_: None)  # a Python handler: the C handler writes the wake-up fd
os.register_at_fork(after_in_child=lambda: os.kill(os.getpid(), signal.SIGTERM))  # before lamploop's

from lamploop.forked_children import signals_stay_with_this_process  # noqa: E402

reader, writer = socket.socketpair()
reader.setblocking(False)
writer.setblocking(False)
signal.set_wakeup_fd(writer.fileno())
statuses: list[int] = []


def fork_and_wait() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)  # the pending SIGTERM (if any) went to its handler first
    statuses.append(os.waitpid(pid, 0)[1])


with signals_stay_with_this_process():
    forker = threading.Thread(target=fork_and_wait)
    forker.start()
    forker.join(timeout=30)
try:
    received = reader.recv(64)
except BlockingIOError:
    received = b""
print(json.dumps({"received": list(received), "statuses": statuses}), flush=True)
