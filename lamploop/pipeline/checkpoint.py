"""Checkpoints of a pipeline: one lamploop checkpoint per stage, resumed at an epoch every stage saved.

Each rank saves its own stage (its parameters, its optimizer's state, its part of the best
model, the loop state every rank shares) with :func:`lamploop.checkpoint.save_checkpoint`
into a directory of its own::

    <directory>/stage-000/epoch-000003/   model.safetensors, optimizer.safetensors, ...
    <directory>/stage-001/epoch-000003/

The stages save independently, so a crash can leave stage 0 one epoch ahead of stage 1;
:func:`load_stage_checkpoint` therefore resumes every stage at the newest epoch that
*every* stage has saved (``keep_last`` must keep more than one for that to exist).
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Awaitable, Callable
from typing import Any

import anyio.to_thread
import torch

from lamploop.checkpoint import Checkpoint, checkpoint_name, load_checkpoint, save_checkpoint
from lamploop.checkpoint.format import DESCRIPTOR_NAME
from lamploop.checks import check_directory, check_int
from lamploop.errors import ConfigurationError
from lamploop.schedules import LearningRateSchedule
from lamploop.state import LoopStateWithModelAndOptimizerData

__all__ = ["load_stage_checkpoint", "saved_epochs", "stage_checkpoint_dir", "stage_checkpointer"]


def stage_checkpoint_dir(directory: str | os.PathLike[str], stage_index: int) -> pathlib.Path:
    """Where stage ``stage_index`` keeps its checkpoints: ``<directory>/stage-NNN``."""
    check_int("stage_checkpoint_dir: stage_index", stage_index, 0)
    return check_directory("stage_checkpoint_dir: directory", directory) / f"stage-{stage_index:03d}"


def stage_checkpointer(
    directory: str | os.PathLike[str], stage_index: int, *, keep_last: int | None = 3
) -> Callable[[LoopStateWithModelAndOptimizerData, Any], Awaitable[None]]:
    """A ``checkpoint_state`` for :func:`train_pipeline` that saves this stage after every epoch.

    Args:
        directory: the run's checkpoint directory (shared by the stages, or not).
        stage_index: this rank's stage.
        keep_last: checkpoints kept per stage (``None``: all); more than one, so that the
            stages still share an epoch after one of them crashed mid-save.

    Raises:
        ConfigurationError: ``keep_last`` is 1 or less.
    """
    if keep_last is not None and (
        not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 2
    ):
        msg = (
            f"stage_checkpointer: keep_last must be None or an int >= 2 (the stages save on their own: "
            f"one may be an epoch ahead), got {keep_last!r}"
        )
        raise ConfigurationError(msg)
    target = check_directory(
        "stage_checkpointer: the stage's directory", stage_checkpoint_dir(directory, stage_index)
    )

    async def save(state: LoopStateWithModelAndOptimizerData, schedule_state: Any) -> None:
        write = functools.partial(
            save_checkpoint, target, state, schedule_state=schedule_state, keep_last=keep_last
        )
        await anyio.to_thread.run_sync(write)

    return save


def saved_epochs(directory: str | os.PathLike[str], stage_index: int) -> set[int]:
    """The epochs at whose start stage ``stage_index`` has a complete checkpoint (none: empty)."""
    root = stage_checkpoint_dir(directory, stage_index)
    if not root.is_dir():
        return set()
    found = set()
    for child in root.iterdir():
        name = child.name
        if name.startswith("epoch-") and name[6:].isdigit() and (child / DESCRIPTOR_NAME).is_file():
            found.add(int(name[6:]))
    return found


def load_stage_checkpoint(
    directory: str | os.PathLike[str],
    *,
    stage_index: int,
    num_stages: int,
    stage: torch.nn.Module | None = None,
    schedule: LearningRateSchedule[Any] | None = None,
) -> Checkpoint | None:
    """This stage's checkpoint at the newest epoch every stage saved, or ``None`` if there is none.

    Pass ``checkpoint.state`` as ``init_state`` and ``checkpoint.schedule_state`` as
    ``learning_rate_schedule_init_state`` to :func:`train_pipeline`.

    Args:
        directory: the run's checkpoint directory.
        stage_index: this rank's stage.
        num_stages: how many stages the run has.
        stage: the stage's module, which the checkpoint must fit (names, shapes, dtypes).
        schedule: the learning-rate schedule, to structure the saved schedule state.

    Raises:
        ConfigurationError: ``stage_index`` is not in ``0..num_stages-1``.
        CheckpointError: the checkpoint is corrupt or does not fit ``stage`` (see
            :func:`lamploop.checkpoint.load_checkpoint`).  It does not fall back to an older
            epoch, as ``fit``'s resume does: each stage would fall back alone, and the stages
            must resume at one epoch.  To resume from the epoch before, delete the corrupt
            epoch's directory on every stage.
    """
    check_int("load_stage_checkpoint: num_stages", num_stages, 1)
    check_int("load_stage_checkpoint: stage_index", stage_index, 0)
    if stage_index >= num_stages:
        msg = f"load_stage_checkpoint: stage_index must be in 0..{num_stages - 1}, got {stage_index}"
        raise ConfigurationError(msg)
    common = set.intersection(*(saved_epochs(directory, i) for i in range(num_stages)))
    if not common:
        return None
    path = stage_checkpoint_dir(directory, stage_index) / checkpoint_name(max(common))
    return load_checkpoint(path, schedule=schedule, model=stage)
