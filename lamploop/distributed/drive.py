"""``drive_distributed_training``: the root rank runs the epoch loop and tells the followers what to run.

Launch (one process per rank; see docs/distributed.md)::

    # rank 0                                   # ranks 1..n-1
    async with TcpControlRoot(...) as control:  async with TcpControlFollower(...) as control:
        await drive_distributed_training(         await follow_distributed_training(
            nranks=n, control=control, ...)           rank=r, nranks=n, control=control, ...)

What happens, in order:

1. the root opens a ``torch.distributed`` store on a free port and hands its address to the
   followers through the control channel (no MASTER_ADDR);
2. every rank joins a process group over it (Gloo for CPU, NCCL for CUDA) and the ranks
   settle the strategy and the starting state (:mod:`lamploop.distributed.initial_sync`);
3. the root runs :func:`lamploop.epochs`; before each epoch it broadcasts ``Train`` /
   ``Valid`` and every rank runs the same :class:`~lamploop.distributed.replica.Replica`
   epoch, on a worker thread (:mod:`lamploop.distributed.worker`);
4. the root broadcasts ``Stop`` and copies the best model into its module.
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import torch

from lamploop.averaging import check_averaging_starts
from lamploop.batches import BatchStreamFactory
from lamploop.checkpoint import RngStates
from lamploop.checkpoint.checkpointer import Checkpointer
from lamploop.checkpoint.extras import CheckpointExtra
from lamploop.checkpoint.sharded import ShardsOnDisk
from lamploop.checks import check_host
from lamploop.control.commands import ControlRoot, Rendezvous, Stop
from lamploop.distributed.boundaries import SavePosition
from lamploop.distributed.inputs import check_driver_arguments, check_reporters
from lamploop.distributed.placement import checked_device
from lamploop.distributed.process_group import create_store, resolve_host
from lamploop.distributed.rank_extras import rank_extras
from lamploop.distributed.replica import (
    RankPlan,
    open_replica,
    saved_beside_optimizer,
)
from lamploop.distributed.root_epochs import CheckpointPosition, RootEpochs
from lamploop.distributed.root_setup import (
    OptimizerFactory,
    check_resume_point,
    check_root_arguments,
    install_result,
    set_up_root,
)
from lamploop.distributed.sharded_checks import SHARDED, check_sharded_strategy
from lamploop.distributed.worker import raised_by_work
from lamploop.errors import ConfigurationError, DistributedError, TrainingInterrupted
from lamploop.loop.boundary import EpochPosition
from lamploop.loop.stop_request import StopRequest
from lamploop.model import SupervisedModel
from lamploop.reporting.emitter import EventEmitter
from lamploop.reporting.events import PeerJoined, RunFinished, RunStarted
from lamploop.reporting.logging_reporter import finished_line
from lamploop.reporting.reporter import Reporter
from lamploop.schedules import LearningRateSchedule, noop
from lamploop.settings import SettingKeywords, TrainingSettings, Unpack, check_int, merged_settings
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData
from lamploop.summary import summarize
from lamploop.sync.collectives import AbortSignal

__all__ = ["CheckpointPosition", "OptimizerFactory", "drive_distributed_training", "named_peer_failures"]

S = TypeVar("S")
T = TypeVar("T")

LOST_PEER_GRACE_S = 3.0
"""A dead rank breaks a collective at once; its control connection tells which rank it was
a moment later."""


async def named_peer_failures(run: Awaitable[T], control: object | None, nranks: int) -> T:
    """Await ``run``; if a collective fails, give the control channel time to name the lost rank.

    The control channel cancels this task and raises :class:`PeerLostError` naming the rank
    if it notices one; otherwise the collective's :class:`DistributedError` stands.  An error
    that every rank detects itself (the ranks disagree...) is no lost rank: raised at once.
    """
    try:
        return await run
    except DistributedError as exc:
        if control is not None and nranks > 1 and not exc.detected_by_every_rank:
            await anyio.sleep(LOST_PEER_GRACE_S)
        raise


async def until_a_peer_aborts(run: Awaitable[T], control: object | None) -> T:
    """Await ``run``; if the channel says a peer left the run before it ended, cancel ``run`` and raise that.

    A rank blocked in a collective reads nothing from its channel.  The TCP channels cancel
    the block inside their ``async with`` when a peer goes; an in-process channel
    (:func:`~lamploop.local_control`) says so by ``wait_for_abort``, watched here, so that a
    rank that failed in one task does not hold the others in a collective until
    ``collective_timeout``.  A channel of your own without ``wait_for_abort`` is not watched.
    ``run``'s own error wins over the peer's loss; a cancellation from outside stays one.
    """
    wait_for_abort = getattr(control, "wait_for_abort", None)
    if not callable(wait_for_abort):
        return await run
    lost: list[BaseException] = []
    failure: BaseException | None = None
    result: list[T] = []

    async def watch(scope: anyio.CancelScope) -> None:
        lost.append(await wait_for_abort())
        scope.cancel()

    async with anyio.create_task_group() as watcher:
        # ``scope`` swallows the cancellation the watcher makes, and only that one.
        with anyio.CancelScope() as scope:
            watcher.start_soon(watch, scope)
            try:
                result.append(await run)
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:  # raised as it is, below: the task group would wrap it
                failure = exc
        watcher.cancel_scope.cancel()
    if failure is not None:
        raise failure
    if not result:
        raise lost[0]
    return result[0]


async def abort_run(control: object, error: BaseException) -> None:
    """Tell the peers at once that this rank's run failed with ``error``, where the channel can.

    Leaving the channel tells them anyway; a rank that stays in it after the failure (every
    rank a task of one process, inside the channel's ``async with``; a caller that catches the
    error) would otherwise hold them in a collective until ``collective_timeout``.  lamploop's
    channels have ``abort_run``; a channel of your own without it is told when it is left.
    """
    abort = getattr(control, "abort_run", None)
    if callable(abort):
        await abort(error)


@asynccontextmanager
async def telling_peers_on_failure(control: object) -> AsyncIterator[None]:
    """Around a driver's whole run: a failure (also a ``KeyboardInterrupt`` or ``SystemExit``
    inside it) is told to the peers at once (:func:`abort_run`), also one before the ranks met;
    a stop (:class:`TrainingInterrupted`) ends them with ``Stop`` instead.  A cancellation is
    not told here: it may be this rank's answer to a peer's loss (:func:`until_a_peer_aborts`),
    which the peers hear of from that peer; leaving the channel cancelled tells them too.  One
    that the rank's own step raised (no scope cancelled it: :func:`raised_by_work`) is told."""
    try:
        yield
    except TrainingInterrupted:
        raise
    except FAILURES as exc:
        await abort_run(control, exc)
        raise
    except BaseException as exc:
        if raised_by_work(exc):  # a cancellation exception the user's step raised: an error
            with anyio.CancelScope(shield=True):
                await abort_run(control, exc)
        raise


