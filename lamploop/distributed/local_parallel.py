"""``local_data_parallel_training_loop``: one process, one replica per device, one thread each.

The replicas are ranks of an in-process control channel
(:func:`lamploop.control.local_control`) and of a process group per replica over one
shared store: the code path of separate processes.  Each rank is a task of one task group;
the first error of any rank ends every rank (their collective waits are aborted) and is
the one raised.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Container, Sequence
from typing import Any, TypeVar

import anyio
import torch

from lamploop.batches import BatchStreamFactory
from lamploop.control.commands import ControlFollower
from lamploop.control.local import local_control
from lamploop.distributed.drive import OptimizerFactory, drive_distributed_training
from lamploop.distributed.follow import follow_distributed_training
from lamploop.distributed.initial_sync import frozen_parameters
from lamploop.distributed.inputs import check_driver_arguments, check_resume_arguments
from lamploop.distributed.sharded_checks import check_sharded_strategy
from lamploop.errors import (
    ConfigurationError,
    DistributedError,
    PeerLostError,
    error_detected_by_every_rank,
)
from lamploop.model import SupervisedModel
from lamploop.modelspec import describe_mismatch, model_spec
from lamploop.schedules import LearningRateSchedule, noop
from lamploop.settings import LocalSettingKeywords, TrainingSettings, Unpack, merged_settings
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData

__all__ = ["local_data_parallel_training_loop"]

S = TypeVar("S")


class _FirstError:
    """Remembers the first exception of any rank, to raise it instead of the group of all.

    An error that every rank detects itself (see :mod:`lamploop.errors`) wins over an earlier
    one of another kind, which can only be a consequence of it; so does a rank's own error over
    an earlier :class:`PeerLostError` (a peer told of that failure may end first).
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None

    async def watch(self, run: Awaitable[Any]) -> Any:
        try:
            return await run
        except Exception as exc:
            if self.error is None or _outranks(exc, self.error):
                self.error = exc
            raise


def _outranks(later: BaseException, earlier: BaseException) -> bool:
    """Whether ``later`` says more about the run's failure than ``earlier``, a consequence of it."""
    if error_detected_by_every_rank(earlier) is not None:
        return False
    if error_detected_by_every_rank(later) is not None:
        return True
    return isinstance(earlier, PeerLostError) and not isinstance(later, PeerLostError)


def _replica_devices(models: Sequence[SupervisedModel]) -> list[torch.device]:
    """The device each replica trains on: its parameters' one CPU or CUDA device.

    Raises:
        ConfigurationError: a replica's parameters are on several devices, or on one the tensor
            channel cannot carry (``meta``, ``mps``); replicas on CPU and CUDA at once (Gloo
            and NCCL cannot make one group); two replicas on one CUDA device.
    """
    where = "local_data_parallel_training_loop"
    devices = []
    for index, model in enumerate(models):
        found = sorted({str(p.device) for p in model.module.parameters()})
        if len(found) > 1:
            msg = f"{where}: replica {index}'s parameters are on several devices ({', '.join(found)})"
            msg += "; a replica trains on one"
            raise ConfigurationError(msg)
        device = torch.device(found[0] if found else "cpu")
        if device.type not in ("cpu", "cuda"):
            msg = (
                f"{where}: replica {index}'s parameters are on device {str(device)!r}; a replica "
                "trains on cpu or cuda (its gradients cross Gloo or NCCL)"
            )
            raise ConfigurationError(msg)
        devices.append(device)
    kinds = sorted({d.type for d in devices})
    if len(kinds) > 1:
        msg = f"{where}: the replicas are on cpu and cuda at once ({', '.join(map(str, devices))})"
        msg += ": Gloo and NCCL make no group together, put them all on one kind"
        raise ConfigurationError(msg)
    cuda = [d for d in devices if d.type == "cuda"]
    if len(set(cuda)) != len(cuda):
        msg = f"{where}: NCCL needs one CUDA device per replica, got {devices}"
        raise ConfigurationError(msg)
    return devices


async def _follow(follower: ControlFollower, **kwargs: Any) -> None:
    async with follower:  # type: ignore[attr-defined]
        await follow_distributed_training(control=follower, **kwargs)


def _check_replicas(replicas: object, init_state: object, checkpoint_state: object) -> None:
    """Each replica a ``(model, train_batches, validation_batches)`` triple of its own module."""
    where = "local_data_parallel_training_loop"
    if not isinstance(replicas, Sequence) or isinstance(replicas, str | bytes):
        msg = f"{where}: models_with_data_streams must be a list of triples, got {type(replicas).__name__}"
        raise ConfigurationError(msg)
    check_resume_arguments(where, init_state, checkpoint_state)
    modules: dict[int, int] = {}
    for i, replica in enumerate(replicas):
        if not isinstance(replica, tuple | list) or len(replica) != 3:
            got = f"a {len(replica)}-tuple" if isinstance(replica, tuple | list) else type(replica).__name__
            msg = (
                f"{where}: models_with_data_streams[{i}] must be a (model, train_batches, "
                f"validation_batches) triple (validation_batches may be None), got {got}"
            )
            raise ConfigurationError(msg)
        model, train, valid = replica
        check_driver_arguments(f"{where}: models_with_data_streams[{i}]", model, train, valid)
        first = modules.setdefault(id(model.module), i)
        if first != i:
            # Two threads would run forward and backward on the same parameters at once.
            msg = (
                f"{where}: models_with_data_streams[{first}] and [{i}] share one module; give each "
                "replica its own copy (copy.deepcopy(module))"
            )
            raise ConfigurationError(msg)
    _check_same_models([replica[0].module for replica in replicas])


