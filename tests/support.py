"""What many test modules need: a free port on 127.0.0.1, a bounded wait for a condition, a
relay that cuts connections, and the lines a stopped demo run ends with.

One copy here instead of one per module (``free_port`` was written six times).
"""

from __future__ import annotations

import random
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the ephemeral range.

    The OS's own pick (``bind(0)``) comes from the ephemeral range, from which the kernel also
    takes the local port of every outgoing connection: another test's connection could take it
    between this pick and the listen that follows (a rank then failed with EADDRINUSE). A
    random port below that range is taken only by a listener that picks it the same way.
    """
    low = _ephemeral_low()
    for _ in range(64):
        port = _PICKS.randrange(max(low - 12_000, 1024), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_PICKS = random.Random()  # seeded by the OS: xdist workers pick apart


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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


STOPPED_AT_A_STEP = (
    r"lamploop: stopped by {signal} at epoch \d+ after step \d+; a checkpoint was written there"
)
"""The line a run of the demo ends with when a stop signal lands in a training step."""

STOPPED_IN_A_VALIDATION = (
    r"lamploop: stopped by {signal} during the validation of epoch \d+, (at the epoch's end; the "
    r"epoch's checkpoint was written, the next run resumes from there|which was cut short and "
    r"discarded: .*)"
)
"""Its line when the signal lands in a validation instead (each of the demo's epochs ends with one)."""


def stopped_by(signal_name: str, line: str) -> str | None:
    """Which documented way ``line`` says a run stopped on ``signal_name``: "step", "validation" or None."""
    if re.fullmatch(STOPPED_AT_A_STEP.format(signal=signal_name), line):
        return "step"
    if re.fullmatch(STOPPED_IN_A_VALIDATION.format(signal=signal_name), line):
        return "validation"
    return None


async def cutting_relay(target: tuple[str, int], limit: Callable[[], int], group: Any) -> tuple[str, int]:
    """A TCP relay on 127.0.0.1 to ``target``, served in ``group`` (cancel it to stop), that
    closes each connection once ``limit()`` bytes (asked once per connection) came from the
    client; its address.  A flaky or broken network between a producer and its receiver."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")

    async def serve(client: Any) -> None:
        most = limit()
        async with client:
            try:
                upstream = await anyio.connect_tcp(*target)
            except OSError:
                return
            async with upstream, anyio.create_task_group() as pipes:

                async def forward(source: Any, sink: Any, most: int | None) -> None:
                    sent = 0
                    try:
                        async for chunk in source:
                            if most is not None:
                                chunk = chunk[: most - sent]
                            await sink.send(chunk)
                            sent += len(chunk)
                            if most is not None and sent >= most:
                                break
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        pass
                    pipes.cancel_scope.cancel()

                pipes.start_soon(forward, client, upstream, most)
                pipes.start_soon(forward, upstream, client, None)

    async def run() -> None:
        async with listener:
            await listener.serve(serve)

    address = listener.extra(anyio.abc.SocketAttribute.local_address)
    group.start_soon(run)
    return address[0], address[1]
