"""A frame sent in parts arrives as the frame joined would, byte for byte, over real sockets.

The reference is ``frames.frame`` (one ``bytes``, the join) and a plain socket read on
127.0.0.1: :meth:`FramedConnection.send_parts` must deliver exactly those bytes, in order, when
the socket takes the whole frame at once, when it takes only part of it (a peer that reads
slowly: the rest waits in the transport's buffer), when more parts than one ``sendmsg`` takes
are given, and when frames queue behind unsent bytes; and it must raise the transport's error,
not hang, when the peer is gone.  (Over TLS the parts are joined and sent: the producer's TLS
test in tests/streaming/test_stream_transport.py covers that path end to end.)
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import anyio.to_thread
import pytest

from lamploop.errors import FrameError, TransportError
from lamploop.streaming.wire import samples_frame, samples_frame_parts
from lamploop.transport import frames
from lamploop.transport.connection import FramedConnection
from lamploop.transport.scatter import scatter_transport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _parts(seed: int, count: int, largest: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.choice([0, 1, 7, 100, 16383, 16384, largest])) for _ in range(count)]


def test_frame_parts_join_to_frame_and_pass_large_parts_uncopied() -> None:
    for seed in range(20):
        body = _parts(seed, 1 + seed * 3, 70_000)
        parts = frames.frame_parts(body, "test", 1 << 30)
        assert b"".join(parts) == frames.frame(body, "test", 1 << 30)
        large = [part for part in body if len(part) >= frames.SCATTER_BYTES]
        # The large ones are the caller's objects (not copied); the small ones joined between them.
        assert [part for part in parts if any(part is big for big in large)] == large
        assert len(parts) <= 2 * len(large) + 1
        assert all(parts)  # no empty part
    with pytest.raises(FrameError, match="a test frame of 20 bytes is over the limit of 19 bytes"):
        frames.frame_parts([bytes(20)], "test", 19)


def test_samples_frame_parts_join_to_samples_frame() -> None:
    payloads = [bytes(range(256)) * 300, b"x" * 13, bytes(70_001), b"y" * 8]
    parts = samples_frame_parts("sim", 5, payloads)
    assert b"".join(parts) == samples_frame("sim", 5, payloads)
    assert payloads[0] in parts  # sent as they are
    assert payloads[2] in parts
    with pytest.raises(FrameError, match="holds 1 to"):
        samples_frame_parts("sim", 5, [])


@asynccontextmanager
async def _pair(*, tls: bool = False) -> AsyncIterator[tuple[FramedConnection[bytes], socket.socket]]:
    """A FramedConnection (anyio's TCP stream) to a plain socket on 127.0.0.1, which the test reads."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        stream: anyio.abc.ByteStream = await anyio.connect_tcp("127.0.0.1", server.getsockname()[1])
        peer, _ = server.accept()
        with peer:
            peer.settimeout(30)
            connection = FramedConnection(
                stream, frames.FrameDecoder(max_frame_bytes=1 << 20), peer="the reader"
            )
            try:
                yield connection, peer
            finally:
                await connection.aclose()


def _read_exactly(peer: socket.socket, count: int, *, slowly: bool = False) -> bytes:
    got = bytearray()
    while len(got) < count:
        chunk = peer.recv(min(count - len(got), 4096 if slowly else 1 << 20))
        assert chunk, f"the connection ended after {len(got)} of {count} bytes"
        got += chunk
    return bytes(got)


@pytest.mark.parametrize("slowly", [False, True])
async def test_parts_arrive_as_the_joined_frame_whether_the_socket_takes_them_at_once_or_not(
    slowly: bool,
) -> None:
    # Frames of 40 parts of up to 1 MiB: 8 of them are about 100 MiB more than a socket buffers,
    # so that sendmsg sends part of a frame and the transport buffers the rest.
    sent = [frames.frame_parts(_parts(seed, 40, 1 << 20), "test", 1 << 30) for seed in range(8)]
    expected = b"".join(b"".join(parts) for parts in sent)
    async with _pair() as (connection, peer):
        assert scatter_transport(connection.stream) is not None  # the path under test
        received: list[bytes] = []

        async def read() -> None:
            received.append(
                await anyio.to_thread.run_sync(lambda: _read_exactly(peer, len(expected), slowly=slowly))
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            for parts in sent:
                await connection.send_parts(parts)
    assert received[0] == expected


async def test_more_parts_than_one_sendmsg_takes_arrive_in_order() -> None:
    body = [bytes([i % 251]) * (frames.SCATTER_BYTES + i) for i in range(1300)]  # 1300 large parts
    parts = frames.frame_parts(body, "test", 1 << 31)
    assert len(parts) > 1024
    expected = b"".join(parts)
    async with _pair() as (connection, peer):
        received: list[bytes] = []

        async def read() -> None:
            received.append(await anyio.to_thread.run_sync(lambda: _read_exactly(peer, len(expected))))

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await connection.send_parts(parts)
    assert received[0] == expected


async def test_a_frame_sent_while_bytes_wait_in_the_transport_queues_behind_them() -> None:
    first = bytes(range(256)) * 40_000  # 10 MiB: more than the socket takes while nobody reads
    later = frames.frame_parts(_parts(3, 30, 200_000), "test", 1 << 30)
    expected = first + b"".join(later)
    async with _pair() as (connection, peer):
        transport = scatter_transport(connection.stream)
        assert transport is not None
        transport.write(first)  # the stream's own buffer now holds the rest of it
        assert transport.get_write_buffer_size() > 0
        received: list[bytes] = []
        reading = threading.Event()

        def read_all() -> None:
            reading.set()
            received.append(_read_exactly(peer, len(expected)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, read_all)
            await anyio.to_thread.run_sync(reading.wait)
            # The reader empties the socket while the event loop is held here, so the transport
            # cannot move its buffered bytes in: the socket has room, and the parts must still
            # go behind those bytes, not straight into it.
            time.sleep(1.0)  # noqa: ASYNC251 (holding the event loop is the point)
            assert transport.get_write_buffer_size() > 0
            await connection.send_parts(later)
    assert received[0] == expected


async def test_a_peer_gone_raises_the_transport_error_and_does_not_hang(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Many small parts between the large ones: once the connection is reset, no part may be
    # handed to the dead transport (asyncio logs a warning for each write after the fifth).
    parts = frames.frame_parts(
        [part for _ in range(20) for part in (bytes(20_000), bytes(20_000), b"x" * 8)], "test", 1 << 30
    )
    assert len(parts) > 40
    async with _pair() as (connection, peer):
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        peer.close()  # a reset: the next writes fail

        async def send_until_it_fails() -> None:
            with anyio.fail_after(10):
                for _ in range(50):
                    await connection.send_parts(parts)
                    await anyio.sleep(0.01)

        with (
            caplog.at_level(logging.WARNING, logger="asyncio"),
            pytest.raises(TransportError, match=r"sending to the reader failed: .*(Reset|Broken)"),
        ):
            await send_until_it_fails()
    assert not [r for r in caplog.records if r.name == "asyncio"], [r.getMessage() for r in caplog.records]