def _check_same_models(modules: Sequence[torch.nn.Module]) -> None:
    """Every replica's model has the first one's tensors (names, shapes, dtypes), or a
    DistributedError naming the replica and the first tensor that differs, before any thread
    starts (the ranks' own check, one fingerprint each, cannot say which tensor)."""
    expected = model_spec(modules[0])
    for rank, module in enumerate(modules[1:], start=1):
        actual = model_spec(module)
        detail = describe_mismatch(expected, actual, expected_label="rank 0", actual_label=f"rank {rank}")
        if detail is None:
            detail = _frozen_difference(modules[0], module, rank)
        if detail is not None:
            msg = f"local_data_parallel_training_loop: rank {rank}'s model differs from rank 0's: {detail}"
            raise DistributedError(msg)


def _frozen_difference(first: torch.nn.Module, other: torch.nn.Module, rank: int) -> str | None:
    """Where ``other`` (rank ``rank``) trains a parameter that ``first`` freezes, or the reverse."""
    frozen_first, frozen_other = set(frozen_parameters(first)), set(frozen_parameters(other))
    for name, _ in first.named_parameters():
        if (name in frozen_first) != (name in frozen_other):
            where = f"rank {rank}" if name in frozen_other else "rank 0"
            return f"parameter {name!r} is frozen (requires_grad=False) on {where} alone"
    return None


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
    host: str = "127.0.0.1",
    settings: TrainingSettings | None = None,
    **keywords: Unpack[LocalSettingKeywords],
) -> LoopState:
    """Data-parallel training in one process: one replica per device, one thread each.

    Each element of ``models_with_data_streams`` is ``(model, train_batches,
    validation_batches)`` for one replica; a replica trains on the device its parameters are
    on.  The trained (best) model ends in the *first* model.  The other arguments are those
    of :func:`drive_distributed_training`: ``host`` (where the tensor channel's store listens),
    ``settings=`` (a :class:`TrainingSettings`) or the older keywords one setting each
    (:class:`~lamploop.settings.LocalSettingKeywords`), not both.

    Raises:
        ConfigurationError: no replicas, or replicas on one CUDA device, on CPU and CUDA at
            once, or a replica on another device (``meta``) or several; a replica that is
            not a ``(model, train_batches, validation_batches)`` triple of a SupervisedModel and
            batch factories, or two replicas sharing one module; an unknown keyword,
            or a setting given both as a keyword and in ``settings=``; a ``profile`` (torch
            profiles one process, and the replicas are its threads: use ``fit(world_size=n)``).
        DistributedError: the replicas' models differ (names the rank and the tensor).
        LamploopError: the first error of any replica (the others are ended within seconds);
            an exception your own code raised on a replica (its ``optimizer_factory``, its
            batches, its loss) is raised as it is, not wrapped.
    """
    merged = merged_settings(local_data_parallel_training_loop, locals(), LocalSettingKeywords)
    if merged.profile is not None:
        msg = (
            "local_data_parallel_training_loop: profile= needs a process per rank (fit(world_size=n) "
            "or the drivers): torch runs one profiler per process, and these replicas are threads of "
            "one (a second rank's trace is lost, and a window cut short by the end crashed torch's export)"
        )
        raise ConfigurationError(msg)
    if not models_with_data_streams:
        msg = "local_data_parallel_training_loop: models_with_data_streams is empty"
        raise ConfigurationError(msg)
    _check_replicas(models_with_data_streams, init_state, checkpoint_state)
    nranks = len(models_with_data_streams)
    devices = _replica_devices([model for model, _, _ in models_with_data_streams])
    check_sharded_strategy("local_data_parallel_training_loop", merged, in_process=True)
    root, followers = local_control(nranks)
    first = _FirstError()
    (root_model, root_train, root_valid), *others = models_with_data_streams
    state: LoopState | None = None
    try:
        async with root, anyio.create_task_group() as tasks:
            for rank, (follower, (model, train, valid)) in enumerate(zip(followers, others, strict=True), 1):
                run = _follow(
                    follower,
                    rank=rank,
                    nranks=nranks,
                    device=devices[rank],
                    model=model,
                    train_batches=train,
                    validation_batches=valid,
                    optimizer_factory=optimizer_factory,
                    settings=merged,
                )
                tasks.start_soon(first.watch, run)
            state = await first.watch(
                drive_distributed_training(
                    nranks=nranks,
                    device=devices[0],
                    control=root,
                    model=root_model,
                    optimizer_factory=optimizer_factory,
                    train_batches=root_train,
                    validation_batches=root_valid,
                    max_epochs=merged.max_epochs,
                    checkpoint_state=checkpoint_state,
                    init_state=init_state,
                    learning_rate_schedule_init_state=learning_rate_schedule_init_state,
                    host=host,
                    settings=merged,
                )
            )
    except BaseException as exc:
        error = first.error
        # A rank's own error, also when its task was cancelled unwinding it (a peer told of it
        # ended first): the first follower's, then the root's.
        for own in (root.first_follower_failure, root.root_failure):
            if own is not None and (error is None or _outranks(own, error)):
                error = own
        if error is None or exc is error:
            raise
        raise error from exc  # the group of every rank's error (and cancellations)
    if state is None:  # unreachable: without an error the root's task returned a state
        msg = "local_data_parallel_training_loop: the root ended without a state"
        raise RuntimeError(msg)
    return state
