"""The pipeline's process group: one rank per stage, every wait bounded by its timeout.

``torch.distributed.pipelining`` finds ranks through ``torch.distributed``'s global
registry (``dist.get_rank(group)`` needs the default group), so unlike the data-parallel
loop, which builds process-group objects of its own, a pipeline uses the process's
*default* group: one pipeline per process, opened and closed by :func:`open_pipeline_group`.

Gloo carries the activations and gradients between CPU stages.  Its timeout bounds every
wait: a stage whose process dies closes its connections and its neighbours fail at once;
a stage that hangs (frozen, cut off) makes them fail after ``timeout`` seconds.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import attrs
import torch.distributed as dist

from lamploop.checks import check_host, check_int, check_seconds
from lamploop.distributed.process_group import client_of_store
from lamploop.distributed.store_barrier import BarrierWords, give_up, wait_for_every_rank
from lamploop.errors import ConfigurationError, DistributedError
from lamploop.transport.settings import check_int_in

__all__ = ["DEFAULT_PIPELINE_TIMEOUT_S", "PipelineGroup", "open_pipeline_group"]

DEFAULT_PIPELINE_TIMEOUT_S: Final = 300.0
"""How long a stage waits for a neighbour's activations or gradients (and for the others to
join) before it fails.  There is no heartbeat here: a hung stage is found only by this, and a
step slower than it is taken for a failure."""

_PREFIX = "lamploop-pipeline/"
_JOINED = "joined/"
_SET_UP = "set-up/"


@attrs.frozen
class PipelineGroup:
    """This process's place in the pipeline: it runs stage ``rank`` of ``world_size``.

    Attributes:
        rank: this process's rank, which is the index of the stage it runs.
        world_size: the number of ranks, which must equal the number of stages.
    """

    rank: int
    world_size: int


@contextmanager
def open_pipeline_group(
    *,
    rank: int,
    world_size: int,
    host: str,
    port: int,
    timeout: float = DEFAULT_PIPELINE_TIMEOUT_S,
    join_timeout: float | None = None,
) -> Iterator[PipelineGroup]:
    """Join the pipeline's Gloo process group (this process's default group) for the ``with`` block.

    Rank 0 opens a ``torch.distributed.TCPStore`` on ``host:port`` for the rendezvous; the
    others connect to it.  The block starts once every rank has set up its group.  Leaving
    the block destroys the group.  Gloo's connections close
    only when the process ends (neither destroying nor aborting the group closes them), so
    a rank whose training failed should let its process end: its neighbours then fail at
    once instead of at the timeout.

    Args:
        rank: this process's rank (the stage it runs).
        world_size: the number of ranks (stages).
        host, port: where rank 0's store listens (every rank passes the same).
        timeout: seconds that every send, receive and sum may wait: a stage that hangs is
            found after this long.
        join_timeout: seconds to wait for every rank to join (processes start at different
            times; default: ``max(timeout, 300)``).

    Raises:
        ConfigurationError: bad arguments, or this process already has a default group.
        DistributedError: the store could not be opened or reached, or the other ranks did
            not join (or set up their group) within ``join_timeout``, or one's set-up failed.
    """
    check_int("open_pipeline_group: world_size", world_size, 1)
    check_int("open_pipeline_group: rank", rank, 0)
    if rank >= world_size:
        msg = f"open_pipeline_group: rank must be in 0..{world_size - 1}, got {rank}"
        raise ConfigurationError(msg)
    check_int_in("open_pipeline_group: port", port, 1, 65535)
    check_host("open_pipeline_group: host", host)
    seconds = check_seconds("open_pipeline_group: timeout", timeout)
    if join_timeout is None:
        join_seconds = max(seconds, DEFAULT_PIPELINE_TIMEOUT_S)
    else:
        join_seconds = check_seconds("open_pipeline_group: join_timeout", join_timeout)
    if dist.is_initialized():
        msg = (
            "open_pipeline_group: this process already has a default process group; "
            "a pipeline needs it for itself (one pipeline per process)"
        )
        raise ConfigurationError(msg)
    joining = datetime.timedelta(seconds=join_seconds)
    try:
        if rank == 0:
            store = dist.TCPStore(
                host, port, world_size, is_master=True, timeout=joining, wait_for_workers=False
            )
        else:  # torch's own client overruns its timeout when nothing listens
            store = client_of_store(host, port, world_size, join_seconds)
    except (RuntimeError, OSError) as exc:
        what = "open its store on" if rank == 0 else "reach rank 0's store at"
        msg = f"pipeline rank {rank}: cannot {what} {host}:{port}: {exc}"
        raise DistributedError(msg) from exc
    scoped = dist.PrefixStore(_PREFIX, store)
    joined = dist.PrefixStore(_JOINED, scoped)
    unusable = _unusable_gloo_interface()
    if unusable is not None:
        # Found before any rank enters Gloo's set-up, where a rank waits for the others' keys
        # for `timeout`, out of the barrier's reach: so the others are told at once.
        give_up(joined, rank=rank, why=unusable)
        raise DistributedError(f"pipeline rank {rank} of {world_size}: {unusable}")
    # Everyone here first, within join_timeout: Gloo's own set-up waits only `timeout`.
    wait_for_every_rank(
        joined,
        rank=rank,
        nranks=world_size,
        timeout=join_seconds,
        words=_words(rank, world_size, "join the pipeline", "joining the pipeline"),
    )
    set_up = dist.PrefixStore(_SET_UP, scoped)
    try:
        dist.init_process_group(
            "gloo",
            store=scoped,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=seconds),
        )
    except (RuntimeError, OSError) as exc:
        give_up(set_up, rank=rank, why=str(exc))  # the others stop waiting for this rank
        msg = f"pipeline rank {rank} of {world_size}: could not set up its process group: {exc}"
        raise DistributedError(msg) from exc
    try:
        # Gloo's set-up ends on each rank when its own connections are made, not on all at once:
        # a rank that went on and failed at once (a model refused, as every rank refuses it) and
        # whose process then ended closed its connections under a neighbour still setting up,
        # which failed with Gloo's "remote worker crashing" instead of refusing the model too.
        words = _words(rank, world_size, "set up their group", "setting up the group")
        wait_for_every_rank(set_up, rank=rank, nranks=world_size, timeout=join_seconds, words=words)
        yield PipelineGroup(rank=rank, world_size=world_size)
    finally:
        dist.destroy_process_group()


def _unusable_gloo_interface() -> str | None:
    """Why Gloo cannot use an interface that ``GLOO_SOCKET_IFNAME`` names here, or ``None``
    (what ``init_process_group`` would find only once inside Gloo's set-up)."""
    for name in filter(None, os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")):
        try:
            dist.ProcessGroupGloo.create_device(interface=name)
        except RuntimeError as exc:
            return (
                f"GLOO_SOCKET_IFNAME names the network interface {name!r}, which Gloo cannot use here: {exc}"
            )
    return None


def _words(rank: int, world_size: int, goal: str, doing: str) -> BarrierWords:
    """What the errors of the pipeline's waits for its ranks say."""
    return BarrierWords(
        me=f"pipeline rank {rank} of {world_size}",
        goal=goal,
        doing=doing,
        store="rank 0's store",
        store_gone="is rank 0 gone?",
    )


def current_group(where: str) -> PipelineGroup:
    """The default group as a :class:`PipelineGroup` (rank and world size), refusing none."""
    if not dist.is_initialized():
        msg = f"{where}: no process group; run it inside `with open_pipeline_group(...)`"
        raise ConfigurationError(msg)
    return PipelineGroup(rank=dist.get_rank(), world_size=dist.get_world_size())
