"""Strangers in numbers on the root's control port: the run goes on, the log stays short.

Real TCP sockets on 127.0.0.1, a real root and a real follower (tasks of this process).
Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from lamploop.control import Rendezvous, Stop, TcpControlFollower, TcpControlRoot, Train
from lamploop.modelspec import ModelSpec, TensorSpec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOKEN = b"the shared secret"
SPEC = ModelSpec((TensorSpec("fc.weight", (10, 4), "float32"),))


async def _follower_joins(port: int, got: list[object]) -> float:
    """Join as rank 1, read commands until Stop; the seconds the join took."""
    started = time.monotonic()
    async with TcpControlFollower(
        host="127.0.0.1", port=port, rank=1, nranks=2, token=TOKEN, model_spec=SPEC
    ) as f:
        _, commands = await f.join()
        joined = time.monotonic() - started
        async for command in commands:
            got.append(command)
    return joined


async def test_thousands_of_garbage_connections_log_a_few_lines_and_the_run_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    got: list[object] = []
    with caplog.at_level(logging.WARNING, logger="lamploop.control"), anyio.fail_after(50):
        began = time.monotonic()  # the refusal log's first window starts with the root
        async with TcpControlRoot(nranks=2, token=TOKEN, model_spec=SPEC, handshake_timeout=2.0) as root:
            port = root.address[1]

            async def stranger() -> None:
                async with await anyio.connect_tcp("127.0.0.1", port) as s:
                    await s.send(b"\x00\x00\x00\x10" + os.urandom(16))
                    try:
                        while await s.receive():
                            pass
                    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                        return

            async with anyio.create_task_group() as tg:
                for _ in range(2000):
                    tg.start_soon(stranger)
                    await anyio.lowlevel.checkpoint()
            async with anyio.create_task_group() as tg:
                tg.start_soon(_follower_joins, port, got)
                await root.on_rendezvous_ready(Rendezvous("127.0.0.1", 1))
                await root.broadcast(Train(epoch=0, lr_factor=1.0))
                await root.broadcast(Stop("done"))
        windows = 1 + int((time.monotonic() - began) // 10.0)  # one, unless a loaded machine took over 10 s
    assert got == [Train(epoch=0, lr_factor=1.0), Stop("done")]
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) <= 12 * windows, (len(refused), windows)  # at most 10 lines a 10 s window, a summary
    assert any("more connections" in r.getMessage() for r in refused)


async def test_a_follower_joins_within_seconds_past_hundreds_of_silent_connections() -> None:
    got: list[object] = []
    with anyio.fail_after(50):
        async with TcpControlRoot(nranks=2, token=TOKEN, model_spec=SPEC, handshake_timeout=30.0) as root:
            port = root.address[1]
            silent = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(300)]
            try:
                async with anyio.create_task_group() as tg:

                    async def follower() -> None:
                        got.append(await _follower_joins(port, got))

                    tg.start_soon(follower)
                    await root.on_rendezvous_ready(Rendezvous("127.0.0.1", 1))
                    await root.broadcast(Stop("done"))
            finally:
                for s in silent:
                    await s.aclose()
    joined = got[-1]
    assert isinstance(joined, float)
    assert joined < 5.0, joined  # the strangers hold a 30 s handshake timeout each
    assert got[0] == Stop("done")


async def test_large_frames_before_authentication_are_refused_at_their_header() -> None:
    """64 strangers each announce a 4 MB hello: refused after the 4-byte header, nothing buffered.

    They wait for the root's challenge first, as a follower does (a stranger that speaks
    first is closed before any handshake, see the next test)."""
    refused_after: list[float] = []
    with anyio.fail_after(30):
        async with TcpControlRoot(nranks=2, token=TOKEN, model_spec=SPEC, handshake_timeout=10.0) as root:
            port = root.address[1]

            async def big_hello() -> None:
                async with await anyio.connect_tcp("127.0.0.1", port) as s:
                    started = time.monotonic()
                    await s.receive()  # the challenge
                    await s.send((4 * 1024 * 1024).to_bytes(4, "big") + b"{" * 1024)
                    try:
                        while await s.receive():
                            pass
                    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                        pass
                    refused_after.append(time.monotonic() - started)

            async with anyio.create_task_group() as tg:
                for _ in range(64):
                    tg.start_soon(big_hello)
            assert len(root.recent_refusals) == 16  # the last 16 are remembered
            assert all("over the limit of 16384 bytes" in r for r in root.recent_refusals), (
                root.recent_refusals
            )
    assert len(refused_after) == 64
    assert max(refused_after) < 5.0  # well before the 10 s handshake timeout


def _replies_until_closed(socks: list[socket.socket]) -> list[bytes]:
    """What the root sends on each socket until it closes it."""
    replies = []
    for s in socks:
        with s:
            chunks = []
            with contextlib.suppress(ConnectionResetError):  # unread bytes make the close a reset
                while chunk := s.recv(4096):
                    chunks.append(chunk)
            replies.append(b"".join(chunks))
    return replies


async def test_a_stranger_that_speaks_before_the_challenge_is_closed_without_a_handshake() -> None:
    """The root speaks first: bytes or a hang-up already waiting at accept mean a stranger.

    Such a peer is closed without a challenge (no handshake, no task), the cheapest refusal;
    a follower joining meanwhile is unaffected.
    """
    got: list[object] = []
    with anyio.fail_after(30):
        async with TcpControlRoot(nranks=2, token=TOKEN, model_spec=SPEC) as root:
            port = root.address[1]
            # Blocking calls on purpose: the root (on this event loop) cannot accept until
            # every stranger has connected (the kernel does that) and sent its bytes.
            socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
            for s in socks:
                s.sendall(b"\x00\x00\x00\x08garbage!")
            replies = await anyio.to_thread.run_sync(_replies_until_closed, socks)
            async with anyio.create_task_group() as tg:
                tg.start_soon(_follower_joins, port, got)
                await root.on_rendezvous_ready(Rendezvous("127.0.0.1", 1))
                await root.broadcast(Stop("done"))
            refusals = root.recent_refusals
    assert replies == [b""] * 20  # not even a challenge
    assert len(refusals) == 16  # the last 16 are remembered
    assert all("spoke before the root's challenge" in r for r in refusals), refusals
    assert got == [Stop("done")]
