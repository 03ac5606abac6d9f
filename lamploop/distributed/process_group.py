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

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from lamploop.distributed.network import gloo_interface, local_address_towards
from lamploop.distributed.store_barrier import BarrierWords, wait_for_every_rank
from lamploop.errors import ConfigurationError, DistributedError
from lamploop.sync.collectives import AbortSignal, Group

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
        # Gloo's and NCCL's constructors wait for the other ranks inside torch, out of any
        # signal's reach, for the whole collective timeout: a rank that failed as the ranks set up
        # (its optimizer factory raised) left its peers' worker threads blocked there for 30
        # minutes after their runs had ended.  So no rank passes into a constructor unless every
        # rank does, and the wait before it looks at `abort`.
        wait_for_every_rank(
            dist.PrefixStore("joined/", scoped),
            rank=rank,
            nranks=nranks,
            timeout=timeout,
            words=_joining_words(rank, nranks),
            abort=abort,
        )
        return construct(scoped)
    except RuntimeError as exc:
        msg = f"rank {rank} of {nranks} could not join the process group: {exc}"
        raise DistributedError(msg) from exc


def _joining_words(rank: int, nranks: int) -> BarrierWords:
    """What the errors of the wait before the group's constructor say."""
    return BarrierWords(
        me=f"rank {rank} of {nranks}",
        goal="join the process group",
        doing="joining the process group",
        store="the root's store",
        store_gone="is the root gone?",
    )
