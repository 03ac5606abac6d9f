"""A follower's client of the root's store gives up within its timeout.

torch's ``TCPStore`` client, given a timeout and nothing listening, retried past it (1.7-2.5
times the timeout on this machine, after a random back-off): ``connect_store`` tries a plain
connection first (``wait_until_listening``), so the timeout is the bound a user set.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch.distributed as dist

from lamploop.distributed.process_group import connect_store, create_store, wait_until_listening
from lamploop.errors import DistributedError

pytestmark = pytest.mark.timeout(60)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # nobody listens there once it is closed


def test_a_store_nobody_serves_is_given_up_within_the_timeout() -> None:
    port = _closed_port()
    for _ in range(2):  # torch's own back-off was random: twice
        started = time.monotonic()
        with pytest.raises(DistributedError, match=f"cannot reach the root's store at 127.0.0.1:{port}"):
            connect_store("127.0.0.1", port, 2, timeout=1.5)
        assert time.monotonic() - started < 1.5 + 0.75


def test_a_listening_store_is_reached() -> None:
    store, port = create_store("127.0.0.1", 2, timeout=10.0)
    store.set("ready", "yes")
    client = connect_store("127.0.0.1", port, 2, timeout=10.0)
    assert client.get("ready") == b"yes"
    assert isinstance(client, dist.TCPStore)


def test_waiting_ends_as_soon_as_something_listens() -> None:
    port = _closed_port()
    listener = socket.socket()
    opened = threading.Timer(0.5, lambda: (listener.bind(("127.0.0.1", port)), listener.listen()))
    opened.start()
    try:
        started = time.monotonic()
        wait_until_listening("127.0.0.1", port, 10.0)
        assert 0.4 < time.monotonic() - started < 5.0
    finally:
        opened.join()
        listener.close()


def test_waiting_in_vain_says_where_and_how_long() -> None:
    port = _closed_port()
    with pytest.raises(TimeoutError, match=rf"127\.0\.0\.1:{port} within 0\.3 s"):
        wait_until_listening("127.0.0.1", port, 0.3)
