"""Checks of the arguments a user passes, made before anything starts, with a message that says what to pass.

The common mistakes (a bare ``nn.Module`` for the model, an optimizer for the optimizer
factory, tensors or a ``DataLoader`` for a batch factory) would otherwise fail deep inside
the first epoch with an ``AttributeError`` or ``TypeError`` that names none of them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lamploop.checkpoint.extras import CheckpointExtra, check_extras
from lamploop.checkpoint.save import storable_schedule_state
from lamploop.checks import check_bool, check_callable, check_directory
from lamploop.control.settings import Link
from lamploop.distributed.inputs import check_batch_factory, check_model, check_reporters
from lamploop.distributed.rank_extras import SYNC_EXTRA
from lamploop.distributed.sharded_checks import check_sharded_strategy
from lamploop.errors import CheckpointError, ConfigurationError
from lamploop.loop.optimizer import check_takes_parameters
from lamploop.settings import TrainingSettings
from lamploop.sync.strategy import AUTO, keeps_state, strategy_named

__all__ = [
    "check_batch_factory",
    "check_checkpointing",
    "check_fit_keywords",
    "check_model",
    "check_optimizer_factory",
    "check_reporters",
    "check_sharded_strategy",
    "check_stateful_strategy",
]


def check_optimizer_factory(where: str, factory: Any) -> None:
    """``factory`` must make an optimizer from parameters."""
    if isinstance(factory, torch.optim.Optimizer):
        msg = (
            f"{where}: optimizer_factory is an optimizer ({type(factory).__name__}); pass a function that "
            "makes one from the parameters, e.g. lambda params: torch.optim.SGD(params, lr=0.1)"
        )
        raise ConfigurationError(msg)
    if not callable(factory):
        msg = f"{where}: optimizer_factory must be a function of the parameters, got {type(factory).__name__}"
        raise ConfigurationError(msg)
    check_takes_parameters(factory, where=where)


def check_fit_keywords(
    where: str,
    *,
    on_epoch: object,
    checkpoint_dir: object,
    resume: object,
    launch_command: object,
    heartbeat_interval: object,
    heartbeat_timeout: object,
) -> None:
    """``fit``'s keywords that are used only later (after an epoch, or by a second rank), checked now."""
    check_callable(f"{where}: on_epoch", on_epoch, optional=True)
    if checkpoint_dir is not None:
        check_directory(f"{where}: checkpoint_dir", checkpoint_dir)
    check_bool(f"{where}: resume", resume)
    if launch_command is not None:
        check_launch_command(where, launch_command)
    try:
        # A run of one rank has no control channel: check the heartbeat here all the same,
        # as the same call with world_size=2 would only fail once rank 1 was started.
        Link.checked(heartbeat_interval, heartbeat_timeout, 1 << 20)  # type: ignore[arg-type]
    except ConfigurationError as exc:
        msg = f"{where}: {exc}"
        raise ConfigurationError(msg) from None


def check_launch_command(where: str, command: object) -> None:
    """A non-empty argv whose program can be found (a path, or a name on ``PATH``)."""
    if (
        isinstance(command, str | bytes)
        or not isinstance(command, Sequence)
        or not all(isinstance(word, str | os.PathLike) for word in command)
    ):
        msg = (
            f"{where}: launch_command must be None or a list of str (argv, e.g. "
            f"[sys.executable, 'train.py']), got {command!r:.60}"
        )
        raise ConfigurationError(msg)
    if not command:
        msg = f"{where}: launch_command is empty; give the program and its arguments: [sys.executable, ...]"
        raise ConfigurationError(msg)
    program = os.fspath(command[0])
    if not program or shutil.which(program) is None:
        msg = (
            f"{where}: launch_command's program {program!r} is not an executable file or a command on "
            "PATH; e.g. launch_command=[sys.executable, 'train.py']"
        )
        raise ConfigurationError(msg)


def check_selection_needs_validation(where: str, settings: TrainingSettings, validation_batches: Any) -> None:
    """A model selection metric other than the validation loss is read from validations."""
    metric = settings.model_selection_metric
    if metric is not None and validation_batches is None:
        msg = (
            f"{where}: model_selection_metric={metric!r} needs validation_batches: the best model "
            "is picked by that metric over the validations, and there would be none"
        )
        raise ConfigurationError(msg)


def check_early_stopping(where: str, patience: int | None, validation_batches: Any) -> None:
    """``early_stopping_patience`` counts validations: without validation batches it would never act."""
    if patience is not None and validation_batches is None:
        msg = (
            f"{where}: early_stopping_patience={patience} needs validation_batches: it counts "
            "validations without a new best model, and there would be none"
        )
        raise ConfigurationError(msg)


def check_checkpointing(
    where: str, settings: TrainingSettings, directory: object, extras: Mapping[str, CheckpointExtra] | None
) -> Mapping[str, CheckpointExtra]:
    """Checkpoints inside epochs and extras need a directory; extras refuse checkpoints inside epochs."""
    every = _every(settings)
    if directory is None and every is not None:
        msg = f"{where}: {every} asks for checkpoints inside epochs, but checkpoint_dir is None: say where"
        raise ConfigurationError(msg)
    if directory is not None:
        # A schedule state no checkpoint can store would end the run after its first epoch,
        # the epoch lost: its first state is known now.
        try:
            storable_schedule_state(settings.learning_rate_schedule.init())
        except CheckpointError as exc:
            msg = f"{where}: checkpoint_dir is set, but the learning-rate schedule's {exc}"
            raise CheckpointError(msg) from exc
    checked = check_extras(where, extras)
    if not checked:
        return checked
    if directory is None:
        msg = f"{where}: checkpoint_extras {sorted(checked)} go into checkpoints, but checkpoint_dir is None"
        raise ConfigurationError(msg)
    if every is not None:
        msg = (
            f"{where}: {every} cannot be combined with checkpoint_extras: an extra's state (a stream "
            "buffer's) at a step boundary does not match a pass resumed there, which replays the "
            "epoch's first batches; with checkpoint_extras, checkpoints are written at epoch ends "
            "(make epochs shorter instead, e.g. buffer_batches(batches_per_epoch=...))"
        )
        raise ConfigurationError(msg)
    return checked


def _every(settings: TrainingSettings) -> str | None:
    """The name of the setting that asks for checkpoints inside epochs (``None``: neither does)."""
    if settings.checkpoint_every_n_steps is not None:
        return "checkpoint_every_n_steps"
    if settings.checkpoint_every_seconds is not None:
        return "checkpoint_every_seconds"
    return None


def check_stateful_strategy(
    where: str, settings: TrainingSettings, extras: Mapping[str, CheckpointExtra]
) -> None:
    """A strategy that keeps state saves it at epoch ends, under a reserved name (see rank_extras)."""
    strategy = settings.strategy
    if strategy == AUTO or not keeps_state(strategy_named(strategy)):
        return
    if SYNC_EXTRA in extras:
        msg = f"{where}: checkpoint_extras name {SYNC_EXTRA!r} is taken by strategy {strategy!r}'s own state"
        raise ConfigurationError(msg)
    every = _every(settings)
    if every is not None:
        msg = (
            f"{where}: {every} cannot be combined with strategy {strategy!r}: its state (error feedback, "
            "scales, outer momentum) is saved at epoch ends, where every rank's is consistent with the "
            "model; make epochs shorter instead"
        )
        raise ConfigurationError(msg)
