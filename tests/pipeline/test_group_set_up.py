"""Every pipeline rank's Gloo set-up is done before any rank goes on.

Gloo's set-up ends on each rank when its own connections are made.  A rank that went on,
refused the model (as every rank does) and ended its process closed its connections under a
neighbour still setting up, which then failed with Gloo's "remote worker crashing" instead of
refusing the model too (CI, hostile r6's parameterless stage, 1 run).  These tests take the
wait after the set-up alone, over a real ``TCPStore``, ranks as threads.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from lamploop.distributed.process_group import connect_store, create_store
from lamploop.errors import DistributedError
from lamploop.pipeline.group import _wait_until_every_rank_is_set_up

pytestmark = pytest.mark.timeout(60)


def _waiting(store: Any, rank: int, world_size: int, seconds: float) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            _wait_until_every_rank_is_set_up(dist.PrefixStore("p/", store), rank, world_size, seconds)
            outcome.append("set up")
        except BaseException as exc:  # the outcome is what the test looks at
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_rank_set_up_first_waits_for_the_others() -> None:
    store, port = create_store("127.0.0.1", 2, 30.0)
    first = _waiting(store, 0, 2, 30.0)
    time.sleep(0.5)
    assert first[0].is_alive(), first[1]  # rank 1 is still setting up: rank 0 waits
    second = _waiting(connect_store("127.0.0.1", port, 2, 30.0), 1, 2, 30.0)
    for thread, _ in (first, second):
        thread.join(10)
    assert [first[1], second[1]] == [["set up"], ["set up"]]


def test_a_rank_whose_set_up_failed_is_named_at_once() -> None:
    store, port = create_store("127.0.0.1", 3, 30.0)
    waiting = _waiting(store, 0, 3, 30.0)
    time.sleep(0.2)
    dist.PrefixStore("p/", connect_store("127.0.0.1", port, 3, 30.0)).set(
        "set-up-failed/2", "Connection reset"
    )
    waiting[0].join(10)
    assert not waiting[0].is_alive()
    (error,) = waiting[1]
    assert isinstance(error, DistributedError), repr(error)
    assert str(error) == "pipeline rank 0 of 3: rank 2 could not set up its group: Connection reset"


def test_ranks_that_never_finish_setting_up_are_named_after_the_timeout() -> None:
    store, _ = create_store("127.0.0.1", 3, 30.0)
    start = time.monotonic()
    waiting = _waiting(store, 0, 3, 0.5)
    waiting[0].join(10)
    assert 0.4 < time.monotonic() - start < 5.0
    (error,) = waiting[1]
    assert isinstance(error, DistributedError), repr(error)
    assert str(error) == "pipeline rank 0 of 3: ranks [1, 2] did not set up their group within 0.5 s"


def test_a_store_that_goes_away_is_named_as_the_cause() -> None:
    """Rank 0's process (and its store) ends while rank 1 waits for the others' set-up."""
    store, port = create_store("127.0.0.1", 2, 30.0)
    waiting = _waiting(connect_store("127.0.0.1", port, 2, 5.0), 1, 2, 30.0)
    time.sleep(0.3)
    del store  # the last reference: the server stops
    gc.collect()
    waiting[0].join(20)
    assert not waiting[0].is_alive(), "still waiting on a store that is gone"
    (error,) = waiting[1]
    assert isinstance(error, DistributedError), repr(error)
    assert str(error).startswith(
        "pipeline rank 1 of 2: rank 0's store stopped answering as the ranks set up: "
    ), str(error)
