"""``follow_distributed_training``: a follower rank runs the epochs the root commands."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.to_thread
import torch

from lamploop.batches import BatchStreamFactory
from lamploop.checkpoint.extras import CheckpointExtra
from lamploop.control.commands import ControlFollower, Train, Valid
from lamploop.distributed.drive import (
    FAILURES,
    OptimizerFactory,
    abort_run,
    check_place,
    named_peer_failures,
    telling_peers_on_failure,
    until_a_peer_aborts,
)
from lamploop.distributed.inputs import check_driver_arguments, check_follower_control
from lamploop.distributed.process_group import connect_store
from lamploop.distributed.rank_extras import rank_extras
from lamploop.distributed.replica import RankPlan, learning_rates, open_replica
from lamploop.distributed.sharded_checks import check_sharded_strategy
from lamploop.errors import ConfigurationError, StreamExhausted
from lamploop.loop.boundary import EpochStopped
from lamploop.loop.epoch_pass import ValidationStopped
from lamploop.loop.optimizer import make_optimizer
from lamploop.loop.stop_request import StopRequest
from lamploop.model import SupervisedModel
from lamploop.settings import RankSettingKeywords, TrainingSettings, Unpack, merged_settings
from lamploop.sync.collectives import AbortSignal
from lamploop.sync.strategy import AUTO, strategy_named

__all__ = ["follow_distributed_training"]


async def follow_distributed_training(
    *,
    rank: int,
    nranks: int,
    device: torch.device | str,
    control: ControlFollower,
    model: SupervisedModel,
    train_batches: BatchStreamFactory,
    validation_batches: BatchStreamFactory | None,
    accumulate_gradient_over_n_batches: int = 1,
    optimizer_factory: OptimizerFactory | None = None,
    settings: TrainingSettings | None = None,
    stop: StopRequest | None = None,
    checkpoint_extras: Mapping[str, CheckpointExtra] | None = None,
    **keywords: Unpack[RankSettingKeywords],
) -> None:
    """Follow the root's commands on rank ``rank`` until it sends ``Stop``.

    Args:
        rank: this rank, ``1 .. nranks - 1``.
        nranks: the number of ranks.
        device: where this rank trains.
        control: this follower's control channel, already entered.
        model: this rank's copy of the model (same parameter names, shapes and dtypes as
            the root's); its values are replaced by the root's at start.
        train_batches, validation_batches: stream factories, called with
            ``BatchContext(epoch, rank, nranks)``.
        optimizer_factory: needed when every rank steps (``"all_reduce"``); with
            ``strategy="auto"`` passing it on every follower selects ``all_reduce``.
        settings: the run's :class:`TrainingSettings`; those every rank holds
            (:attr:`TrainingSettings.EVERY_RANK`: the strategy, precision, clipping...) must
            equal the root's (see :func:`drive_distributed_training`), the others are the
            root's alone and not read here.
        keywords: the settings every rank holds, one keyword each (``strategy=``...), as
            before ``settings=`` (:class:`~lamploop.settings.RankSettingKeywords`); not
            together with ``settings=``.
        stop: set it (e.g. from a signal handler under torchrun) to stop every rank at the
            next step boundary; the root writes a checkpoint there and ends the run.
        checkpoint_extras: this rank's state beside the model (a stream's buffer...); the
            root's run must carry extras of the same names; after every training pass they
            are sent to the root, which saves them as ``<name>.rank<r>`` (see
            :func:`drive_distributed_training`).

    Raises:
        ConfigurationError: bad arguments; an unknown keyword, or a setting given both as a
            keyword and in ``settings=``.
        DistributedError: the tensor channel failed or the ranks disagree.
        ControlChannelError: the control channel failed (refused, root lost...).
    """
    async with telling_peers_on_failure(control):
        settings = merged_settings(follow_distributed_training, locals(), RankSettingKeywords)
        torch_device = check_place(nranks, device, "follow_distributed_training")
        where = f"follow_distributed_training (rank {rank})"
        check_driver_arguments(where, model, train_batches, validation_batches)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank < nranks:
            msg = f"follow_distributed_training: rank must be in 1..{nranks - 1}, got {rank!r}"
            raise ConfigurationError(msg)
        check_follower_control(where, control, nranks, rank)
        module = model.module

        def check_strategy() -> None:
            check_sharded_strategy("follow_distributed_training", settings, control=control)
            strategy = settings.strategy
            if (
                strategy != AUTO
                and strategy_named(strategy).steps_on_every_rank
                and optimizer_factory is None
            ):
                msg = (
                    f"follow_distributed_training: strategy {strategy!r} steps on every rank "
                    "and needs optimizer_factory"
                )
                raise ConfigurationError(msg)

        def set_up() -> torch.optim.Optimizer | None:
            module.to(torch_device)
            if optimizer_factory is None:
                return None
            return make_optimizer(optimizer_factory, module.parameters(), where="follow_distributed_training")

        try:
            check_strategy()
            optimizer = await anyio.to_thread.run_sync(set_up)
        except Exception:
            # Before this rank joined, the root could only see it leave ("exited with status 1"
            # under fit): join, so that this error reaches the root (now, or on leaving the channel).
            await _join_to_report(control)  # then telling_peers_on_failure tells it at once
            raise
        base_lrs = learning_rates(optimizer)  # before the root's optimizer state arrives
        rendezvous, commands = await control.join()

        async def connect() -> tuple[Any, str]:
            # Abandoned on cancellation (a peer lost meanwhile): torch's client cannot be interrupted.
            store = await anyio.to_thread.run_sync(
                connect_store,
                rendezvous.host,
                rendezvous.port,
                nranks,
                settings.collective_timeout,
                abandon_on_cancel=True,
            )
            return store, rendezvous.host

        plan = RankPlan(
            rank=rank,
            nranks=nranks,
            device=torch_device,
            model=model,
            optimizer=optimizer,
            base_lrs=base_lrs,
            train_batches=train_batches,
            validation_batches=validation_batches,
            settings=settings,
            stop=stop,
            extras=rank_extras(checkpoint_extras, rank, nranks),
        )

        async def run() -> None:
            async with open_replica(plan, connect, AbortSignal()) as replica:

                async def obey() -> None:
                    async for command in commands:
                        # A sharded model's: the root's actions (best model, checkpoint, result) first.
                        if replica.sharded is not None and await replica.sharded.follow_point():
                            return
                        if isinstance(command, Train):
                            try:
                                await replica.train(command.epoch, command.lr_factor)
                            except EpochStopped:
                                continue  # the root checkpoints and sends Stop
                            except StreamExhausted:
                                continue  # every rank's stream ended: the root ends the run and sends Stop

                        elif isinstance(command, Valid):
                            if validation_batches is None:
                                msg = (
                                    f"rank {rank}: the root validates in epoch {command.epoch}, "
                                    "but this rank has no validation_batches"
                                )
                                raise ConfigurationError(msg)
                            try:
                                await replica.validate(command.epoch)
                            except ValidationStopped:
                                continue  # a stop in validation: the root ends the epoch (or not), sends Stop
                        else:
                            return

                try:
                    await named_peer_failures(obey(), control, nranks)
                except FAILURES as exc:
                    await abort_run(control, exc)  # before the replica's teardown
                    raise

        # A root that leaves first, also while the ranks set up, ends the run here.
        await until_a_peer_aborts(run(), control)


async def _join_to_report(control: ControlFollower) -> None:
    """Join the root only so that this follower's failure, on leaving the channel, reaches it.

    Bounded by the channel's own waits (the connect, handshake and join timeouts, the
    heartbeat timeout); a channel that cannot join is left alone: the follower's own error
    is raised either way.
    """
    with contextlib.suppress(Exception):
        await control.join()
