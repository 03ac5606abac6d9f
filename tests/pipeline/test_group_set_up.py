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
import os
import subprocess
import sys
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
    assert bytes(dist.PrefixStore("p/", store).get("decision")) == b"all came"


def test_two_processes_arriving_as_one_rank_end_every_rank_at_once_naming_it() -> None:
    """Ranks 0, 1 and 1 again of 3 (rank 2 never started): counted as three arrivals, they all
    went into Gloo's set-up and waited there for rank 2 for the whole group timeout (60 s in a
    hostile user's run), naming neither the duplicate nor the missing rank."""
    store, port = create_store("127.0.0.1", 3, 30.0)
    clients = [store, connect_store("127.0.0.1", port, 3, 30.0), connect_store("127.0.0.1", port, 3, 30.0)]
    start = time.monotonic()
    first = [_waiting(clients[0], 0, 3, 30.0), _waiting(clients[1], 1, 3, 30.0)]
    time.sleep(0.2)
    again = _waiting(clients[2], 1, 3, 30.0)
    for thread, _ in (*first, again):
        thread.join(10)
    assert time.monotonic() - start < 5.0
    (duplicate,) = again[1]
    assert str(duplicate) == (
        "pipeline rank 1 of 3: rank 1 arrived here before: another process was given rank 1 too, or this "
        "store still serves an earlier run (each rank is one process's, each run its own port)"
    ), repr(duplicate)
    for _, outcome in first:
        (error,) = outcome
        assert isinstance(error, DistributedError), repr(error)
        assert (
            "gave up setting up the group (rank 1 failed: rank 1 arrived here before: another process"
            in str(error)
        ), str(error)
        assert str(error).endswith("ranks [2] never reached it"), str(error)


def test_rank_0_leaves_only_once_every_rank_has_read_the_decision() -> None:
    """Rank 0's process holds the store.  Arriving last, it finds that all came; if it went on
    at once and its process ended (its next step failed, as every rank's does), a rank still
    sleeping between two looks at the store found it gone and raised "stopped answering"
    instead of going on (15 of 20 runs with the process ending 10 ms after; review of the
    shared barrier).  Rank 0 now leaves once every rank has read the decision."""
    for trial in range(8):
        store, port = create_store("127.0.0.1", 2, 30.0)
        follower = _waiting(connect_store("127.0.0.1", port, 2, 5.0), 1, 2, 30.0)
        time.sleep(0.3 + 0.01 * trial)  # rank 1 polls at its slowest by now, at some phase
        words = _words(0, 2, "set up their group", "setting up the group")
        wait_for_every_rank(dist.PrefixStore("p/", store), rank=0, nranks=2, timeout=30.0, words=words)
        del store  # rank 0's process ends at once: its store with it
        gc.collect()
        follower[0].join(15)
        assert follower[1] == ["set up"], (trial, follower[1])


_PIPELINE_RANK = """
import sys, time
from lamploop.pipeline.group import open_pipeline_group
rank, port = int(sys.argv[1]), int(sys.argv[2])
start = time.monotonic()
try:
    with open_pipeline_group(rank=rank, world_size=2, host="127.0.0.1", port=port, timeout=60):
        print("set up", flush=True)
except Exception as exc:
    print(f"{time.monotonic() - start:.1f} {type(exc).__name__}: {exc}", flush=True)
"""


def test_a_rank_whose_network_interface_gloo_cannot_use_is_named_to_the_others_at_once(
    tmp_path: Any,
) -> None:
    """Rank 1's ``GLOO_SOCKET_IFNAME`` names no interface of its machine.  Found inside Gloo's
    set-up, it left rank 0 waiting there for rank 1's keys for the whole ``timeout`` (20 s in
    the review's run), naming neither rank 1 nor why; it is now found before the ranks join,
    and rank 0 names both at once."""
    port = free_port()
    command = [sys.executable, "-c", _PIPELINE_RANK]
    env = {key: value for key, value in os.environ.items() if key != "GLOO_SOCKET_IFNAME"}
    ranks = [
        subprocess.Popen([*command, "0", str(port)], env=env, stdout=subprocess.PIPE, text=True),
        subprocess.Popen(
            [*command, "1", str(port)],
            env={**env, "GLOO_SOCKET_IFNAME": "nosuchif0"},
            stdout=subprocess.PIPE,
            text=True,
        ),
    ]
    try:
        outputs = [rank.communicate(timeout=45)[0].strip() for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    took, _, error = outputs[0].partition(" ")
    assert error.startswith(
        "DistributedError: pipeline rank 0 of 2: ranks [1] gave up joining the pipeline (rank 1 failed: "
        "GLOO_SOCKET_IFNAME names the network interface 'nosuchif0', which Gloo cannot use here: "
    ), outputs
    assert float(took) < 20.0, outputs  # at once (torch's imports aside), not after `timeout`
    assert "pipeline rank 1 of 2: GLOO_SOCKET_IFNAME names the network interface 'nosuchif0'" in outputs[1]


def test_a_rank_reaching_a_store_that_still_serves_an_earlier_run_is_refused_at_once() -> None:
    """Rank 1 left pipeline A and opened B on the same port while rank 0 was still in A: it
    reached A's store, went on with A's "all came" and waited 40 s in Gloo's set-up (review of
    the shared barrier).  It now finds its rank taken and says so."""
    store, port = create_store("127.0.0.1", 2, 30.0)
    earlier = [_waiting(store, 0, 2, 30.0), _waiting(connect_store("127.0.0.1", port, 2, 30.0), 1, 2, 30.0)]
    for thread, _ in earlier:
        thread.join(10)
    assert [outcome for _, outcome in earlier] == [["set up"], ["set up"]]
    start = time.monotonic()
    later = _waiting(connect_store("127.0.0.1", port, 2, 30.0), 1, 2, 30.0)
    later[0].join(10)
    assert time.monotonic() - start < 5.0
    (error,) = later[1]
    assert isinstance(error, DistributedError), repr(error)
    assert str(error).startswith("pipeline rank 1 of 2: rank 1 arrived here before: "), str(error)
