"""Every pipeline rank's Gloo set-up is done before any rank goes on.

Gloo's set-up ends on each rank when its own connections are made.  A rank that went on,
refused the model (as every rank does) and ended its process closed its connections under a
neighbour still setting up, which then failed with Gloo's "remote worker crashing" instead of
refusing the model too (CI, hostile r6's parameterless stage, 1 run).  These tests take the
wait after the set-up alone (:mod:`lamploop.distributed.store_barrier`, with the pipeline's
words), over a real ``TCPStore``, ranks as threads.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist
from support import free_port

from lamploop.distributed.process_group import connect_store, create_store
from lamploop.distributed.store_barrier import give_up, wait_for_every_rank
from lamploop.errors import DistributedError
from lamploop.pipeline.group import _words, open_pipeline_group

pytestmark = pytest.mark.timeout(60)


def _waiting(store: Any, rank: int, world_size: int, seconds: float) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            words = _words(rank, world_size, "set up their group", "setting up the group")
            scoped = dist.PrefixStore("p/", store)
            wait_for_every_rank(scoped, rank=rank, nranks=world_size, timeout=seconds, words=words)
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
    give_up(dist.PrefixStore("p/", connect_store("127.0.0.1", port, 3, 30.0)), rank=2, why="Connection reset")
    waiting[0].join(10)
    assert not waiting[0].is_alive()
    (error,) = waiting[1]
    assert isinstance(error, DistributedError), repr(error)
    assert str(error) == (
        "pipeline rank 0 of 3: ranks [2] gave up setting up the group (rank 2 failed: Connection reset); "
        "ranks [1] never reached it"
    )


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
        "pipeline rank 1 of 2: rank 0's store stopped answering as the ranks waited to set up their group "
        "(is rank 0 gone?): "
    ), str(error)


def test_a_rank_that_never_joins_the_pipeline_is_named_after_the_join_timeout() -> None:
    """Before Gloo's set-up, the same barrier: rank 0 alone names the rank that never came."""
    port = free_port()
    start = time.monotonic()
    with (
        pytest.raises(DistributedError) as raised,
        open_pipeline_group(rank=0, world_size=2, host="127.0.0.1", port=port, timeout=5, join_timeout=0.5),
    ):
        pass
    assert 0.4 < time.monotonic() - start < 10.0
    assert str(raised.value) == "pipeline rank 0 of 2: ranks [1] did not join the pipeline within 0.5 s"
    assert not dist.is_initialized()


def test_giving_up_after_every_rank_came_changes_nothing() -> None:
    """The decision holds once made: a rank that fails after all came does not stop the others
    (they already went on), and its own error is its to raise."""
    store, port = create_store("127.0.0.1", 2, 30.0)
    ranks = [_waiting(store, 0, 2, 30.0), _waiting(connect_store("127.0.0.1", port, 2, 30.0), 1, 2, 30.0)]
    for thread, _ in ranks:
        thread.join(10)
    assert [outcome for _, outcome in ranks] == [["set up"], ["set up"]]
    give_up(dist.PrefixStore("p/", store), rank=1, why="too late")
    again = _waiting(store, 0, 2, 30.0)
    again[0].join(10)
    assert again[1] == ["set up"]
