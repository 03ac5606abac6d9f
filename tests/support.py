"""What many test modules need: a free port on 127.0.0.1 and a bounded wait for a condition.

One copy here instead of one per module (``free_port`` was written six times).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(condition: Callable[[], bool], *, timeout: float, what: str, poll: float = 0.05) -> None:
    """Return once ``condition()`` is true; ``AssertionError`` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            msg = f"{what}: not within {timeout:g} s"
            raise AssertionError(msg)
        time.sleep(poll)


ROOT: Path = Path(__file__).resolve().parent.parent
"""The repository's root (examples/, benchmarks/, docs/ and the package below it)."""

WORKERS: Path = ROOT / "tests" / "workers"
"""The scripts the multi-process tests start (tests/workers/)."""
