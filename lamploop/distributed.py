"""Training on several ranks: the root drives, the followers follow.

Launch (one process per rank; see docs/distributed.md)::

    # rank 0                                   # ranks 1..n-1
    async with TcpControlRoot(...) as control:  async with TcpControlFollower(...) as control:
        await drive_distributed_training(         await follow_distributed_training(
            nranks=n, control=control, ...)           rank=r, nranks=n, control=control, ...)

What happens, in order:

1. the root opens a ``torch.distributed`` store on a free port and hands its
   address to the followers through the control channel (no MASTER_ADDR);
2. every rank joins a process group over it (Gloo for CPU, NCCL for CUDA);
3. the ranks check they agree on the strategy and the model, and the root's
   parameters (and, when every rank steps, its optimizer state) are broadcast,
   so followers start from the root's state, also when resuming;
4. the root runs :func:`lamploop.epochs`; before each epoch it broadcasts
   ``Train``/``Valid`` and every rank runs the same :class:`Replica` epoch;
5. the root broadcasts ``Stop`` and copies the best model into its module.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import torch

from lamploop.batches import BatchStreamFactory
from lamploop.control.commands import ControlFollower, ControlRoot, Stop, Train, Valid
from lamploop.control.local import local_control
from lamploop.errors import ConfigurationError, DistributedError
from lamploop.loop import epochs
from lamploop.model import SupervisedModel
from lamploop.modelspec import model_spec
from lamploop.optimizer_state import decode_tree, encode_tree
from lamploop.process_group import (
    DEFAULT_BUCKET_CAP_MB,
    ProcessGroupChannel,
    Strategy,
    check_strategy,
    connect_store,
    create_store,
    new_process_group,
)
from lamploop.replica import Replica, learning_rates
from lamploop.schedules import LearningRateSchedule, noop
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData
from lamploop.tensors import SingleProcessChannel, TensorChannel

__all__ = [
    "OptimizerFactory",
    "drive_distributed_training",
    "follow_distributed_training",
    "local_data_parallel_training_loop",
]

S = TypeVar("S")
T = TypeVar("T")
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
EpochRunner = Callable[[Callable[[], Awaitable[float]]], Awaitable[float]]
"""Runs one epoch coroutine: directly, or on a thread of its own (local data parallel)."""

_STORE_PREFIX = "lamploop"


_LOST_PEER_GRACE_S = 3.0
"""A dead rank breaks a collective at once; its control connection tells which rank it was
a moment later."""


async def _named_peer_failures(run: Awaitable[T], control: object, nranks: int) -> T:
    """Await ``run``; if a collective fails, give the control channel time to name the lost rank.

    The control channel cancels this task and raises :class:`PeerLostError` naming the rank
    if it notices one; otherwise the collective's :class:`DistributedError` stands.
    """
    try:
        return await run
    except DistributedError:
        if control is not None and nranks > 1:
            await anyio.sleep(_LOST_PEER_GRACE_S)
        raise


async def _run_here(epoch: Callable[[], Awaitable[float]]) -> float:
    return await epoch()


async def _run_on_own_thread(epoch: Callable[[], Awaitable[float]]) -> float:
    return await anyio.to_thread.run_sync(anyio.run, epoch)


def _check_common(nranks: int, k: int, device: torch.device | str) -> torch.device:
    if not isinstance(nranks, int) or nranks < 1:
        msg = f"nranks must be an int >= 1, got {nranks!r}"
        raise ConfigurationError(msg)
    if not isinstance(k, int) or k < 1:
        msg = f"accumulate_gradient_over_n_batches must be an int >= 1, got {k!r}"
        raise ConfigurationError(msg)
    return torch.device(device)


def _initial_sync(
    channel: ProcessGroupChannel, module: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """Blocking collectives run once at start, identical on every rank (see module doc, step 3)."""
    channel.check_agreement("the sync strategy", channel.strategy)
    channel.check_agreement(
        "the model's parameter names, shapes and dtypes", model_spec(module).fingerprint()
    )
    channel.broadcast_tensors(list(module.state_dict().values()))
    if channel.strategy != "all_reduce" or optimizer is None:
        return
    tensors: dict[str, torch.Tensor] = {}
    skeleton = (
        encode_tree(optimizer.state_dict(), tensors, error=DistributedError) if channel.rank == 0 else None
    )
    specs = [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in tensors.items()]
    skeleton, specs = channel.broadcast_json([skeleton, specs])
    if channel.rank != 0:
        tensors = {name: torch.empty(shape, dtype=getattr(torch, dtype)) for name, shape, dtype in specs}
    channel.broadcast_tensors(list(tensors.values()))
    if channel.rank != 0:
        state = decode_tree(skeleton, tensors, "the root's optimizer state", error=DistributedError)
        optimizer.load_state_dict(state)


@asynccontextmanager
async def _open_replica(
    *,
    rank: int,
    nranks: int,
    device: torch.device,
    model: SupervisedModel,
    optimizer: torch.optim.Optimizer | None,
    base_lrs: tuple[float, ...],
    train_batches: BatchStreamFactory,
    validation_batches: BatchStreamFactory | None,
    accumulate_gradient_over_n_batches: int,
    strategy: Strategy,
    bucket_cap_mb: float,
    collective_timeout: float,
    connect: Callable[[], Awaitable[Any]],
) -> AsyncIterator[Replica]:
    """This rank's :class:`Replica` on its tensor channel, set up and torn down.

    ``connect`` gives the store the process group is built over (unused with one rank).
    """

    def replica(channel: TensorChannel) -> Replica:
        return Replica(
            model=model,
            channel=channel,
            train_batches=train_batches,
            validation_batches=validation_batches,
            accumulate_gradient_over_n_batches=accumulate_gradient_over_n_batches,
            device=device,
            optimizer=optimizer,
            base_lrs=base_lrs,
        )

    module = model.module
    if nranks == 1:
        yield replica(SingleProcessChannel())
        return
    store = await connect()

    def join() -> ProcessGroupChannel:
        group = new_process_group(
            store, rank=rank, nranks=nranks, device=device, timeout=collective_timeout, prefix=_STORE_PREFIX
        )
        channel = ProcessGroupChannel(
            group, rank=rank, nranks=nranks, device=device, strategy=strategy, bucket_cap_mb=bucket_cap_mb
        )
        channel.attach(module)
        _initial_sync(channel, module, optimizer)
        return channel

    # Joining blocks until every rank arrives: keep the event loop (heartbeats) free meanwhile.
    channel = await anyio.to_thread.run_sync(join)
    try:
        yield replica(channel)
    finally:
        channel.close()


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
    strategy: Strategy = "reduce_to_root",
    host: str = "127.0.0.1",
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    collective_timeout: float = 300.0,
    _run_epoch: EpochRunner = _run_here,
) -> LoopState:
    """Drive training on the root rank (rank 0); with ``nranks == 1``, train alone.

    The epoch semantics are those of :func:`lamploop.epochs`; every epoch runs
    :func:`lamploop.one_epoch` on every rank, with gradients combined as the mean
    over all examples of all ranks.  When training ends the best model (if an
    eligible epoch validated) is copied into ``model.module``.

    Args:
        nranks: the number of ranks, this one included.
        device: where this rank trains (``"cpu"`` uses Gloo, ``"cuda:i"`` NCCL).
        control: the root's control channel, already entered; ``None`` only
            when ``nranks == 1``.
        model: the module and loss; moved to ``device``.
        optimizer_factory: makes the optimizer from the module's parameters.
        train_batches, validation_batches: stream factories, called with
            ``BatchContext(epoch, rank=0, nranks)``.
        checkpoint_state: awaited after every epoch with the loop state (at
            ``epoch + 1``), the model, optimizer and best-model tensors, and the
            schedule state the next epoch will use; e.g. a
            :class:`lamploop.checkpoint.Checkpointer`.
        init_state: resume from this (see :func:`lamploop.checkpoint.load_checkpoint`).
        strategy: ``"reduce_to_root"`` (lamp's: gradients are reduced to the
            root, which steps and broadcasts the parameters; optimizer state on
            the root only) or ``"all_reduce"`` (every rank steps a replicated
            optimizer; followers then need ``optimizer_factory`` too).
        host: the address the tensor channel's store listens on.
        bucket_cap_mb: gradient bucket size.
        collective_timeout: seconds before a stuck collective fails.

    The other arguments are those of :func:`lamploop.epochs`.

    Returns:
        The final :class:`LoopState`.

    Raises:
        ConfigurationError: bad arguments.
        DistributedError: the tensor channel failed or the ranks disagree.
        ControlChannelError: the control channel failed (e.g. a follower was lost).
    """
    device = _check_common(nranks, accumulate_gradient_over_n_batches, device)
    strategy = check_strategy(strategy)
    if nranks > 1 and control is None:
        msg = f"drive_distributed_training: nranks={nranks} needs a control channel, got control=None"
        raise ConfigurationError(msg)
    module = model.module

    def set_up() -> tuple[torch.optim.Optimizer, tuple[float, ...]]:
        module.to(device)
        if init_state is not None:
            module.load_state_dict(init_state.model)
        optimizer = optimizer_factory(module.parameters())
        base_lrs = learning_rates(optimizer)  # before a loaded state sets the last epoch's rates
        if init_state is not None and init_state.optimizer:
            optimizer.load_state_dict(dict(init_state.optimizer))
        return optimizer, base_lrs

    # Can take seconds (a first optimizer imports torch._dynamo): keep the event loop,
    # which answers the followers' handshakes, free meanwhile.
    optimizer, base_lrs = await anyio.to_thread.run_sync(set_up)
    best: dict[str, torch.Tensor] = dict(init_state.best_model) if init_state is not None else {}

    async def connect() -> Any:
        store, rendezvous = create_store(host, nranks, collective_timeout)
        if control is not None:
            await control.on_rendezvous_ready(rendezvous)
        return store

    async with _open_replica(
        rank=0,
        nranks=nranks,
        device=device,
        model=model,
        optimizer=optimizer,
        base_lrs=base_lrs,
        train_batches=train_batches,
        validation_batches=validation_batches,
        accumulate_gradient_over_n_batches=accumulate_gradient_over_n_batches,
        strategy=strategy,
        bucket_cap_mb=bucket_cap_mb,
        collective_timeout=collective_timeout,
        connect=connect,
    ) as replica:
        next_epoch = init_state.loop_state.epoch if init_state is not None else 0

        async def tell(command: Train | Valid | Stop) -> None:
            if control is not None and nranks > 1:
                await control.broadcast(command)

        async def train_epoch(lr_factor: float) -> float:
            await tell(Train(epoch=next_epoch, lr_factor=lr_factor))
            return await _run_epoch(functools.partial(replica.train, next_epoch, lr_factor))

        async def validation_epoch() -> float:
            await tell(Valid(epoch=next_epoch))
            return await _run_epoch(functools.partial(replica.validate, next_epoch))

        async def save_best() -> None:
            best.clear()
            best.update({k: v.detach().clone() for k, v in module.state_dict().items()})

        async def after_epoch(state: LoopState, schedule_state: S) -> None:
            nonlocal next_epoch
            next_epoch = state.epoch
            if checkpoint_state is not None:
                data = LoopStateWithModelAndOptimizerData(
                    loop_state=state,
                    model=module.state_dict(),
                    optimizer=optimizer.state_dict(),
                    best_model=best,
                )
                await checkpoint_state(data, schedule_state)

        # On failure no Stop is sent: leaving the control channel without it aborts
        # the followers with the root's reason instead of ending them as if all went well.
        run = epochs(
            max_epochs=max_epochs,
            train_epoch=train_epoch,
            validation_epoch=validation_epoch if validation_batches is not None else None,
            save_min_validation_loss_model=save_best,
            checkpoint_state=after_epoch,
            validation_frequency=validation_frequency,
            return_min_validation_loss_model=return_min_validation_loss_model,
            learning_rate_schedule=learning_rate_schedule,
            init_state=init_state.loop_state if init_state is not None else None,
            learning_rate_schedule_init_state=learning_rate_schedule_init_state,
            validation_loss_exponential_smoothing_factor=validation_loss_exponential_smoothing_factor,
        )
        state = await _named_peer_failures(run, control, nranks)
        await tell(Stop(reason=f"finished after epoch {state.epoch - 1}"))
    if best:
        module.load_state_dict(best)
    return state


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
    strategy: Strategy = "reduce_to_root",
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    collective_timeout: float = 300.0,
    _run_epoch: EpochRunner = _run_here,
) -> None:
    """Follow the root's commands on rank ``rank`` until it sends ``Stop``.

    Args:
        rank: this rank, ``1 .. nranks - 1``.
        nranks: the number of ranks.
        device: where this rank trains.
        control: this follower's control channel, already entered.
        model: this rank's copy of the model (same parameter names, shapes and
            dtypes as the root's); its values are replaced by the root's at start.
        train_batches, validation_batches: stream factories, called with
            ``BatchContext(epoch, rank, nranks)``.
        optimizer_factory: required with ``strategy="all_reduce"`` (every rank
            steps); unused with ``"reduce_to_root"``.
        strategy: must equal the root's.

    Raises:
        ConfigurationError: bad arguments.
        DistributedError: the tensor channel failed or the ranks disagree.
        ControlChannelError: the control channel failed (refused, root lost...).
    """
    device = _check_common(nranks, accumulate_gradient_over_n_batches, device)
    strategy = check_strategy(strategy)
    if not isinstance(rank, int) or not 1 <= rank < nranks:
        msg = f"follow_distributed_training: rank must be in 1..{nranks - 1}, got {rank!r}"
        raise ConfigurationError(msg)
    if strategy == "all_reduce" and optimizer_factory is None:
        msg = (
            "follow_distributed_training: strategy 'all_reduce' steps on every rank "
            "and needs optimizer_factory"
        )
        raise ConfigurationError(msg)
    module = model.module

    def set_up() -> torch.optim.Optimizer | None:
        module.to(device)
        return (
            optimizer_factory(module.parameters()) if strategy == "all_reduce" and optimizer_factory else None
        )

    optimizer = await anyio.to_thread.run_sync(set_up)
    base_lrs = learning_rates(optimizer)  # before the root's optimizer state arrives
    rendezvous, commands = await control.join()

    async def connect() -> Any:
        return await anyio.to_thread.run_sync(connect_store, rendezvous, nranks, collective_timeout)

    async with _open_replica(
        rank=rank,
        nranks=nranks,
        device=device,
        model=model,
        optimizer=optimizer,
        base_lrs=base_lrs,
        train_batches=train_batches,
        validation_batches=validation_batches,
        accumulate_gradient_over_n_batches=accumulate_gradient_over_n_batches,
        strategy=strategy,
        bucket_cap_mb=bucket_cap_mb,
        collective_timeout=collective_timeout,
        connect=connect,
    ) as replica:

        async def obey() -> None:
            async for command in commands:
                if isinstance(command, Train):
                    await _run_epoch(functools.partial(replica.train, command.epoch, command.lr_factor))
                elif isinstance(command, Valid):
                    if validation_batches is None:
                        msg = (
                            f"rank {rank}: the root validates in epoch {command.epoch}, "
                            "but this rank has no validation_batches"
                        )
                        raise ConfigurationError(msg)
                    await _run_epoch(functools.partial(replica.validate, command.epoch))
                else:
                    return

        await _named_peer_failures(obey(), control, nranks)


async def local_data_parallel_training_loop(
    models_with_data_streams: Sequence[tuple[SupervisedModel, BatchStreamFactory, BatchStreamFactory | None]],
    optimizer_factory: OptimizerFactory,
    max_epochs: int,
    checkpoint_state: Callable[[LoopStateWithModelAndOptimizerData, S], Awaitable[None]] | None = None,
    validation_frequency: int = 1,
    return_min_validation_loss_model: Container[int] = (),
    learning_rate_schedule: LearningRateSchedule[S] = noop(),  # type: ignore[assignment]
    init_state: LoopStateWithModelAndOptimizerData | None = None,
    accumulate_gradient_over_n_batches: int = 1,
    learning_rate_schedule_init_state: S | None = None,
    validation_loss_exponential_smoothing_factor: float = 1.0,
    *,
    strategy: Strategy = "reduce_to_root",
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    collective_timeout: float = 300.0,
) -> LoopState:
    """Data-parallel training in one process: one replica per device, one thread each.

    Each element of ``models_with_data_streams`` is ``(model, train_batches,
    validation_batches)`` for one replica; a replica trains on the device its
    parameters are on.  The replicas talk over an in-process control channel
    and a process group per replica over one shared store, the same code path
    as separate processes.  The trained (best) model ends in the *first* model.

    Raises:
        ConfigurationError: no replicas, or replicas on one CUDA device.
    """
    if not models_with_data_streams:
        msg = "local_data_parallel_training_loop: models_with_data_streams is empty"
        raise ConfigurationError(msg)
    nranks = len(models_with_data_streams)
    devices = [_device_of(m.module) for m, _, _ in models_with_data_streams]
    cuda = [d for d in devices if d.type == "cuda"]
    if len(set(cuda)) != len(cuda):
        msg = f"local_data_parallel_training_loop: NCCL needs one CUDA device per replica, got {devices}"
        raise ConfigurationError(msg)
    root, followers = local_control(nranks)
    (root_model, root_train, root_valid), *others = models_with_data_streams
    async with root, anyio.create_task_group() as tasks:
        for rank, (follower, (model, train, valid)) in enumerate(
            zip(followers, others, strict=True), start=1
        ):
            tasks.start_soon(
                functools.partial(
                    _follow_entered,
                    follower,
                    rank=rank,
                    nranks=nranks,
                    device=devices[rank],
                    model=model,
                    train_batches=train,
                    validation_batches=valid,
                    accumulate_gradient_over_n_batches=accumulate_gradient_over_n_batches,
                    optimizer_factory=optimizer_factory,
                    strategy=strategy,
                    bucket_cap_mb=bucket_cap_mb,
                    collective_timeout=collective_timeout,
                    _run_epoch=_run_on_own_thread,
                )
            )
        state = await drive_distributed_training(
            nranks=nranks,
            device=devices[0],
            control=root,
            model=root_model,
            optimizer_factory=optimizer_factory,
            train_batches=root_train,
            validation_batches=root_valid,
            max_epochs=max_epochs,
            checkpoint_state=checkpoint_state,
            validation_frequency=validation_frequency,
            return_min_validation_loss_model=return_min_validation_loss_model,
            learning_rate_schedule=learning_rate_schedule,
            init_state=init_state,
            accumulate_gradient_over_n_batches=accumulate_gradient_over_n_batches,
            learning_rate_schedule_init_state=learning_rate_schedule_init_state,
            validation_loss_exponential_smoothing_factor=validation_loss_exponential_smoothing_factor,
            strategy=strategy,
            bucket_cap_mb=bucket_cap_mb,
            collective_timeout=collective_timeout,
            _run_epoch=_run_on_own_thread,
        )
    return state


async def _follow_entered(follower: ControlFollower, **kwargs: Any) -> None:
    async with follower:  # type: ignore[attr-defined]
        await follow_distributed_training(control=follower, **kwargs)


def _device_of(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")
