"""Process groups: the root's store, the followers' clients of it, and one group per rank.

The root opens a ``torch.distributed.TCPStore`` on a free port and hands its address to
the followers through the control channel (lamp did the same with NCCL's unique id), so
nothing reads ``MASTER_ADDR``.  Every rank then builds a process-group *object* over the
store (Gloo for CPU devices, NCCL for CUDA ones), never the global default group, so
several can live in one process (``local_data_parallel_training_loop``).
"""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable
from typing import NoReturn

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from lamploop.distributed.network import gloo_interface, local_address_towards
from lamploop.errors import ConfigurationError, DistributedError
from lamploop.sync.collectives import POLL_S, AbortSignal, Group, WaitAborted

__all__ = [
    "RESOLVE_TIMEOUT_S",
    "client_of_store",
    "connect_store",
    "create_store",
    "new_process_group",
    "resolve_host",
]

RESOLVE_TIMEOUT_S = 30.0
"""How long the root waits for its store's host name to resolve."""

_TRIES_LEFT_SHARE = 3.0
"""A try of torch's store client gets the time left divided by this (it overruns by up to 2.5 times)."""

_SHORTEST_TRY_S = 0.1

_ARRIVED_KEY = "arrived"
"""The store's count of the ranks that reached :func:`new_process_group` (each also sets its own key)."""

_DECISION_KEY = "decision"
"""Set once, by whoever comes first: :data:`_ALL_CAME` by the last rank to arrive, or
``"<rank>:<why>"`` by a rank that stopped waiting before that.  Every rank acts on it."""

_ALL_CAME = "all came"

_ABORTED = "aborted: "
"""How a rank's ``why`` starts when it stopped waiting because the run failed elsewhere."""

PEER_ABORT_GRACE_S = 5.0
"""How long a rank that finds a peer gave up because the run failed elsewhere waits for that
failure to reach it too (its channel tells it within milliseconds), so that it names the failing
rank as the others do; past it, it raises the peer's giving up instead."""


async def resolve_host(host: str, where: str) -> None:
    """Check that ``host`` resolves, within :data:`RESOLVE_TIMEOUT_S`.

    torch's store retries a name that does not resolve for many minutes, on the calling
    thread and past any cancellation: the name is looked up here first, on a thread that
    a timeout can leave behind.

    Raises:
        ConfigurationError: ``host`` does not resolve.
        DistributedError: the lookup took longer than :data:`RESOLVE_TIMEOUT_S`.
    """
    try:
        with anyio.fail_after(RESOLVE_TIMEOUT_S):
            await anyio.to_thread.run_sync(socket.getaddrinfo, host, None, abandon_on_cancel=True)
    except TimeoutError:
        msg = f"{where}: host {host!r:.100} did not resolve within {RESOLVE_TIMEOUT_S:g} s"
        raise DistributedError(msg) from None
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN:  # the resolver could not answer now: not a wrong name
            msg = f"{where}: host {host!r:.100} could not be looked up now: {exc}"
            raise DistributedError(msg) from None
        msg = f"{where}: host {host!r:.100} does not resolve to an address: {exc}"
        raise ConfigurationError(msg) from None
    except (OSError, UnicodeError) as exc:
        msg = f"{where}: host {host!r:.100} does not resolve to an address: {exc}"
        raise ConfigurationError(msg) from None


