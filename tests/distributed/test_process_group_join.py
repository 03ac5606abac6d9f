"""Joining a process group waits for the other ranks within reach of the abort signal.

Gloo's constructor waits for every rank inside torch for the whole collective timeout, out of
any signal's reach: a follower whose optimizer factory raised as the ranks set up left each
survivor's worker thread blocked there for 30 minutes after every rank's run had ended
(tests/test_acceptance_no_hangs_r3.py, the ``setup`` cases).  These tests take
:func:`new_process_group` alone, with a real ``TCPStore`` and real Gloo groups, ranks as threads.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
import torch

from lamploop.distributed import process_group, store_barrier
from lamploop.distributed.process_group import connect_store, create_store, new_process_group
from lamploop.errors import DistributedError
from lamploop.sync.collectives import AbortSignal, WaitAborted

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")


def _join(store: Any, rank: int, nranks: int, *, timeout: float, abort: AbortSignal | None = None) -> Any:
    return new_process_group(
        store, rank=rank, nranks=nranks, device=CPU, timeout=timeout, prefix="test", abort=abort
    )


def _barrier(store: Any, rank: int, nranks: int, *, timeout: float, abort: AbortSignal | None = None) -> None:
    """The wait before the group's constructor alone (its store may be a test's wrapper)."""
    words = process_group._joining_words(rank, nranks)
    store_barrier.wait_for_every_rank(
        store, rank=rank, nranks=nranks, timeout=timeout, words=words, abort=abort
    )


def _in_thread(work: Any) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:  # the outcome is what the test looks at
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_rank_waiting_for_one_that_never_comes_ends_when_the_abort_is_set() -> None:
    store, _ = create_store("127.0.0.1", 2, 30.0)
    abort = AbortSignal()
    thread, outcome = _in_thread(lambda: _join(store, 0, 2, timeout=30.0, abort=abort))
    time.sleep(0.5)
    assert thread.is_alive(), outcome  # rank 1 never comes: still waiting
    abort.set("rank 1 aborted the run: its optimizer factory raised")
    set_at = time.monotonic()
    thread.join(10)
    took = time.monotonic() - set_at
    assert not thread.is_alive(), "the join did not end after the abort"
    assert took < 2.0, took  # within a few looks at the store (the join's timeout is 30 s)
    (error,) = outcome
    assert isinstance(error, WaitAborted), repr(error)
    assert "rank 0: gave up waiting for the other ranks to join the process group" in str(error)
    assert "its optimizer factory raised" in str(error)


def test_a_rank_that_never_comes_is_named_after_the_timeout() -> None:
    store, port = create_store("127.0.0.1", 3, 30.0)
    clients = [store, connect_store("127.0.0.1", port, 3, 30.0)]
    joins = [_in_thread(lambda rank=rank: _join(clients[rank], rank, 3, timeout=1.0)) for rank in (0, 1)]
    start = time.monotonic()
    for thread, _ in joins:
        thread.join(20)
    took = time.monotonic() - start
    assert 0.9 <= took < 5.0, took
    for rank, (thread, outcome) in enumerate(joins):
        assert not thread.is_alive()
        (error,) = outcome
        assert isinstance(error, DistributedError), repr(error)
        assert not isinstance(error, WaitAborted), repr(error)
        # The first to time out names rank 2; the other may find that one gave up first.
        assert str(error) in (
            f"rank {rank} of 3: ranks [2] did not join the process group within 1 s",
            f"rank {rank} of 3: ranks [{1 - rank}] gave up joining the process group "
            f"(rank {1 - rank} timed out after 1 s); ranks [2] never reached it",
        )


def test_ranks_that_all_come_get_a_working_group_however_late_one_is() -> None:
    store, port = create_store("127.0.0.1", 2, 30.0)
    clients = [store, connect_store("127.0.0.1", port, 2, 30.0)]
    abort = AbortSignal()

    def join_and_sum(rank: int) -> float:
        if rank == 1:
            time.sleep(0.7)  # past several of rank 0's looks at the count
        group = _join(clients[rank], rank, 2, timeout=30.0, abort=abort)
        tensor = torch.tensor([float(rank + 1)])
        group.allreduce([tensor]).wait()
        return float(tensor.item())

    joins = [_in_thread(lambda rank=rank: join_and_sum(rank)) for rank in (0, 1)]
    for thread, _ in joins:
        thread.join(30)
    assert [outcome for _, outcome in joins] == [[3.0], [3.0]]
    assert not abort.is_set()


def test_ranks_that_come_after_one_gave_up_do_not_wait_for_it() -> None:
    """Rank 0 arrives, waits out its own timeout and leaves; ranks 1 and 2 come after.  Had its
    arrival stayed counted, they would pass into Gloo's constructor and wait there for rank 0,
    out of any signal's reach, for their whole (here 30 s) timeout."""
    store, port = create_store("127.0.0.1", 3, 30.0)
    clients = [store, *(connect_store("127.0.0.1", port, 3, 30.0) for _ in (1, 2))]
    with pytest.raises(DistributedError, match=r"rank 0 of 3: ranks \[1, 2\] did not join"):
        _join(clients[0], 0, 3, timeout=0.3)
    start = time.monotonic()
    # With abort signals of their own: a peer that timed out is no failure on its way to them.
    joins = [
        _in_thread(lambda rank=rank: _join(clients[rank], rank, 3, timeout=30.0, abort=AbortSignal()))
        for rank in (1, 2)
    ]
    for thread, _ in joins:
        thread.join(20)
    took = time.monotonic() - start
    assert took < 5.0, took  # at once, not after their 30 s timeout
    for rank, (thread, outcome) in zip((1, 2), joins, strict=True):
        assert not thread.is_alive()
        (error,) = outcome
        assert isinstance(error, DistributedError), repr(error)
        # (the other of the two may not have reached the store yet: named as not there)
        assert str(error).startswith(f"rank {rank} of 3: ranks [0] gave up joining the process group")


