"""A sliced collective wait never takes a work that completed as a slice ran out for a failed one.

``Collectives.wait`` waits in slices (to look at the abort signal between them).  A slice
that runs out raises ``RuntimeError("Operation timed out!")``; the work can complete before
the waiting thread looks at it (it takes the GIL back first: up to the switch interval, 5 ms,
when another thread computes).  Such a work succeeded, and its run must go on: it was taken
for failed ("the sum failed (a peer died?): Operation timed out!"), which ended a healthy run.

Real Gloo groups of two ranks in this process (one store, a thread per rank), the slice made
1 ms so that many slices run out, and a thread that holds the GIL as a training thread's
neighbours do: with the old look, about one wait in seven failed.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from lamploop.errors import DistributedError
from lamploop.sync import collectives
from lamploop.sync.collectives import Collectives, Group

WAITS = 150


def _groups(nranks: int) -> list[Group]:
    store = dist.HashStore()
    groups: list[Group] = [None] * nranks

    def join(rank: int) -> None:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = datetime.timedelta(seconds=30)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[rank] = dist.ProcessGroupGloo(store, rank, nranks, options)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(nranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return groups


@pytest.fixture
def busy_neighbour() -> Iterator[None]:
    """A thread that computes in Python: the GIL comes back to a waiting thread late."""
    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            pass

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(10)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("busy_neighbour")
def test_a_work_that_completes_as_a_slice_runs_out_is_a_success(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collectives, "_SLICE", datetime.timedelta(milliseconds=1))
    root, peer = _groups(2)
    waiting = Collectives(root, rank=0, nranks=2, device=torch.device("cpu"), timeout=30)
    for i in range(WAITS):
        tensor = torch.tensor([1.0])
        work = waiting.all_reduce([tensor])
        # The peer joins a little later, from its own thread: the root's slices run out meanwhile.
        joined = threading.Thread(target=lambda: peer.allreduce([torch.tensor([2.0])]).wait())
        joined.start()
        try:
            waiting.wait(work, f"sum {i}")
        finally:
            joined.join(30)
        assert tensor.item() == 3.0
    assert not waiting._in_flight  # every completed work left the list of what a failure abandons


@pytest.mark.timeout(60)
def test_a_wait_still_ends_at_the_timeout_and_still_fails_when_the_peer_goes() -> None:
    root, peer = _groups(2)
    waiting = Collectives(root, rank=0, nranks=2, device=torch.device("cpu"), timeout=0.3)
    work = waiting.all_reduce([torch.zeros(1)])
    began = time.monotonic()
    with pytest.raises(DistributedError, match=r"the lonely sum did not complete within 0.3 s"):
        waiting.wait(work, "lonely sum")  # the peer never joins
    assert time.monotonic() - began < 5
    del peer  # its group is destroyed: its connections close, the pending sum fails
    with pytest.raises(DistributedError, match=r"the lonely sum failed \(a peer died\?\)"):
        waiting.wait(work, "lonely sum")
    waiting.abandon()
