"""Checks of the arguments a user passes, made before anything starts, with a message that says what to pass.

The common mistakes (a bare ``nn.Module`` for the model, an optimizer for the optimizer
factory, tensors or a ``DataLoader`` for a batch factory) would otherwise fail deep inside
the first epoch with an ``AttributeError`` or ``TypeError`` that names none of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lamploop.checkpoint.extras import CheckpointExtra, check_extras
from lamploop.distributed.rank_extras import SYNC_EXTRA
from lamploop.distributed.sharded_checks import check_sharded_strategy
from lamploop.errors import ConfigurationError
from lamploop.loop.optimizer import check_takes_parameters
from lamploop.settings import TrainingSettings
from lamploop.sync.strategy import AUTO, keeps_state, strategy_named

__all__ = [
    "check_batch_factory",
    "check_checkpointing",
    "check_model",
    "check_optimizer_factory",
    "check_sharded_strategy",
    "check_stateful_strategy",
]


def check_model(where: str, model: Any) -> None:
    """``model`` must be a :class:`~lamploop.SupervisedModel` (or have its two attributes)."""
    if isinstance(model, torch.nn.Module):
        msg = (
            f"{where}: model is a torch.nn.Module ({type(model).__name__}); wrap it with its loss: "
            "lamploop.SupervisedModel(module) (cross-entropy) or lamploop.SupervisedModel(module, loss=...)"
        )
        raise ConfigurationError(msg)
    if not isinstance(getattr(model, "module", None), torch.nn.Module) or not callable(
        getattr(model, "loss_sum_and_count", None)
    ):
        msg = f"{where}: model must be a lamploop.SupervisedModel, got {type(model).__name__}"
        raise ConfigurationError(msg)


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


def check_batch_factory(where: str, name: str, factory: Any, *, optional: bool = False) -> None:
    """``factory`` must be a batch factory (a callable of the batch context), not the data itself.

    ``None`` passes when ``optional`` (no validation batches: no validation).
    """
    if factory is None and optional:
        return
    if callable(factory) and not isinstance(factory, torch.Tensor | torch.nn.Module):
        return
    kind = type(factory).__name__
    if isinstance(factory, torch.utils.data.DataLoader):
        hint = f"lamploop.dataloader_batches({name}_loader)"
    elif isinstance(factory, torch.Tensor | list | tuple):
        hint = "lamploop.tensor_batches(features, targets, batch_size=...)"
    else:
        hint = "lamploop.tensor_batches(...) or lamploop.dataloader_batches(...)"
    msg = (
        f"{where}: {name} must be a batch factory (called once per epoch with the batch context), "
        f"got {kind}; make one with {hint}"
    )
    raise ConfigurationError(msg)


def check_reporters(where: str, reporters: Any) -> None:
    """``reporters``: ``None`` or a sequence of objects with a ``report(event)`` method.

    A plain function (``reporters=[print]``) would fail at every event, each failure logged
    and the run going on: it is refused before anything starts, with what to pass instead.
    """
    if reporters is None:
        return
    if isinstance(reporters, str | bytes) or not isinstance(reporters, Sequence):
        msg = f"{where}: reporters must be a list of reporters, got {type(reporters).__name__}"
        raise ConfigurationError(msg)
    for i, reporter in enumerate(reporters):
        if not callable(getattr(reporter, "report", None)):
            msg = (
                f"{where}: reporters[{i}] ({reporter!r}) has no report(event) method; pass a reporter "
                "such as lamploop.reporting.LoggingReporter(), or an object of your own with "
                "report(self, event) (see lamploop.reporting.Reporter)"
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
