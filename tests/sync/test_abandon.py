"""A failed run's process group, and what is still in flight on it, stay alive for good.

A Gloo thread that fails a pending collective when the peer finally exits drops its
reference to the operation; if that is the last one, the operation's destructor frees
Python objects it captured, which needs the interpreter.  While the interpreter
finalizes, that aborts the process (status -6) instead of letting it exit with status 1:
seen in CI when both sides of a cut control connection exited at once.  So
``Collectives.abandon`` keeps the operations and their tensors too; these tests check
that it does, on a real 2-rank Gloo group whose peer never joins.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from lamploop.distributed.process_group import connect_store, create_store, new_process_group
from lamploop.sync.abandon import abandoned_count
from lamploop.sync.collectives import AbortSignal, Collectives, WaitAborted

pytestmark = pytest.mark.timeout(60)


def _two_ranks() -> list[Collectives]:
    """Both ranks of a Gloo group in this process (forming it blocks until both join)."""
    store, port = create_store("127.0.0.1", 2, 20.0)
    stores = [store, connect_store("127.0.0.1", port, 2, 20.0)]
    groups: list[object] = [None, None]

    def join(rank: int) -> None:
        groups[rank] = new_process_group(
            stores[rank], rank=rank, nranks=2, device=torch.device("cpu"), timeout=20.0, prefix="abandon"
        )

    threads = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(g is not None for g in groups), "the 2-rank group did not form"
    return [
        Collectives(g, rank=r, nranks=2, device=torch.device("cpu"), timeout=20.0, abort=AbortSignal())
        for r, g in enumerate(groups)
    ]


def test_an_abandoned_group_keeps_its_pending_work_and_tensors_for_good() -> None:
    root, follower = _two_ranks()
    tensor = torch.ones(16)
    work = follower.all_reduce([tensor])  # the root never joins: this stays pending
    follower.abort.set("the test gave up")
    with pytest.raises(WaitAborted, match="the test gave up"):
        follower.wait(work, "sum the root never joins")
    # Gloo's own reference to the work cannot be seen from Python: count this process's
    # (into locals: pytest's assertion rewriting holds references of its own).  The one
    # the follower holds while the work is in flight must be held for good once abandoned.
    work_refs, tensor_refs = sys.getrefcount(work), sys.getrefcount(tensor)
    before = abandoned_count()
    follower.abandon()
    root.abandon()  # its destructor would wait for the follower's pending sum
    kept_work, kept_tensor = sys.getrefcount(work) - work_refs, sys.getrefcount(tensor) - tensor_refs

    assert abandoned_count() == before + 2
    # The follower's reference is gone with its bookkeeping; what abandon holds replaces it.
    assert kept_work >= 0, "the pending work is not kept: Gloo's thread could free it at exit"
    assert kept_tensor >= 0, "the pending work's tensor is not kept"


def test_work_already_waited_for_is_not_kept() -> None:
    root, follower = _two_ranks()
    tensors = [torch.full((4,), float(r + 1)) for r in range(2)]
    works = [c.all_reduce([t]) for c, t in zip((root, follower), tensors, strict=True)]
    for c, w in zip((root, follower), works, strict=True):
        c.wait(w, "sum")
    assert tensors[0].tolist() == [3.0] * 4
    work_refs = sys.getrefcount(works[1])
    follower.abandon()
    root.abandon()
    kept = sys.getrefcount(works[1]) - work_refs
    assert kept == 0


def test_an_abandoned_group_is_released_once_what_was_in_flight_has_ended() -> None:
    """``reclaim_ended`` keeps a group whose work is still pending, and releases it (with its
    work and tensors) once that work completed: a process that goes on after a failed run
    (``fit`` after its followers exited) does not keep every failed run's group."""
    from lamploop.sync.abandon import reclaim_ended

    root, follower = _two_ranks()
    tensor = torch.ones(4)
    work = follower.all_reduce([tensor])
    follower.abort.set("the test gave up")
    with pytest.raises(WaitAborted):
        follower.wait(work, "a sum the root has not joined yet")
    group = follower.group
    # Counted by this group's references: other tests' groups may be released meanwhile.
    follower.abandon()
    kept = sys.getrefcount(group)
    reclaim_ended()
    assert sys.getrefcount(group) == kept, "a group whose work is pending was released"
    root_sum = root.all_reduce([torch.ones(4)])  # the root joins: the pending sum completes
    root.wait(root_sum, "the root's side of the sum")
    work.wait()
    reclaim_ended()
    assert sys.getrefcount(group) < kept, "the abandoned group was not released once its work ended"
    assert tensor.tolist() == [2.0] * 4