FAILURES: Final = (Exception, KeyboardInterrupt, SystemExit)
"""What a rank tells its peers of at once (:func:`abort_run`): its errors, not cancellations."""


def check_place(nranks: int, device: torch.device | str, where: str) -> torch.device:
    """Check ``nranks`` and ``device`` (one torch knows, CUDA only where there is CUDA); the device."""
    try:
        check_int("nranks", nranks, 1)
    except ConfigurationError as exc:
        msg = f"{where}: {exc}"
        raise ConfigurationError(msg) from None
    return checked_device(device, where)


def _shards_on_disk(
    init_state: LoopStateWithModelAndOptimizerData | None, settings: TrainingSettings, nranks: int
) -> pathlib.Path | None:
    """The sharded checkpoint ``init_state`` left its tensors in (every rank then loads its rows)."""
    if init_state is None or not isinstance(init_state.model, ShardsOnDisk):
        return None
    if settings.strategy != SHARDED or nranks == 1:
        msg = (
            f"drive_distributed_training: init_state's tensors were left in the sharded checkpoint "
            f"{init_state.model.directory} (load_checkpoint_leaving_shards), which only strategy "
            f"'fsdp' on several ranks reads; this run has strategy {settings.strategy!r} on "
            f"{nranks} rank(s): load it with load_checkpoint"
        )
        raise ConfigurationError(msg)
    return init_state.model.directory


def _on_the_event_loop(roots: list[RootEpochs]) -> SavePosition:
    """The root's step-boundary writer: on the event loop, also when called from the training thread."""
    loop_thread, loop_token = threading.get_ident(), anyio.lowlevel.current_token()

    async def save(position: EpochPosition, rngs: Sequence[RngStates]) -> None:
        if threading.get_ident() == loop_thread:  # one rank: the epoch runs on the event loop
            await roots[0].save_position(position, rngs)
        else:  # a worker thread: write on the event loop, and wait for it there
            anyio.from_thread.run(roots[0].save_position, position, rngs, token=loop_token)

    return save