class _WatchedAbort(AbortSignal):
    """An abort signal that says when a join starts waiting on it (the grace for a peer's abort)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, seconds: float) -> bool:
        self.waiting.set()
        return super().wait(seconds)


def test_a_rank_finding_a_peer_gave_up_on_an_abort_raises_its_own_abort_when_it_comes() -> None:
    """CI (the soak phase): rank 2 failed as the ranks set up; the root heard first, gave up,
    and rank 1, which saw the root's giving up before its own channel told it of rank 2, named
    the root.  It waits for its own abort instead, which names rank 2 as the root's did."""
    store, port = create_store("127.0.0.1", 3, 30.0)
    follower = connect_store("127.0.0.1", port, 3, 30.0)
    watched = _WatchedAbort()
    aborts = [AbortSignal(), watched]
    joins = [
        _in_thread(
            lambda rank=rank: _join([store, follower][rank], rank, 3, timeout=30.0, abort=aborts[rank])
        )
        for rank in (0, 1)
    ]
    time.sleep(0.3)
    aborts[0].set("rank 2 aborted the run: its optimizer factory raised")
    joins[0][0].join(10)
    assert watched.waiting.wait(10), "rank 1 did not wait for its own abort after rank 0 gave up"
    assert joins[1][0].is_alive(), joins[1][1]
    aborts[1].set("rank 2 aborted the run: its optimizer factory raised")
    joins[1][0].join(10)
    for thread, outcome in joins:
        assert not thread.is_alive()
        (error,) = outcome
        assert isinstance(error, WaitAborted), repr(error)
        assert str(error).endswith("process group: rank 2 aborted the run: its optimizer factory raised")


