"""lamploop: training loops as plain data and functions, on one process or many.

The names users call are re-exported here; docs/architecture.md maps the modules.
"""

from typing import Any

from lamploop import averaging, errors, metrics, schedules
from lamploop.averaging import ema, swa
from lamploop.batches import (
    BatchContext,
    BatchStream,
    BatchStreamFactory,
    dataloader_batches,
    iterable_batches,
    tensor_batches,
)
from lamploop.checkpoint import Checkpoint, Checkpointer, latest_checkpoint, load_checkpoint, save_checkpoint
from lamploop.control import TcpControlFollower, TcpControlRoot, local_control
from lamploop.distributed import (
    drive_distributed_training,
    follow_distributed_training,
    local_data_parallel_training_loop,
)
from lamploop.fit import fit, fit_async
from lamploop.loop import ALL_EPOCHS, epochs, one_epoch
from lamploop.loop.profiler import Profile
from lamploop.loop.step_timing import StepBreakdown
from lamploop.lr_find import LrFindResult, lr_find, lr_find_async
from lamploop.metrics import PassResult, accuracy
from lamploop.model import SupervisedModel, cross_entropy_loss, mse_loss, summed
from lamploop.modelspec import ModelSpec, model_spec
from lamploop.reporting import LoggingReporter, Reporter
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
from lamploop.schedules import step as step_schedules
from lamploop.schedules.step import warmup_cosine, warmup_linear
from lamploop.settings import TrainingSettings
from lamploop.state import LearningCurveEntry, LoopState, LoopStateWithModelAndOptimizerData
from lamploop.summary import ModelSummary, summarize
from lamploop.sync import register_strategy, strategy_names

__version__ = "0.3.0.dev0"

__all__ = [
    "ALL_EPOCHS",
    "BatchContext",
    "BatchStream",
    "BatchStreamFactory",
    "Checkpoint",
    "Checkpointer",
    "LearningCurveEntry",
    "LearningRateSchedule",
    "LoggingReporter",
    "LoopState",
    "LoopStateWithModelAndOptimizerData",
    "LrFindResult",
    "ModelSummary",
    "ModelSpec",
    "PassResult",
    "Profile",
    "Reporter",
    "StepBreakdown",
    "SupervisedModel",
    "TcpControlFollower",
    "TcpControlRoot",
    "TrainingSettings",
    "accuracy",
    "averaging",
    "cross_entropy_loss",
    "cyclic",
    "dataloader_batches",
    "decrement",
    "drive_distributed_training",
    "ema",
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
    "local_control",
    "local_data_parallel_training_loop",
    "lr_find",
    "lr_find_async",
    "metrics",
    "model_spec",
    "mse_loss",
    "noop",
    "one_epoch",
    "reduce_lr_on_plateau",
    "register_strategy",
    "save_checkpoint",
    "schedules",
    "step_after",
    "step_schedules",
    "strategy_names",
    "summarize",
    "summed",
    "swa",
    "tensor_batches",
    "warmup_cosine",
    "warmup_linear",
]

_MOVED = {
    "converter": ("lamploop.state", "converter"),
    "SingleProcessChannel": ("lamploop.sync", "SingleProcessChannel"),
    "TensorChannel": ("lamploop.sync", "TensorChannel"),
}


def __getattr__(name: str) -> Any:
    """Names of 0.1 that are internal now, still found at their new home (not in ``__all__``)."""
    if name in _MOVED:
        import importlib

        module, attribute = _MOVED[name]
        return getattr(importlib.import_module(module), attribute)
    msg = f"module 'lamploop' has no attribute {name!r}"
    raise AttributeError(msg)
