"""One barrier over a ``torch.distributed`` store: every rank leaves it the same way.

Both places where ranks wait for each other through rank 0's ``TCPStore`` before torch
takes over use it: the data-parallel ranks before they build their process group
(:mod:`lamploop.distributed.process_group`), and the pipeline's ranks before and after they
set up Gloo (:mod:`lamploop.pipeline.group`).

Each rank marks its arrival (a process arriving as a rank that another process arrived as
already gives up, naming the rank: counted twice, the ranks would go on without the rank that
is missing) and counts it.  Then the ranks agree, through the store, on how the barrier ends:
the last rank to arrive, and a rank that stops waiting (its run aborted, its own set-up
failed, its timeout passed), each try to set the decision key, atomically (``compare_set``),
and the first one wins.  Every rank then does what the decision says, also one that wanted to
stop but found everyone had come: either every rank goes on, or none does, and each names the
rank that gave up and why.  Rank 0, whose process holds the store, leaves only once every rank
that arrived has read the decision (within :data:`SEEN_WAIT_S`): were its process to end at
once, a rank still polling would find the store gone instead.  A barrier lives under a prefix
of its own (``dist.PrefixStore``): a store holds as many as it has prefixes, each used once.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from typing import NoReturn

import attrs
import torch.distributed as dist

from lamploop.errors import DistributedError
from lamploop.sync.collectives import POLL_S, AbortSignal, WaitAborted

__all__ = ["PEER_ABORT_GRACE_S", "SEEN_WAIT_S", "BarrierWords", "give_up", "wait_for_every_rank"]

PEER_ABORT_GRACE_S = 5.0
"""How long a rank that finds a peer gave up because the run failed elsewhere waits for that
failure to reach it too (its channel tells it within milliseconds), so that it names the failing
rank as the others do; past it, it raises the peer's giving up instead."""

_ARRIVED_KEY = "arrived"
"""The store's count of the ranks that arrived (each also sets its own ``arrived/<rank>``)."""

_DECISION_KEY = "decision"
"""Set once, by whoever comes first: :data:`_ALL_CAME` by the last rank to arrive, or
``"<rank>:<why>"`` by a rank that stopped waiting before that.  Every rank acts on it."""

_ALL_CAME = "all came"

_SEEN_KEY = "seen"
"""The store's count of the ranks that read the decision (rank 0 waits for it: see
:func:`_wait_until_every_rank_has_seen`)."""

SEEN_WAIT_S = 5.0
"""How long rank 0 waits, past the decision, for the ranks that arrived to have read it."""

_ABORTED = "aborted: "
"""How a rank's ``why`` starts when it stopped waiting because the run failed elsewhere."""

_FAILED = "failed: "
"""How a rank's ``why`` starts when it gave up because something of its own failed (:func:`give_up`)."""

_REASON_CHARS = 1_000
"""The most characters of a rank's reason kept in the store."""


@attrs.frozen
class BarrierWords:
    """What a barrier's errors call the rank, the barrier and the store.

    Attributes:
        me: this rank, as its errors start (``"rank 1 of 3"``).
        goal: what the ranks do to pass, after "did not" (``"join the process group"``).
        doing: the same as a gerund, after "gave up" (``"joining the process group"``).
        store: whose store it is, after "the ranks ... as" (``"the root's store"``).
        store_gone: a hint when the store stops answering (``"is the root gone?"``).
    """

    me: str
    goal: str
    doing: str
    store: str
    store_gone: str


def wait_for_every_rank(
    store: dist.Store,
    *,
    rank: int,
    nranks: int,
    timeout: float,
    words: BarrierWords,
    abort: AbortSignal | None = None,
) -> None:
    """Arrive at the barrier and wait until every rank has, or one gave up (see the module).

    ``abort`` is looked at between looks at the store: once it is set, this rank gives up (and
    so, through the decision, does every other).

    Raises:
        WaitAborted: ``abort`` was set (also soon after a peer gave up on an abort of its own).
        DistributedError: the timeout passed (naming the ranks that never came), another rank
            gave up (naming it and why), or the store stopped answering.
    """
    try:
        mark = secrets.token_hex(8)
        if bytes(store.compare_set(f"{_ARRIVED_KEY}/{rank}", "", mark)).decode(errors="replace") != mark:
            # Another process arrived as this rank first: counted twice, the ranks would go on
            # without the one that is missing and wait for it inside torch instead.
            why = (
                f"rank {rank} arrived here before: another process was given rank {rank} too, or this "
                "store still serves an earlier run (each rank is one process's, each run its own port)"
            )
            give_up(store, rank=rank, why=why)
            raise DistributedError(f"{words.me}: {why}")
        decision = proposed = None
        missing_at_timeout: list[int] | None = None
        if int(store.add(_ARRIVED_KEY, 1)) == nranks:
            decision = _decide(store, _ALL_CAME)
        deadline = time.monotonic() + timeout
        pause = 0.001
        while decision is None:
            if store.check([_DECISION_KEY]):
                decision = bytes(store.get(_DECISION_KEY)).decode(errors="replace")
            elif abort is not None and abort.is_set():
                proposed = f"{rank}:{_ABORTED}{abort.reason}"
                decision = _decide(store, proposed)
            elif time.monotonic() >= deadline:
                # Who was missing when this rank gave up: one arriving just after is late, not
                # "the last of them did not confirm".
                missing_at_timeout = _missing(store, nranks, gave_up=None)
                proposed = f"{rank}:timed out after {timeout:g} s"
                decision = _decide(store, proposed)
            else:
                time.sleep(pause)
                pause = min(pause * 2, POLL_S / 2)
        store.add(_SEEN_KEY, 1)
        if rank == 0:
            _wait_until_every_rank_has_seen(store, abort)
        if decision != _ALL_CAME:
            _raise_gave_up(
                store,
                decision,
                rank=rank,
                nranks=nranks,
                timeout=timeout,
                words=words,
                abort=abort,
                own=decision == proposed,
                missing_at_timeout=missing_at_timeout,
            )
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError, DistStoreError
        raise _store_gone(words, exc) from exc