def test_a_rank_whose_own_abort_never_comes_names_the_peer_that_gave_up_and_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(store_barrier, "PEER_ABORT_GRACE_S", 0.5)
    store, port = create_store("127.0.0.1", 3, 30.0)
    follower = connect_store("127.0.0.1", port, 3, 30.0)
    abort = AbortSignal()
    abort.set("rank 2 aborted the run")
    with pytest.raises(WaitAborted):
        _join(store, 0, 3, timeout=30.0, abort=abort)
    start = time.monotonic()
    with pytest.raises(DistributedError) as raised:
        _join(follower, 1, 3, timeout=30.0, abort=AbortSignal())
    assert 0.4 < time.monotonic() - start < 3.0
    assert not isinstance(raised.value, WaitAborted)
    assert str(raised.value) == (
        "rank 1 of 3: ranks [0] gave up joining the process group (rank 0 was aborted: rank 2 "
        "aborted the run); ranks [2] never reached it"
    )


class _PausedAfterArriving:
    """A rank's store that holds the rank between its arrival and what it does next."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.arrived = threading.Event()
        self.go_on = threading.Event()

    def add(self, key: str, amount: int) -> int:
        count = int(self._store.add(key, amount))
        self.arrived.set()
        assert self.go_on.wait(10)
        return count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_rank_giving_up_between_the_last_arrival_and_its_word_stops_every_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last rank has arrived (the count says all came) but not yet said so when rank 0's
    abort comes: rank 0's giving up holds, and the last rank raises too instead of building
    a group that rank 0 will never join."""
    monkeypatch.setattr(store_barrier, "PEER_ABORT_GRACE_S", 0.5)
    store, port = create_store("127.0.0.1", 3, 30.0)
    clients = [store, *(connect_store("127.0.0.1", port, 3, 30.0) for _ in (1, 2))]
    aborts = [_WatchedAbort() for _ in range(3)]

    def wait(rank: int, client: Any) -> str:
        _barrier(client, rank, 3, timeout=30.0, abort=aborts[rank])
        return "built"

    early = [_in_thread(lambda rank=rank: wait(rank, clients[rank])) for rank in (0, 1)]
    time.sleep(0.2)
    last_store = _PausedAfterArriving(clients[2])
    last = _in_thread(lambda: wait(2, last_store))
    assert last_store.arrived.wait(10)
    aborts[0].set("rank 0's stream failed")
    early[0][0].join(10)  # rank 0 gave up
    last_store.go_on.set()
    joins = [*early, last]
    for thread, _ in joins:
        thread.join(10)
    results = [outcome[0] for _, outcome in joins]
    assert isinstance(results[0], WaitAborted), results
    for result in results[1:]:
        assert isinstance(result, DistributedError), results
        assert not isinstance(result, WaitAborted), results
        assert (
            "ranks [0] gave up joining the process group (rank 0 was aborted: rank 0's stream failed)"
            in str(result)
        )


def test_a_last_rank_that_stops_before_its_word_is_named_as_such() -> None:
    """Every rank reached the store, but the last one froze before saying all came: the
    others time out saying so, not that ranks ``[]`` never came."""
    store, port = create_store("127.0.0.1", 2, 30.0)
    follower: Any = _PausedAfterArriving(connect_store("127.0.0.1", port, 2, 30.0))
    waiting = _in_thread(lambda: _barrier(store, 0, 2, timeout=0.5))
    time.sleep(0.1)
    frozen = _in_thread(lambda: _barrier(follower, 1, 2, timeout=30.0))
    waiting[0].join(10)
    follower.go_on.set()
    frozen[0].join(10)
    (error,) = waiting[1]
    assert isinstance(error, DistributedError), repr(error)
    assert str(error) == (
        "rank 0 of 2: every rank reached the store, but the last of them did not confirm that they "
        "all came within 0.5 s (it stopped answering)"
    )
    (late,) = frozen[1]
    assert (
        str(late) == "rank 1 of 2: ranks [0] gave up joining the process group (rank 0 timed out after 0.5 s)"
    )


