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
from lamploop.checkpoint import Checkpoint, Checkpointer, latest_checkpoint, load_checkpoint, save_checkpoint
from lamploop.distributed import (
    drive_distributed_training,
    follow_distributed_training,
    local_data_parallel_training_loop,
)
from lamploop.epoch import one_epoch
from lamploop.fit import fit, fit_async
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
    "Checkpoint",
    "Checkpointer",
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
    "drive_distributed_training",
    "epochs",
    "errors",
    "fit",
    "fit_async",
    "follow_distributed_training",
    "from_epoch_count",
    "iterable_batches",
    "latest_checkpoint",
    "linear",
    "load_checkpoint",
    "local_data_parallel_training_loop",
    "model_spec",
    "mse_loss",
    "noop",
    "one_epoch",
    "reduce_lr_on_plateau",
    "save_checkpoint",
    "schedules",
    "step_after",
    "summed",
    "tensor_batches",
]
