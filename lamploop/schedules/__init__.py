"""Learning rates: lamploop's three mechanisms, one module each (docs/schedules.md says which to pick).

- :mod:`lamploop.schedules.epoch` -- pure epoch schedules (lamp's set: ``noop``, ``linear``,
  ``reduce_lr_on_plateau``...), one factor per epoch, with their state in every checkpoint;
  ``learning_rate_schedule=``.  Re-exported here, as DESIGN.md names them:
  ``from lamploop.schedules import linear``.
- :mod:`lamploop.schedules.step` -- per-step factors (``warmup_cosine``, ``warmup_linear``),
  pure functions of ``(epoch, step)``, multiplied with the epoch schedule's;
  ``step_schedule=``.
- :mod:`lamploop.schedules.torch_scheduler` -- a ``torch.optim.lr_scheduler`` factory in
  place of both, stepped per step or per epoch, its state checkpointed; ``lr_scheduler=``.

The learning rate of a step is ``base_lr * epoch factor * step factor``; a
``torch.optim.lr_scheduler`` owns the rates alone.
"""

from lamploop.schedules.epoch import (
    Cyclic,
    Decrement,
    FromEpochCount,
    LearningRateSchedule,
    Linear,
    Noop,
    PlateauState,
    ReduceLrOnPlateau,
    StepAfter,
    cyclic,
    decrement,
    from_epoch_count,
    linear,
    noop,
    reduce_lr_on_plateau,
    step_after,
)
from lamploop.schedules.step import StepSchedule, warmup_cosine, warmup_linear
from lamploop.schedules.torch_scheduler import LrSchedulerFactory, SchedulerInterval

__all__ = [
    "Cyclic",
    "Decrement",
    "FromEpochCount",
    "LearningRateSchedule",
    "Linear",
    "LrSchedulerFactory",
    "Noop",
    "PlateauState",
    "ReduceLrOnPlateau",
    "SchedulerInterval",
    "StepAfter",
    "StepSchedule",
    "cyclic",
    "decrement",
    "from_epoch_count",
    "linear",
    "noop",
    "reduce_lr_on_plateau",
    "step_after",
    "warmup_cosine",
    "warmup_linear",
]