def test_an_abort_as_the_last_rank_arrives_sends_every_rank_the_same_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0's abort comes just as rank 2, the last, arrives.  Either all three build the
    group (the abort came after all of them were there) or none does: with the count alone,
    rank 0 could find everyone there and go on into Gloo's constructor while rank 1, looking
    after rank 0 gave up, raised, leaving ranks 0 and 2 waiting in the constructor for it."""
    monkeypatch.setattr(store_barrier, "PEER_ABORT_GRACE_S", 0.5)  # rank 2 has no abort of its own
    for delay in (0.0, 0.002, 0.005, 0.01, 0.02, 0.04):
        store, port = create_store("127.0.0.1", 3, 30.0)
        clients = [store, *(connect_store("127.0.0.1", port, 3, 30.0) for _ in (1, 2))]
        aborts = [AbortSignal() for _ in range(3)]

        def join_and_sum(
            rank: int, clients: list[Any] = clients, aborts: list[AbortSignal] = aborts
        ) -> float:
            group = _join(clients[rank], rank, 3, timeout=5.0, abort=aborts[rank])
            tensor = torch.tensor([float(rank + 1)])
            group.allreduce([tensor]).wait()
            return float(tensor.item())

        early = [_in_thread(lambda rank=rank: join_and_sum(rank)) for rank in (0, 1)]
        time.sleep(0.2)
        last = _in_thread(lambda: join_and_sum(2))
        time.sleep(delay)
        aborts[0].set("rank 0's stream failed")
        aborts[1].set("rank 0's stream failed")  # as its channel would tell it
        joins = [*early, last]
        for thread, _ in joins:
            thread.join(20)
        assert not any(thread.is_alive() for thread, _ in joins)
        results = [outcome[0] for _, outcome in joins]
        built = [result == 6.0 for result in results]
        assert all(built) or not any(built), (delay, results)
        if not any(built):
            assert all(isinstance(result, WaitAborted) for result in results[:2]), (delay, results)
            assert isinstance(results[2], DistributedError), (delay, results)


def test_a_store_that_goes_away_is_named_as_the_cause() -> None:
    """The root's store closes (its process died) while a follower waits for the others."""
    store, port = create_store("127.0.0.1", 2, 30.0)
    client = connect_store("127.0.0.1", port, 2, 5.0)
    thread, outcome = _in_thread(lambda: _join(client, 1, 2, timeout=30.0))
    time.sleep(0.3)
    del store  # the last reference: the server stops
    gc.collect()
    thread.join(20)
    assert not thread.is_alive(), "still waiting on a store that is gone"
    (error,) = outcome
    assert isinstance(error, DistributedError), repr(error)
    assert str(error).startswith(
        "rank 1 of 2: the root's store stopped answering as the ranks waited to join the process group "
        "(is the root gone?): "
    ), str(error)


class _HeldAfterDeciding:
    """A rank's store that holds the rank once it proposed a decision, until ``go_on`` is set."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.deciding = threading.Event()
        self.go_on = threading.Event()

    def compare_set(self, key: str, expected: str, desired: str) -> Any:
        decision = self._store.compare_set(key, expected, desired)
        if key == "decision":
            self.deciding.set()
            assert self.go_on.wait(10)
        return decision

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_rank_arriving_just_as_the_timeout_passes_is_named_as_late() -> None:
    """Rank 1 arrives just after rank 0's timeout made the decision: rank 0 names rank 1 as the
    rank that did not come in time, not "the last of them did not confirm" (which it said,
    naming nobody, when it looked at who had come only after deciding)."""
    store, port = create_store("127.0.0.1", 2, 30.0)
    held: Any = _HeldAfterDeciding(store)
    waiting = _in_thread(lambda: _barrier(held, 0, 2, timeout=0.3))
    assert held.deciding.wait(10)
    late = _in_thread(lambda: _barrier(connect_store("127.0.0.1", port, 2, 30.0), 1, 2, timeout=30.0))
    time.sleep(0.3)  # rank 1 has arrived, too late: rank 0's decision holds
    held.go_on.set()
    for thread, _ in (waiting, late):
        thread.join(10)
    (error,) = waiting[1]
    assert str(error) == "rank 0 of 2: ranks [1] did not join the process group within 0.3 s", str(error)
    (late_error,) = late[1]
    assert str(late_error) == (
        "rank 1 of 2: ranks [0] gave up joining the process group (rank 0 timed out after 0.3 s)"
    ), str(late_error)
