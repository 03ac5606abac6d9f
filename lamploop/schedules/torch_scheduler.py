"""A ``torch.optim.lr_scheduler`` in place of lamploop's own schedules, stepped per step or per epoch.

The optimizer is made inside each rank from ``optimizer_factory``, so the scheduler comes
from a factory too: ``lr_scheduler=lambda optimizer: OneCycleLR(optimizer, ...)``, with
``lr_scheduler_interval="step"`` (after every optimizer step) or ``"epoch"`` (after every
training epoch).  Its ``state_dict()`` is written to checkpoints beside the optimizer's (under
:data:`LR_SCHEDULER_KEY`, which ``Optimizer.load_state_dict`` ignores) and shared from the
root when the ranks meet, so a resumed run, also one resumed mid-epoch, steps on exactly.
The scheduler owns the learning rates: it cannot be combined with ``learning_rate_schedule``
(other than ``noop()``) or ``step_schedule``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Literal, TypeAlias

import torch

from lamploop.errors import ConfigurationError

__all__ = [
    "LR_SCHEDULER_KEY",
    "LrSchedulerFactory",
    "SchedulerInterval",
    "check_interval",
    "make_lr_scheduler",
]

LR_SCHEDULER_KEY: Final = "lamploop_lr_scheduler"
SchedulerInterval: TypeAlias = Literal["epoch", "step"]
LrSchedulerFactory: TypeAlias = Callable[[torch.optim.Optimizer], Any]
"""``optimizer -> torch.optim.lr_scheduler.LRScheduler`` (anything with ``step``, ``state_dict``,
``load_state_dict`` and ``get_last_lr``)."""


def check_interval(value: object) -> SchedulerInterval:
    """``"epoch"`` or ``"step"``, else ConfigurationError."""
    if value not in ("epoch", "step"):
        msg = f"lr_scheduler_interval must be 'epoch' or 'step', got {value!r}"
        raise ConfigurationError(msg)
    return value


def make_lr_scheduler(
    factory: LrSchedulerFactory, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any] | None
) -> Any:
    """The scheduler over ``optimizer``, going on from ``saved`` (a checkpoint's) when given.

    Raises:
        ConfigurationError: the factory gave something that is not a scheduler, or a
            ``ReduceLROnPlateau`` (it steps on a metric; lamploop's ``reduce_lr_on_plateau`` serves).
    """
    # Making a scheduler sets the hyperparameters of its first step (OneCycleLR: the rate and
    # the momentum); a resumed optimizer already holds the checkpoint's: keep those.
    resumed_groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    scheduler = factory(optimizer)
    for member in ("step", "state_dict", "load_state_dict", "get_last_lr"):
        if not callable(getattr(scheduler, member, None)):
            msg = (
                f"lr_scheduler must return a torch.optim.lr_scheduler scheduler, got "
                f"{type(scheduler).__name__} (no {member}())"
            )
            raise ConfigurationError(msg)
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):  # step(metrics): no count
        msg = (
            "lr_scheduler: ReduceLROnPlateau steps on a metric, which lamploop does not pass to a "
            "PyTorch scheduler; use learning_rate_schedule=lamploop.schedules.reduce_lr_on_plateau(...), "
            "which reads the validation loss and goes into checkpoints"
        )
        raise ConfigurationError(msg)
    if saved is not None:
        scheduler.load_state_dict(dict(saved))
        for group, resumed in zip(optimizer.param_groups, resumed_groups, strict=True):
            group.update(resumed)
    return scheduler