def create_store(host: str, nranks: int, timeout: float) -> tuple[dist.TCPStore, int]:
    """The root's store on a free port of ``host``, and that port."""
    try:
        store = dist.TCPStore(
            host,
            0,
            nranks,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
    except (RuntimeError, OSError) as exc:
        msg = f"the root cannot open its store on {host}: {exc}"
        raise DistributedError(msg) from exc
    return store, int(store.port)


def client_of_store(host: str, port: int, nranks: int, seconds: float) -> dist.TCPStore:
    """A client of the ``TCPStore`` on ``host:port``, given up within about ``seconds``.

    torch's client, given a timeout and nothing listening, retries past it (it gave up after
    1.7-2.5 times its timeout here, after a random back-off): it is tried with a third of the
    time left, again until ``seconds`` are spent.  The client then waits up to ``seconds`` in
    the store's own operations.

    Raises:
        RuntimeError: (torch's ``DistNetworkError``, ``DistStoreError``) the store was not
            reached in time; the last try's error.
    """
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        share = datetime.timedelta(seconds=max(left / _TRIES_LEFT_SHARE, _SHORTEST_TRY_S))
        try:
            store = dist.TCPStore(host, port, nranks, is_master=False, timeout=share)
        except (RuntimeError, OSError):
            if deadline - time.monotonic() <= _SHORTEST_TRY_S:
                raise
            continue
        store.set_timeout(datetime.timedelta(seconds=seconds))
        return store


def connect_store(host: str, port: int, nranks: int, timeout: float) -> dist.TCPStore:
    """A follower's client of the root's store, within about ``timeout`` seconds."""
    try:
        return client_of_store(host, port, nranks, timeout)
    except (RuntimeError, OSError) as exc:
        msg = f"cannot reach the root's store at {host}:{port}: {exc}"
        raise DistributedError(msg) from exc


def _gloo(rank: int, nranks: int, span: datetime.timedelta, root_host: str) -> Callable[[dist.Store], Group]:
    """A Gloo group's constructor: bound to ``GLOO_SOCKET_IFNAME`` if set, else to the interface
    that reaches the root."""
    interface = gloo_interface()
    if interface is not None:
        device = dist.ProcessGroupGloo.create_device(interface=interface)
    else:
        device = dist.ProcessGroupGloo.create_device(hostname=local_address_towards(root_host))
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # missing from the stubs
    options._timeout = span
    options._devices = [device]
    return lambda store: dist.ProcessGroupGloo(store, rank, nranks, options)


def _nccl(
    device: torch.device, rank: int, nranks: int, span: datetime.timedelta
) -> Callable[[dist.Store], Group]:
    """An NCCL group's constructor."""
    if not dist.is_nccl_available():
        msg = f"device {device} needs NCCL, which this build of torch lacks"
        raise DistributedError(msg)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = span
    return lambda store: dist.ProcessGroupNCCL(store, rank, nranks, options)


def new_process_group(
    store: dist.Store,
    *,
    rank: int,
    nranks: int,
    device: torch.device,
    timeout: float,
    prefix: str,
    root_host: str = "127.0.0.1",
    abort: AbortSignal | None = None,
) -> Group:
    """A Gloo (CPU) or NCCL (CUDA) process group over ``store`` (blocks until every rank joins).

    ``root_host`` is the address the ranks reach the root at: Gloo binds to the local
    interface that routes there (see :mod:`lamploop.distributed.network`).  The wait for the
    other ranks ends when ``abort`` is set (:class:`~lamploop.sync.collectives.WaitAborted`),
    when another rank gave up, or after ``timeout`` seconds
    (:class:`~lamploop.errors.DistributedError`).
    """
    scoped = dist.PrefixStore(prefix, store)
    span = datetime.timedelta(seconds=timeout)
    try:
        # Whatever can fail on this rank alone, before it counts as arrived: past the count,
        # the others wait for it inside torch, out of the abort signal's reach.
        if device.type == "cuda":
            construct = _nccl(device, rank, nranks, span)
        elif device.type == "cpu":
            construct = _gloo(rank, nranks, span, root_host)
        else:
            msg = f"device type {device.type!r} is not supported by the tensor channel (cpu or cuda)"
            raise ConfigurationError(msg)
        _wait_for_every_rank(scoped, rank=rank, nranks=nranks, timeout=timeout, abort=abort)
        return construct(scoped)
    except RuntimeError as exc:
        msg = f"rank {rank} of {nranks} could not join the process group: {exc}"
        raise DistributedError(msg) from exc


def _wait_for_every_rank(
    store: dist.Store, *, rank: int, nranks: int, timeout: float, abort: AbortSignal | None
) -> None:
    """Until every rank has reached the store, looking at ``abort`` between looks at the store.

    Gloo's and NCCL's constructors wait for the other ranks inside torch, out of any signal's
    reach, for the whole collective timeout: a rank that failed as the ranks set up (its
    optimizer factory raised) left its peers' worker threads blocked there for 30 minutes
    after their runs had ended.  So the ranks first agree, through the store, whether they
    all came: the last rank to arrive and a rank that stops waiting (aborted, timed out) each
    try to set :data:`_DECISION_KEY`, atomically, and the first one wins; every rank then does
    what it says, also one that wanted to stop but found everyone had come.  No rank passes
    into a constructor unless every rank does.

    Raises:
        WaitAborted: ``abort`` was set (also soon after a peer gave up on an abort of its own).
        DistributedError: the timeout passed (naming the ranks that never came), another rank
            gave up (naming it and why), or the store stopped answering.
    """
    try:
        store.set(f"{_ARRIVED_KEY}/{rank}", "1")
        decision = None
        if int(store.add(_ARRIVED_KEY, 1)) == nranks:
            decision = _decide(store, _ALL_CAME)
        deadline = time.monotonic() + timeout
        pause = 0.001
        while decision is None:
            if store.check([_DECISION_KEY]):
                decision = bytes(store.get(_DECISION_KEY)).decode(errors="replace")
            elif abort is not None and abort.is_set():
                decision = _decide(store, f"{rank}:{_ABORTED}{abort.reason}")
            elif time.monotonic() >= deadline:
                decision = _decide(store, f"{rank}:timed out after {timeout:g} s")
            else:
                time.sleep(pause)
                pause = min(pause * 2, POLL_S / 2)
        if decision != _ALL_CAME:
            _raise_gave_up(store, decision, rank=rank, nranks=nranks, timeout=timeout, abort=abort)
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError, DistStoreError
        msg = f"rank {rank} of {nranks}: the root's store stopped answering as the ranks joined the"
        msg += f" process group (is the root gone?): {exc}"
        raise DistributedError(msg) from exc


def _decide(store: dist.Store, decision: str) -> str:
    """Set the ranks' decision to ``decision`` unless one was set first: the decision that holds."""
    return bytes(store.compare_set(_DECISION_KEY, "", decision)).decode(errors="replace")


def _raise_gave_up(
    store: dist.Store, decision: str, *, rank: int, nranks: int, timeout: float, abort: AbortSignal | None
) -> NoReturn:
    """Rank ``decision``'s rank gave up waiting: raise why, as this rank's own abort where it can.

    A peer that gave up because the run failed elsewhere gave up on a failure this rank's
    channel is about to report too; waiting for it (:data:`PEER_ABORT_GRACE_S`) lets this rank
    name the failing rank (``PeerLostError`` from its channel) rather than the one that gave up.
    """
    who, _, why = decision.partition(":")
    missing = _ranks(store, nranks, _ARRIVED_KEY, False)
    if who == str(rank):
        if abort is not None and why.startswith(_ABORTED):
            raise _aborted(rank, abort)
        if missing:
            msg = f"rank {rank} of {nranks}: ranks {missing} did not join the process group"
            msg += f" within {timeout:g} s"
        else:  # the last to arrive stopped (died, froze) before it could say so
            msg = (
                f"rank {rank} of {nranks}: every rank reached the store, but the last of them did not confirm"
            )
            msg += f" that they all came within {timeout:g} s (it stopped answering)"
        raise DistributedError(msg)
    if abort is not None and why.startswith(_ABORTED) and abort.wait(PEER_ABORT_GRACE_S):
        raise _aborted(rank, abort)
    what = f"was {why}" if why.startswith(_ABORTED) else why
    msg = f"rank {rank} of {nranks}: ranks [{who}] gave up joining the process group (rank {who} {what})"
    if missing:
        msg += f"; ranks {missing} never reached it"
    raise DistributedError(msg)


def _aborted(rank: int, abort: AbortSignal) -> WaitAborted:
    msg = f"rank {rank}: gave up waiting for the other ranks to join the process group: {abort.reason}"
    return WaitAborted(msg)


def _ranks(store: dist.Store, nranks: int, key: str, marked: bool) -> list[int]:
    """The ranks whose mark under ``key`` is there (``marked``) or not."""
    return [rank for rank in range(nranks) if store.check([f"{key}/{rank}"]) == marked]
