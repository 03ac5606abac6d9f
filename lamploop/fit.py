"""``fit``: the common case in one call.

It wires :func:`drive_distributed_training` (which runs :func:`lamploop.epochs`
and :func:`lamploop.one_epoch`), checkpoints with ``keep_last``, and resuming
from the latest checkpoint, so that a restarted job carries on by itself.

>>> import torch, lamploop
>>> x, y = torch.randn(64, 3), torch.randint(0, 2, (64,))
>>> module = torch.nn.Linear(3, 2)
>>> state = lamploop.fit(
...     model=lamploop.SupervisedModel(module),
...     optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
...     train_batches=lamploop.tensor_batches(x, y, batch_size=16),
...     max_epochs=2,
... )
>>> state.epoch
2
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Container, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from lamploop.batches import BatchStreamFactory
from lamploop.checkpoint import Checkpointer, latest_checkpoint, load_checkpoint
from lamploop.control.tcp import TcpControlRoot
from lamploop.distributed import OptimizerFactory, drive_distributed_training, follow_distributed_training
from lamploop.errors import ConfigurationError
from lamploop.launch import launch_env, open_follower_control, open_root_control, spawn_followers
from lamploop.loop import ALL_EPOCHS
from lamploop.model import SupervisedModel
from lamploop.modelspec import model_spec
from lamploop.process_group import Strategy
from lamploop.schedules import LearningRateSchedule, noop
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData

__all__ = ["fit", "fit_async"]

logger = logging.getLogger("lamploop")

_LOCAL = "127.0.0.1"
_FOLLOWER_EXIT_TIMEOUT_S = 60.0


def _describe(state: LoopState) -> str:
    entry = state.learning_curve[-1]
    text = f"epoch {entry.epoch}: train loss {entry.training_loss:.4f}"
    if entry.validation_loss is not None:
        smoothed, raw = entry.validation_loss
        text += f", validation loss {raw:.4f} (smoothed {smoothed:.4f})"
    return text


async def fit_async(
    *,
    model: SupervisedModel,
    optimizer_factory: OptimizerFactory,
    train_batches: BatchStreamFactory,
    max_epochs: int,
    validation_batches: BatchStreamFactory | None = None,
    checkpoint_dir: str | Path | None = None,
    keep_last: int | None = 3,
    resume: bool = True,
    learning_rate_schedule: LearningRateSchedule[Any] = noop(),
    validation_frequency: int = 1,
    return_min_validation_loss_model: Container[int] = ALL_EPOCHS,
    validation_loss_exponential_smoothing_factor: float = 1.0,
    accumulate_gradient_over_n_batches: int = 1,
    device: torch.device | str = "cpu",
    on_epoch: Callable[[LoopState], object] | None = None,
    world_size: int | None = None,
    strategy: Strategy = "all_reduce",
    launch_command: Sequence[str] | None = None,
) -> LoopState | None:
    """Train ``model`` on one rank or several; see :func:`fit` (this is its async form)."""
    env = launch_env()
    if env is not None and world_size is not None and world_size != env.world_size:
        msg = (
            f"fit: world_size={world_size}, but the launcher ({env.launcher}) started {env.world_size} ranks"
        )
        raise ConfigurationError(msg)
    nranks = env.world_size if env is not None else (world_size or 1)
    rank = env.rank if env is not None else 0
    device = _rank_device(torch.device(device), env.local_rank if env is not None else 0, nranks)
    if nranks > 1 and device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // min(nranks, os.cpu_count() or 1)))
    spec = model_spec(model.module)
    if env is not None and rank > 0:
        async with open_follower_control(env, model_spec=spec) as follower:
            await follow_distributed_training(
                rank=rank,
                nranks=nranks,
                device=device,
                control=follower,
                model=model,
                train_batches=train_batches,
                validation_batches=validation_batches,
                accumulate_gradient_over_n_batches=accumulate_gradient_over_n_batches,
                optimizer_factory=optimizer_factory,
                strategy=strategy,
            )
        return None

    init_state: LoopStateWithModelAndOptimizerData | None = None
    schedule_state: Any = None
    if checkpoint_dir is not None and resume and latest_checkpoint(checkpoint_dir) is not None:
        checkpoint = load_checkpoint(checkpoint_dir, schedule=learning_rate_schedule, model=model.module)
        checkpoint.rng.restore()
        init_state, schedule_state = checkpoint.state, checkpoint.schedule_state
        logger.info("resuming from %s at epoch %d", checkpoint.path, init_state.loop_state.epoch)
    save = Checkpointer(checkpoint_dir, keep_last=keep_last) if checkpoint_dir is not None else None

    async def after_epoch(data: LoopStateWithModelAndOptimizerData, schedule_state: Any) -> None:
        logger.info("%s", _describe(data.loop_state))
        if save is not None:
            await save(data, schedule_state)
        if on_epoch is not None:
            on_epoch(data.loop_state)

    drive = functools.partial(
        drive_distributed_training,
        nranks=nranks,
        device=device,
        model=model,
        optimizer_factory=optimizer_factory,
        train_batches=train_batches,
        validation_batches=validation_batches,
        max_epochs=max_epochs,
        checkpoint_state=after_epoch,
        validation_frequency=validation_frequency,
        return_min_validation_loss_model=return_min_validation_loss_model,
        learning_rate_schedule=learning_rate_schedule,
        init_state=init_state,
        accumulate_gradient_over_n_batches=accumulate_gradient_over_n_batches,
        learning_rate_schedule_init_state=schedule_state,
        validation_loss_exponential_smoothing_factor=validation_loss_exponential_smoothing_factor,
        strategy=strategy,
    )
    if nranks == 1:
        return await drive(control=None)
    if env is not None:
        async with open_root_control(env, model_spec=spec) as root:
            return await drive(control=root, host=env.root_host)
    token = secrets.token_hex(16)
    async with (
        TcpControlRoot(host=_LOCAL, nranks=nranks, token=token, model_spec=spec) as root,
        anyio.create_task_group() as followers,
    ):
        spawn_followers(
            followers, world_size=nranks, control_address=root.address, token=token, command=launch_command
        )
        state = await drive(control=root, host=_LOCAL)
        # The followers got Stop; give them a bounded time to exit before they are killed.
        followers.cancel_scope.deadline = anyio.current_time() + _FOLLOWER_EXIT_TIMEOUT_S
    return state


def _rank_device(device: torch.device, local_rank: int, nranks: int) -> torch.device:
    if device.type == "cuda" and device.index is None and nranks > 1:
        return torch.device("cuda", local_rank)
    return device


def fit(**kwargs: Any) -> LoopState | None:
    """Train ``model``, checkpointing and resuming; return the final state (``None`` on followers).

    With ``world_size=n`` and no launcher, this process becomes rank 0 and runs
    the same command line again for ranks ``1..n-1`` (see
    :mod:`lamploop.launch`); under ``torchrun`` or Slurm the launcher's
    variables decide the rank.  Only rank 0 checkpoints and returns the state.

    Keyword arguments (all keyword-only):
        model: the :class:`SupervisedModel` to train; ends holding the best model
            when an eligible epoch validated, else the last one.
        optimizer_factory: ``params -> torch.optim.Optimizer``.
        train_batches: the training :data:`BatchStreamFactory`.
        max_epochs: the number of epochs in all (a resumed run counts the
            epochs already done).
        validation_batches: the validation stream factory, or ``None``.
        checkpoint_dir: write a checkpoint after every epoch there, and resume
            from its latest checkpoint when ``resume`` is true.
        keep_last: how many checkpoints to keep (``None``: all).
        learning_rate_schedule, validation_frequency,
        return_min_validation_loss_model (default: every epoch),
        validation_loss_exponential_smoothing_factor,
        accumulate_gradient_over_n_batches: as in :func:`lamploop.epochs` and
            :func:`lamploop.one_epoch`.
        device: where to train.
        on_epoch: called with the :class:`LoopState` after every epoch (rank 0).
        world_size: the number of ranks (default: the launcher's, else 1).
        strategy: ``"all_reduce"`` (default) or ``"reduce_to_root"``.
        launch_command: the command that starts ranks ``1..n-1`` when lamploop
            launches them itself (default: this process's command line).

    Raises:
        lamploop.errors.LamploopError: any of its subclasses, see the parts above.
    """
    run: Callable[[], Awaitable[LoopState | None]] = functools.partial(fit_async, **kwargs)
    return anyio.run(run)