def _wait_until_every_rank_has_seen(store: dist.Store, abort: AbortSignal | None) -> None:
    """Rank 0, whose process holds the store: until every rank that arrived has read the decision
    (within :data:`SEEN_WAIT_S`, or until ``abort``), so that its process ending at once (its
    next step failed, as every rank's does) leaves no rank that still polls finding the store
    gone instead of the decision."""
    deadline = time.monotonic() + SEEN_WAIT_S
    pause = 0.001
    while int(store.add(_SEEN_KEY, 0)) < int(store.add(_ARRIVED_KEY, 0)):
        if time.monotonic() >= deadline or (abort is not None and abort.is_set()):
            return
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def give_up(store: dist.Store, *, rank: int, why: str) -> None:
    """Rank ``rank`` will not arrive, because ``why``: the ranks waiting at the barrier stop
    and name it (unless every rank had arrived already).  A store that does not answer is
    passed over: the others then find out by their timeout or their store's failure."""
    with contextlib.suppress(RuntimeError, OSError):
        _decide(store, f"{rank}:{_FAILED}{why[:_REASON_CHARS]}")


def _decide(store: dist.Store, decision: str) -> str:
    """Set the ranks' decision to ``decision`` unless one was set first: the decision that holds."""
    return bytes(store.compare_set(_DECISION_KEY, "", decision)).decode(errors="replace")


def _raise_gave_up(
    store: dist.Store,
    decision: str,
    *,
    rank: int,
    nranks: int,
    timeout: float,
    words: BarrierWords,
    abort: AbortSignal | None,
    own: bool,
    missing_at_timeout: list[int] | None,
) -> NoReturn:
    """Rank ``decision``'s rank gave up waiting: raise why, as this rank's own abort where it can.

    A peer that gave up because the run failed elsewhere gave up on a failure this rank's
    channel is about to report too; waiting for it (:data:`PEER_ABORT_GRACE_S`) lets this rank
    name the failing rank (``PeerLostError`` from its channel) rather than the one that gave up.
    """
    who, _, why = decision.partition(":")
    missing = _missing(store, nranks, gave_up=who)
    if own:
        if missing_at_timeout:
            missing = missing_at_timeout
        if abort is not None and why.startswith(_ABORTED):
            raise _aborted(rank, words, abort)
        if missing:
            msg = f"{words.me}: ranks {missing} did not {words.goal} within {timeout:g} s"
        else:  # the last to arrive stopped (died, froze) before it could say so
            msg = (
                f"{words.me}: every rank reached the store, but the last of them did not confirm that they"
                f" all came within {timeout:g} s (it stopped answering)"
            )
        raise DistributedError(msg)
    if abort is not None and why.startswith(_ABORTED) and abort.wait(PEER_ABORT_GRACE_S):
        raise _aborted(rank, words, abort)
    what = f"was {why}" if why.startswith(_ABORTED) else why
    msg = f"{words.me}: ranks [{who}] gave up {words.doing} (rank {who} {what})"
    if missing:
        msg += f"; ranks {missing} never reached it"
    raise DistributedError(msg)


def _missing(store: dist.Store, nranks: int, *, gave_up: str | None) -> list[int]:
    """The ranks that have not arrived, but for ``gave_up`` (a rank that gave up before arriving)."""
    return [
        other
        for other in range(nranks)
        if str(other) != gave_up and not store.check([f"{_ARRIVED_KEY}/{other}"])
    ]


def _aborted(rank: int, words: BarrierWords, abort: AbortSignal) -> WaitAborted:
    return WaitAborted(f"rank {rank}: gave up waiting for the other ranks to {words.goal}: {abort.reason}")


def _store_gone(words: BarrierWords, exc: BaseException) -> DistributedError:
    what = f"{words.store} stopped answering as the ranks waited to {words.goal} ({words.store_gone})"
    return DistributedError(f"{words.me}: {what}: {exc}")
