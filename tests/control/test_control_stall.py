"""A stall of this process is not a peer's silence.

When a process stands still past the heartbeat timeout (descheduled on a loaded machine, or
its event loop held up), the deadline and the reads of what the peer sent meanwhile come due
in the same turn of the event loop.  The peer was alive the whole time: its heartbeat is in
the socket, and must be read rather than the deadline taken (anyio delivers a cancel scope's
deadline only to a task still waiting, so a read that completed in that turn wins; a receive
that polled or a deadline checked by hand would not).  Real sockets on 127.0.0.1; the stall
is a blocking sleep on the event loop.
"""

from __future__ import annotations

import socket
import time

import anyio
import anyio.abc
import pytest

from lamploop.control.connection import Connection, Gone
from lamploop.control.settings import Link
from lamploop.control.wire import Heartbeat, encode_frame

TIMEOUT_S = 2.0  # 0.5 s: a loaded machine could stand still that long between two lines here
LINK = Link.checked(heartbeat_interval=0.1, heartbeat_timeout=TIMEOUT_S, max_frame_bytes=1 << 20)

pytestmark = pytest.mark.anyio


async def _connected_pair() -> tuple[anyio.abc.SocketListener, Connection, socket.socket]:
    (listener,) = (await anyio.create_tcp_listener(local_host="127.0.0.1")).listeners
    assert isinstance(listener, anyio.abc.SocketListener)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    peer = socket.create_connection(("127.0.0.1", port), timeout=5)
    with anyio.fail_after(5):
        stream = await listener.accept()
    conn = Connection(stream, peer="the peer", link=LINK, preauth_frame_bytes=1 << 20)
    conn.joined()
    return listener, conn, peer


async def test_a_heartbeat_that_arrived_during_a_local_stall_is_read_not_timed_out() -> None:
    listener, conn, peer = await _connected_pair()
    got: list[object] = []
    try:
        async with anyio.create_task_group() as tg:

            async def receive() -> None:
                got.append(await conn.receive_live())

            tg.start_soon(receive)
            await anyio.wait_all_tasks_blocked()  # the receive waits on the socket, its deadline armed
            peer.sendall(encode_frame(Heartbeat(), max_frame_bytes=LINK.max_frame_bytes))
            time.sleep(TIMEOUT_S * 2)  # noqa: ASYNC251 (the point: this process stands still past the deadline)
    finally:
        peer.close()
        await conn.aclose()
        await listener.aclose()
    assert len(got) == 1
    assert isinstance(got[0], Heartbeat), got[0]


async def test_a_peer_that_sends_nothing_is_still_silent_within_the_timeout_and_a_glance() -> None:
    listener, conn, peer = await _connected_pair()
    try:
        began = time.monotonic()
        with anyio.fail_after(TIMEOUT_S + 10):
            outcome = await conn.receive_live()
        waited = time.monotonic() - began
    finally:
        peer.close()
        await conn.aclose()
        await listener.aclose()
    assert isinstance(outcome, Gone)
    assert outcome.how == "silent"
    assert f"{TIMEOUT_S:g} s" in outcome.what
    assert TIMEOUT_S <= waited < TIMEOUT_S + 3.0, waited
