"""Pipeline parallelism: a ``torch.nn.Sequential`` split into stages, one per rank.

Built on ``torch.distributed.pipelining`` (its ``PipelineStage`` and its GPipe and 1F1B
schedules) over Gloo, with lamploop's batch streams, epochs, losses and checkpoints:

- :mod:`~lamploop.pipeline.spec` -- :class:`PipelineSpec`: boundaries, micro-batches, schedule;
- :mod:`~lamploop.pipeline.split` -- :func:`split_sequential`, and the stages' shapes;
- :mod:`~lamploop.pipeline.group` -- :func:`open_pipeline_group`, the bounded process group;
- :mod:`~lamploop.pipeline.stage` -- one stage's steps on torch's engine;
- :mod:`~lamploop.pipeline.train` -- :func:`train_pipeline`, the epochs on every rank;
- :mod:`~lamploop.pipeline.checkpoint` -- one checkpoint per stage, resumed together.
"""

from lamploop.pipeline.checkpoint import (
    load_stage_checkpoint,
    saved_epochs,
    stage_checkpoint_dir,
    stage_checkpointer,
)
from lamploop.pipeline.group import DEFAULT_PIPELINE_TIMEOUT_S, PipelineGroup, open_pipeline_group
from lamploop.pipeline.spec import SCHEDULES, PipelineSpec, ScheduleName
from lamploop.pipeline.split import split_sequential
from lamploop.pipeline.train import train_pipeline

__all__ = [
    "DEFAULT_PIPELINE_TIMEOUT_S",
    "SCHEDULES",
    "PipelineGroup",
    "PipelineSpec",
    "ScheduleName",
    "load_stage_checkpoint",
    "open_pipeline_group",
    "saved_epochs",
    "split_sequential",
    "stage_checkpoint_dir",
    "stage_checkpointer",
    "train_pipeline",
]