async def drive_distributed_training(
    *,
    nranks: int,
    device: torch.device | str,
    control: ControlRoot | None,
    model: SupervisedModel,
    optimizer_factory: OptimizerFactory,
    train_batches: BatchStreamFactory,
    validation_batches: BatchStreamFactory | None,
    max_epochs: int,
    checkpoint_state: Callable[[LoopStateWithModelAndOptimizerData, S], Awaitable[None]] | None = None,
    validation_frequency: int = 1,
    return_min_validation_loss_model: Container[int] = (),
    learning_rate_schedule: LearningRateSchedule[S] = noop(),  # type: ignore[assignment]
    init_state: LoopStateWithModelAndOptimizerData | None = None,
    accumulate_gradient_over_n_batches: int = 1,
    learning_rate_schedule_init_state: S | None = None,
    validation_loss_exponential_smoothing_factor: float = 1.0,
    settings: TrainingSettings | None = None,
    host: str = "127.0.0.1",
    checkpoint_position: CheckpointPosition | None = None,
    init_position: EpochPosition | None = None,
    init_rank_rngs: Sequence[RngStates] = (),
    stop: StopRequest | None = None,
    reporters: Sequence[Reporter] = (),
    checkpoint_extras: Mapping[str, CheckpointExtra] | None = None,
    **keywords: Unpack[SettingKeywords],
) -> LoopState:
    """Drive training on the root rank (rank 0); with ``nranks == 1``, train alone.

    The epoch semantics are those of :func:`lamploop.epochs`; every epoch runs
    :func:`lamploop.one_epoch` on every rank, with gradients combined as the mean over all
    examples of all ranks.  When training ends the best model (if an eligible epoch
    validated) is copied into ``model.module``.

    Args:
        nranks: the number of ranks, this one included.
        device: where this rank trains (``"cpu"`` uses Gloo, ``"cuda:i"`` NCCL).
        control: the root's control channel, already entered; ``None`` only when ``nranks == 1``.
        model: the module and loss; moved to ``device``.
        optimizer_factory: makes the optimizer from the module's parameters.
        train_batches, validation_batches: stream factories, called with
            ``BatchContext(epoch, rank=0, nranks)``.
        checkpoint_state: awaited after every epoch with the loop state (at ``epoch + 1``),
            the model, optimizer and best-model tensors, and the schedule state the next
            epoch will use; e.g. a :class:`lamploop.checkpoint.Checkpointer`.
        init_state: resume from this (see :func:`lamploop.checkpoint.load_checkpoint`).
        settings: everything beyond lamp's keywords, as one :class:`TrainingSettings`:
            the gradient-sync ``strategy`` (``"auto"``: ``all_reduce`` when every follower
            passed ``optimizer_factory``, else lamp's ``reduce_to_root``), ``bucket_cap_mb``,
            ``collective_timeout``, ``on_non_finite_loss``, ``max_gradient_norm``,
            ``precision``, ``step_schedule``, ``lr_scheduler``, averaging, model selection,
            early stopping and the checkpoint cadence (``checkpoint_every_*``); the settings
            every rank holds (:attr:`TrainingSettings.EVERY_RANK`) must equal the
            followers'.  A lamp keyword left at its default takes the settings' value.
            ``strategy="fsdp"`` shards the model over the ranks (every rank writes its shards
            of each checkpoint through ``checkpoint_position``; see docs/strategies.md and
            :mod:`lamploop.distributed.sharded_rank`).
        keywords: the same settings one keyword each (``strategy="all_reduce"``...), as
            before ``settings=`` (:class:`~lamploop.settings.SettingKeywords`); not together
            with ``settings=``.
        host: the address the tensor channel's store listens on.
        checkpoint_position: writes a checkpoint at a step boundary (e.g.
            :meth:`lamploop.checkpoint.Checkpointer.save_position`), with every rank's RNG
            states: after every epoch (position: step 0 of the next epoch), when ``stop`` is
            requested, and every ``settings.checkpoint_every_n_steps`` steps or
            ``settings.checkpoint_every_seconds`` seconds.
        init_position, init_rank_rngs: resume at this step boundary of ``init_state``'s
            epoch, with these RNG states of every rank (from a step-boundary checkpoint).
        stop: set it (e.g. from a signal handler) to stop at the next step boundary: a
            checkpoint is written there, the followers are stopped, and
            :class:`~lamploop.errors.TrainingInterrupted` is raised.
        reporters: hear the run's events (:mod:`lamploop.reporting.events`): run started,
            peers joined, each epoch's start, progress samples, validation and end, and the
            run's end.  How a run fails or stops is raised to the caller (:func:`lamploop.fit`
            reports it); reporters are not closed here.
        checkpoint_extras: state beside the model on every rank (a stream's buffer...,
            see :mod:`lamploop.checkpoint.extras`), when ``nranks > 1``: the ranks check when
            they meet that they all carry extras of the same names, and after every training
            pass each follower's are sent here.  Pass a
            :class:`~lamploop.distributed.rank_extras.RankExtras` and hand the same object
            to the checkpoint writer to save every rank's (``fit`` does).  Every follower
            passes its own.

    The other arguments are those of :func:`lamploop.epochs`.

    Returns:
        The final :class:`LoopState`.

    Raises:
        ConfigurationError: bad arguments; an unknown keyword, or a setting given both as a
            keyword and in ``settings=``.
        DistributedError: the tensor channel failed or the ranks disagree.
        ControlChannelError: the control channel failed; :class:`PeerLostError` names a lost rank.
        TrainingInterrupted: ``stop`` was requested; the checkpoint of the boundary is written.
    """
    async with telling_peers_on_failure(control):
        settings = merged_settings(drive_distributed_training, locals(), SettingKeywords)
        torch_device = check_place(nranks, device, "drive_distributed_training")
        check_host("drive_distributed_training: host", host)
        check_driver_arguments(
            "drive_distributed_training",
            model,
            train_batches,
            validation_batches,
            init_state=init_state,
            checkpoint_state=checkpoint_state,
        )
        check_reporters("drive_distributed_training", reporters)
        check_sharded_strategy("drive_distributed_training", settings, control=control)
        check_averaging_starts("drive_distributed_training", settings.averaging, settings.max_epochs)
        if settings.strategy == SHARDED and isinstance(checkpoint_state, Checkpointer):
            msg = (
                "drive_distributed_training: strategy 'fsdp' writes checkpoints with every rank's "
                "shards, through checkpoint_position: pass checkpoint_position=checkpointer.save_position "
                "instead of checkpoint_state=checkpointer"
            )
            raise ConfigurationError(msg)
        check_resume_point(checkpoint_position, init_position, init_rank_rngs, stop)
        check_root_arguments(nranks, control, init_position)
        emit = EventEmitter(reporters)
        start_epoch = init_state.loop_state.epoch if init_state is not None else 0
        summary = summarize(model.module) if emit else None  # once per run, when anyone listens
        emit(RunStarted(nranks, start_epoch, settings.max_epochs, model_summary=summary))
        module = model.module
        # Can take seconds (a first optimizer imports torch._dynamo): keep the event loop, which
        # answers the followers' handshakes, free meanwhile.
        shards_from = _shards_on_disk(init_state, settings, nranks)
        optimizer, base_lrs = await anyio.to_thread.run_sync(
            set_up_root, module, torch_device, optimizer_factory, init_state if shards_from is None else None
        )

        async def connect() -> tuple[Any, str]:
            await resolve_host(host, "drive_distributed_training")
            store, port = create_store(host, nranks, settings.collective_timeout)
            if control is not None:
                await control.on_rendezvous_ready(Rendezvous(host=host, port=port))
                for rank in range(1, nranks):
                    emit(PeerJoined(rank, nranks))
            return store, host

        roots: list[RootEpochs] = []  # the root's effects, once its replica exists

        plan = RankPlan(
            rank=0,
            nranks=nranks,
            device=torch_device,
            model=model,
            optimizer=optimizer,
            base_lrs=base_lrs,
            train_batches=train_batches,
            validation_batches=validation_batches,
            settings=settings,
            stop=stop,
            save=_on_the_event_loop(roots) if checkpoint_position is not None else None,
            resume=(init_position, init_rank_rngs) if init_position is not None or init_rank_rngs else None,
            saved=saved_beside_optimizer(init_state.optimizer) if init_state is not None else {},
            extras=rank_extras(checkpoint_extras, 0, nranks),
            best=init_state.best_model if init_state is not None else {},
            shards_from=shards_from,
        )
        schedule_state = (
            learning_rate_schedule_init_state
            if learning_rate_schedule_init_state is not None
            else settings.learning_rate_schedule.init()
        )

        async def run() -> tuple[RootEpochs, LoopState]:
            async with open_replica(plan, connect, AbortSignal()) as replica:
                root = RootEpochs(
                    replica, control, checkpoint_state, checkpoint_position, init_state, schedule_state, emit
                )
                roots.append(root)
                try:
                    state = await named_peer_failures(
                        root.epochs(settings, validation_batches is not None), control, nranks
                    )
                except TrainingInterrupted as stopped:
                    await root.tell(Stop(reason=str(stopped)))
                    raise
                except FAILURES as exc:
                    await abort_run(control, exc)  # before the replica's teardown
                    raise
                await root.tell(Stop(reason=finished_line(RunFinished(state, reason=root.end_reason))))
            return root, state

        # On failure no Stop is sent: the followers are aborted with the root's reason (at once,
        # where the channel can, else when the caller leaves it) instead of ended as if all went
        # well.  A follower that leaves first, also while the ranks set up, ends the run here.
        root, state = await until_a_peer_aborts(run(), control)
        await install_result(root.replica, root.best, train_batches, state.epoch)
        emit(RunFinished(state, reason=root.end_reason))
        return state
