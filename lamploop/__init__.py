"""lamploop: training loops as plain data and functions, on one process or many.

The public names are re-exported here; see the docs/ pages for a tour.
"""

from lamploop import errors, schedules
from lamploop.batches import (
    BatchContext,
    BatchStream,
    BatchStreamFactory,
    dataloader_batches,
    iterable_batches,
    tensor_batches,
)
from lamploop.epoch import one_epoch
from lamploop.loop import ALL_EPOCHS, epochs
from lamploop.model import SupervisedModel, cross_entropy_loss, mse_loss, summed
from lamploop.modelspec import ModelSpec, model_spec
from lamploop.schedules import (
    LearningRateSchedule,
    cyclic,
    decrement,
    from_epoch_count,
    linear,
    noop,
    reduce_lr_on_plateau,
    step_after,
)
from lamploop.state import LearningCurveEntry, LoopState, LoopStateWithModelAndOptimizerData, converter
from lamploop.tensors import SingleProcessChannel, TensorChannel

__version__ = "0.1.0"

__all__ = [
    "ALL_EPOCHS",
    "BatchContext",
    "BatchStream",
    "BatchStreamFactory",
    "LearningCurveEntry",
    "LearningRateSchedule",
    "LoopState",
    "LoopStateWithModelAndOptimizerData",
    "ModelSpec",
    "SingleProcessChannel",
    "SupervisedModel",
    "TensorChannel",
    "converter",
    "cross_entropy_loss",
    "cyclic",
    "dataloader_batches",
    "decrement",
    "epochs",
    "errors",
    "from_epoch_count",
    "iterable_batches",
    "linear",
    "model_spec",
    "mse_loss",
    "noop",
    "one_epoch",
    "reduce_lr_on_plateau",
    "schedules",
    "step_after",
    "summed",
    "tensor_batches",
]
