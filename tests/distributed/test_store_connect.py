"""A client of a ``TCPStore`` gives up within its timeout.

torch's ``TCPStore`` client, given a timeout and nothing listening, retried past it (1.7-2.5
times the timeout on this machine, after a random back-off): ``client_of_store`` tries it with
a share of the time left, so the timeout is the bound a user set.  (A first version probed the
port with plain connections every 0.1 s; in one CI run rank 0's store then found its port in
use, EADDRINUSE, most likely a probe of a port in the ephemeral range that connected to itself.)
"""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
import torch.distributed as dist

from lamploop.distributed.process_group import client_of_store, connect_store, create_store
from lamploop.errors import DistributedError

pytestmark = pytest.mark.timeout(60)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # nobody listens there once it is closed


def test_a_store_nobody_serves_is_given_up_within_the_timeout() -> None:
    # torch's own client, given 4 s, gave up after 6.8-10 s here; 1.5 s of slack for a loaded
    # machine still tells the two apart (CI run 21 overshot a 0.75 s slack by 50 ms).
    port = _closed_port()
    for _ in range(2):  # torch's own back-off is random: twice
        started = time.monotonic()
        with pytest.raises(DistributedError, match=f"cannot reach the root's store at 127.0.0.1:{port}"):
            connect_store("127.0.0.1", port, 2, timeout=4.0)
        assert time.monotonic() - started < 4.0 + 1.5


def test_a_listening_store_is_reached_and_keeps_the_whole_timeout() -> None:
    store, port = create_store("127.0.0.1", 2, timeout=10.0)
    store.set("ready", "yes")
    client = connect_store("127.0.0.1", port, 2, timeout=10.0)
    assert client.get("ready") == b"yes"
    assert isinstance(client, dist.TCPStore)
    assert client.timeout == datetime.timedelta(seconds=10.0)


def test_a_store_that_starts_late_within_the_timeout_is_reached() -> None:
    port = _closed_port()
    servers: list[dist.TCPStore] = []

    def serve() -> None:
        servers.append(dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False))

    late = threading.Timer(1.0, serve)
    late.start()
    try:
        started = time.monotonic()
        client = client_of_store("127.0.0.1", port, 2, 10.0)
        assert 0.9 < time.monotonic() - started < 8.0
        client.set("here", "1")
    finally:
        late.join()
    assert servers[0].get("here") == b"1"
