"""One rank's share of a training run: the epoch functions the root and the followers share.

The root and every follower open a :class:`Replica` with :func:`open_replica` and call the
same :meth:`Replica.train` / :meth:`Replica.validate`; they differ only in who decides
what runs next (the root's epoch loop, or the commands a follower receives).

This module opens and closes a replica (:class:`RankPlan`, :func:`open_replica`); the
class and its epoch functions are in :mod:`lamploop.distributed.replica_epochs`, and are
importable from here too.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import attrs
import torch

from lamploop.batches import BatchStreamFactory
from lamploop.checkpoint import RngStates
from lamploop.distributed.boundaries import RankBoundary, SavePosition, StopRequest
from lamploop.distributed.initial_sync import initial_sync, share_resume_point
from lamploop.distributed.process_group import new_process_group
from lamploop.distributed.rank_extras import RankExtras, SyncState
from lamploop.distributed.replica_epochs import (
    Replica,
    learning_rates,
    saved_beside_optimizer,
    set_learning_rate_factor,
)
from lamploop.distributed.sharded_rank import ShardedRank
from lamploop.distributed.worker import EpochRunner, RankThread, open_rank_thread, run_here, worker_runner
from lamploop.errors import ConfigurationError, mark_detected_by_every_rank
from lamploop.loop.boundary import EpochPosition
from lamploop.loop.stop_aware import stop_aware_batches
from lamploop.model import SupervisedModel
from lamploop.settings import TrainingSettings
from lamploop.sync.channel import SingleProcessChannel, TensorChannel
from lamploop.sync.collectives import AbortSignal, Collectives
from lamploop.sync.fsdp import FullyShard
from lamploop.sync.group_channel import ProcessGroupChannel
from lamploop.sync.strategy import SyncStrategy, keeps_state, optimizer_state_per_rank

__all__ = ["Replica", "learning_rates", "open_replica", "saved_beside_optimizer", "set_learning_rate_factor"]

_STORE_PREFIX = "lamploop"


def _stop_request(stop: StopRequest | None) -> StopRequest:
    """The caller's stop request, or a fresh one that nothing outside sets (the drivers' ``stop=None``)."""
    return StopRequest() if stop is None else stop


@attrs.frozen(kw_only=True)
class RankPlan:
    """What one rank brings to :func:`open_replica`.

    Attributes:
        rank, nranks: its place.
        device: where it trains.
        model: its model (already on ``device``).
        optimizer: its optimizer (``None``: it has no factory).
        base_lrs: the optimizer's learning rates before any factor.
        train_batches, validation_batches: its stream factories.
        settings: the run's settings.
        extras: its checkpoint extras (see :mod:`lamploop.distributed.rank_extras`), if any.
        best: the root's best model to resume with (a sharded model's: cut into every rank's shards).
        shards_from: the root's sharded checkpoint that every rank loads its shards from.
    """

    rank: int
    nranks: int
    device: torch.device
    model: SupervisedModel
    optimizer: torch.optim.Optimizer | None
    base_lrs: tuple[float, ...]
    train_batches: BatchStreamFactory
    validation_batches: BatchStreamFactory | None
    settings: TrainingSettings
    stop: StopRequest = attrs.field(factory=StopRequest, converter=_stop_request)  # None: a fresh one
    save: SavePosition | None = None
    resume: tuple[EpochPosition | None, Sequence[RngStates]] | None = None
    saved: Mapping[str, Any] = attrs.field(factory=dict)
    extras: RankExtras | None = None
    best: Mapping[str, torch.Tensor] = attrs.field(factory=dict)
    shards_from: pathlib.Path | None = None

    def replica(
        self,
        channel: TensorChannel,
        optimizer: torch.optim.Optimizer | None,
        runner: EpochRunner,
        boundary: RankBoundary,
        resume_at: EpochPosition | None,
        saved: Mapping[str, Any],
        abort: AbortSignal,
        sharded: ShardedRank | None = None,
    ) -> Replica:
        """The replica of this plan on ``channel``.

        Its training and validation streams end when ``abort`` is set: a rank waiting for samples (a buffer
        no producer fills) would otherwise never reach the collective that notices the failure.
        """
        return Replica(
            model=self.model if sharded is None else attrs.evolve(self.model, module=sharded.module),
            channel=channel,
            train_batches=stop_aware_batches(self.train_batches, abort),
            validation_batches=_stop_aware(self.validation_batches, abort),
            settings=self.settings,
            device=self.device,
            optimizer=optimizer,
            base_lrs=self.base_lrs,
            run_epoch=runner,
            boundary=boundary,
            resume_at=resume_at,
            saved=saved,
            extras=self.extras,
            sharded=sharded,
        )


def _stop_aware(batches: BatchStreamFactory | None, abort: AbortSignal) -> BatchStreamFactory | None:
    return None if batches is None else stop_aware_batches(batches, abort)


def _check_fp16_strategy(settings: TrainingSettings, strategy: SyncStrategy) -> None:
    """Refuse fp16 with a strategy that steps on the root alone; on every rank alike (the
    strategy was agreed on, the precision is the run's)."""
    if settings.precision == "fp16" and not strategy.steps_on_every_rank:
        msg = (
            f"precision='fp16' needs a strategy that steps on every rank (all_reduce), "
            f"not {strategy.name!r}: only the root would see the summed gradients' overflows"
        )
        raise mark_detected_by_every_rank(ConfigurationError(msg))


def _share_saved(
    collectives: Collectives, settings: TrainingSettings, saved: Mapping[str, Any]
) -> Mapping[str, Any]:
    """Every rank goes on from the root's saved loss scale and scheduler (a resumed run's checkpoint)."""
    if settings.precision != "fp16" and settings.lr_scheduler is None:
        return {}
    shared: Mapping[str, Any] = collectives.broadcast_json(
        dict(saved) if collectives.rank == 0 else None, "saved loss scale and scheduler"
    )
    return shared


_Joined = tuple[
    ProcessGroupChannel,
    torch.optim.Optimizer | None,
    EpochPosition | None,
    bool,
    Mapping[str, Any],
    ShardedRank | None,
]
"""What a rank has once the ranks met: channel, optimizer, resume point, keep RNGs?, saved extras,
and its sharded model's rank (strategy fsdp)."""


def _boundary(plan: RankPlan, collectives: Collectives | None, keep_rngs: bool) -> RankBoundary:
    return RankBoundary(
        collectives,
        plan.stop,
        keep_rngs=keep_rngs,
        save=plan.save,
        every_steps=plan.settings.checkpoint_every_n_steps,
        every_seconds=plan.settings.checkpoint_every_seconds,
    )


def _close_profiler(replica: Replica) -> None:
    """The run is over here: a profiling window still open writes what it recorded."""
    if replica.profiler is not None:
        replica.profiler.close()


async def _close_profiler_on(thread: RankThread, replica: Replica) -> None:
    """:func:`_close_profiler` on the rank's thread, where its epochs started the profiler: torch
    keeps the profiling session per thread (closed from another, the process crashed).  A thread
    given up on is blocked: its profiler is left as it is."""
    if replica.profiler is None or thread.given_up:
        return
    with anyio.CancelScope(shield=True):
        await thread.run(functools.partial(_close_profiler, replica))


@asynccontextmanager
async def open_replica(
    plan: RankPlan, connect: Callable[[], Awaitable[tuple[Any, str]]], abort: AbortSignal
) -> AsyncIterator[Replica]:
    """This rank's :class:`Replica` on its tensor channel, set up and torn down.

    ``connect`` gives the store the process group is built over and the root's address
    (unused with one rank);
    ``abort`` ends the rank's collective waits when the run fails elsewhere.
    """
    if plan.nranks == 1:
        resume_at = None
        if plan.resume is not None:
            resume_at, rngs = plan.resume
            if rngs:
                rngs[0].restore()
        boundary = _boundary(plan, None, plan.save is not None)
        replica = plan.replica(
            SingleProcessChannel(), plan.optimizer, run_here, boundary, resume_at, plan.saved, abort
        )
        try:
            yield replica
        finally:
            _close_profiler(replica)
        return
    store, root_host = await connect()
    async with (
        open_rank_thread(abort) as thread,
        _ranks_replica(plan, store, root_host, abort, thread) as replica,
    ):
        yield replica


@asynccontextmanager
async def _ranks_replica(
    plan: RankPlan, store: Any, root_host: str, abort: AbortSignal, thread: RankThread
) -> AsyncIterator[Replica]:
    """:func:`open_replica` of one of several ranks: joined over ``store``, its work on ``thread``."""
    settings = plan.settings

    def join() -> _Joined:
        group = new_process_group(
            store,
            rank=plan.rank,
            nranks=plan.nranks,
            device=plan.device,
            timeout=settings.collective_timeout,
            prefix=_STORE_PREFIX,
            root_host=root_host,
            abort=abort,
        )
        collectives = Collectives(
            group,
            rank=plan.rank,
            nranks=plan.nranks,
            device=plan.device,
            timeout=settings.collective_timeout,
            abort=abort,
        )
        try:
            module = plan.model.module
            strategy, optimizer = initial_sync(collectives, module, plan.optimizer, settings.strategy)
            # Before anything runs that only some settings start (a broadcast of a scheduler's
            # state, say): ranks that differ would wait on each other until collective_timeout.
            # The strategy as settled (``"auto"`` resolved): compared by initial_sync already.
            collectives.check_agreement(
                "the settings every rank must hold alike",
                attrs.evolve(settings, strategy=strategy.name).every_rank_fingerprint(),
            )
            _check_fp16_strategy(settings, strategy)
            saved = _share_saved(collectives, settings, plan.saved)
            resume_at, keep_rngs = share_resume_point(collectives, plan.resume, plan.save is not None)
            sharded = None
            if isinstance(strategy, FullyShard):  # after the root's state reached every rank
                sharded = ShardedRank.set_up(
                    collectives, abort, strategy, module, optimizer, plan.best, plan.shards_from
                )
                optimizer = sharded.optimizer
            extras = (
                plan.extras if plan.extras is not None else RankExtras({}, rank=plan.rank, nranks=plan.nranks)
            )
            extras.meet(collectives)  # on every rank, extras or not: a rank without them is refused here
            channel = ProcessGroupChannel(collectives, strategy, bucket_cap_mb=settings.bucket_cap_mb)
            if keeps_state(strategy):  # its state goes into checkpoints beside the extras
                own_optimizer = optimizer if optimizer_state_per_rank(strategy) else None
                extras.keep_sync_state(collectives, SyncState(channel.gradient_sync(module), own_optimizer))
        except BaseException:
            collectives.abandon()  # the ranks failed to agree or a peer was lost while they met
            raise
        return channel, optimizer, resume_at, keep_rngs, saved, sharded

    # Joining blocks until every rank arrives: off the event loop, which keeps the heartbeats.
    channel, optimizer, resume_at, keep_rngs, saved, sharded = await thread.run(join)
    failed = True
    try:
        boundary = _boundary(plan, channel.collectives, keep_rngs)
        boundary.shard_writer = sharded.writer if sharded is not None else None
        replica = plan.replica(
            channel, optimizer, worker_runner(thread), boundary, resume_at, saved, abort, sharded
        )
        try:
            yield replica
        finally:
            await _close_profiler_on(thread, replica)
        failed = False
    finally:
        # After a failure nothing in flight will complete: drop it rather than wait, and
        # keep the group alive (destroying it would block on that work).
        channel.close(abandon=failed)
        if failed:
            channel.collectives.abandon()
