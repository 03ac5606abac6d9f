"""Resuming a run from the latest checkpoint of its directory: what ``fit`` hands the drivers.

The root reads the newest checkpoint (:func:`resume_root`): the loop state, the schedule's
state, the position inside the epoch and every rank's RNG states go to the driver; its own
RNG states and its checkpoint extras are restored here, before training starts.  A follower
reads the same checkpoint for its own extras only (:func:`resume_follower_extras`); the
ranks compare the checkpoint's name when they meet.

An extra saved under a name the caller reserves (a sync strategy's state, ``sync`` and
``sync.rank<r>``) is not the user's: it is handed back apart (:attr:`Resumed.reserved`) and
never reported as left unrestored.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from lamploop.checkpoint.extras import CheckpointExtra, ExtraState, rank_extra_name
from lamploop.checkpoint.load import latest_checkpoint, load_checkpoint, load_checkpoint_leaving_shards
from lamploop.checkpoint.rng import RngStates
from lamploop.checkpoint.sharded import is_sharded_checkpoint
from lamploop.errors import CheckpointError
from lamploop.loop.boundary import EpochPosition
from lamploop.schedules import LearningRateSchedule
from lamploop.state import LoopStateWithModelAndOptimizerData

__all__ = ["Resumed", "restore_extras", "resume_follower_extras", "resume_root"]

logger = logging.getLogger("lamploop")

_OTHER_RANKS = re.compile(r"\.rank[0-9]+$")  # the followers' extras in the root's checkpoints


def _reserved_pattern(reserved: str | None) -> re.Pattern[str] | None:
    """``name`` and ``name.rank<r>``: every rank's extra saved under the reserved name."""
    return re.compile(re.escape(reserved) + r"(\.rank[0-9]+)?") if reserved is not None else None


@attrs.frozen(kw_only=True)
class Resumed:
    """Where the root resumes: the driver's keyword arguments, and the extras' checkpoint.

    Attributes:
        init_state, learning_rate_schedule_init_state, init_position, init_rank_rngs: for
            :func:`~lamploop.distributed.drive_distributed_training`.
        extras_from: the checkpoint's name when extras were restored from it (``None``: none given).
        reserved: every rank's extras saved under the reserved name, by saved name.
    """

    init_state: LoopStateWithModelAndOptimizerData
    learning_rate_schedule_init_state: Any
    init_position: EpochPosition | None
    init_rank_rngs: tuple[RngStates, ...]
    extras_from: str | None
    reserved: dict[str, ExtraState]

    def drive_arguments(self) -> dict[str, Any]:
        """The keyword arguments of ``drive_distributed_training`` that resume there."""
        return {
            "init_state": self.init_state,
            "learning_rate_schedule_init_state": self.learning_rate_schedule_init_state,
            "init_position": self.init_position,
            "init_rank_rngs": self.init_rank_rngs,
        }


def resume_root(
    checkpoint_dir: str | Path | None,
    resume: bool,
    schedule: LearningRateSchedule[Any],
    module: torch.nn.Module,
    extras: Mapping[str, CheckpointExtra],
    *,
    reserved: str | None = None,
    nranks: int | None = None,
    leave_shards: bool = False,
) -> Resumed | None:
    """Load the latest checkpoint of ``checkpoint_dir`` for the root (``None``: nothing to resume).

    The checkpoint is checked against ``module`` and ``schedule``; the extras and this
    process's RNG states are restored here.  A sharded run's checkpoint taken at an epoch's
    end resumes at any number of ranks ``nranks`` (it reshards): with another number than it
    was saved with, the followers start from their own RNG states.  With ``leave_shards``
    (a sharded run of several ranks resumes) its tensors stay on disk for every rank to read
    its own rows (:func:`~lamploop.checkpoint.load.load_checkpoint_leaving_shards`).

    Raises:
        CheckpointError: the checkpoint is damaged, does not fit the model or the schedule, or
            lacks state for one of ``extras``.
    """
    if checkpoint_dir is None or not resume or latest_checkpoint(checkpoint_dir) is None:
        return None
    load = load_checkpoint_leaving_shards if leave_shards else load_checkpoint
    checkpoint = load(checkpoint_dir, schedule=schedule, model=module)
    restore_extras(checkpoint.path, checkpoint.extras, extras, rank=0, reserved=reserved)
    checkpoint.rng.restore()
    where = f"epoch {checkpoint.state.loop_state.epoch}"
    if checkpoint.position is not None:
        where += f" after step {checkpoint.position.steps_done}"
    logger.info("resuming from %s at %s", checkpoint.path, where)
    pattern = _reserved_pattern(reserved)
    rngs = (checkpoint.rng, *checkpoint.rank_rngs)
    if (
        nranks is not None
        and len(rngs) != nranks
        and checkpoint.position is None
        and is_sharded_checkpoint(checkpoint.path)
    ):
        logger.info(
            "%s was saved by %d ranks and resumes on %d (resharded): the followers start from "
            "their own RNG states",
            checkpoint.path,
            len(rngs),
            nranks,
        )
        rngs = rngs[:1]
    return Resumed(
        init_state=checkpoint.state,
        learning_rate_schedule_init_state=checkpoint.schedule_state,
        init_position=checkpoint.position,
        init_rank_rngs=rngs,
        extras_from=checkpoint.path.name if extras else None,
        reserved={
            name: state
            for name, state in checkpoint.extras.items()
            if pattern is not None and pattern.fullmatch(name)
        },
    )


def resume_follower_extras(
    checkpoint_dir: str | Path | None,
    resume: bool,
    rank: int,
    extras: Mapping[str, CheckpointExtra],
    *,
    reserved: str | None = None,
) -> str | None:
    """A follower restores its own extras from the checkpoint the root resumes from (every rank reads it).

    Returns the checkpoint's name, which the ranks compare when they meet (``None``: nothing restored).
    """
    if not extras or checkpoint_dir is None or not resume or latest_checkpoint(checkpoint_dir) is None:
        return None
    checkpoint = load_checkpoint_leaving_shards(checkpoint_dir)  # the extras only: no model read
    restore_extras(checkpoint.path, checkpoint.extras, extras, rank=rank, reserved=reserved)
    return checkpoint.path.name


def restore_extras(
    path: Path,
    saved: Mapping[str, ExtraState],
    extras: Mapping[str, CheckpointExtra],
    *,
    rank: int,
    reserved: str | None = None,
) -> None:
    """Load this rank's state of every extra; one the checkpoint lacks is refused (it would start afresh).

    Raises:
        CheckpointError: the checkpoint at ``path`` has no state for one of ``extras`` on ``rank``.
    """
    names = {rank_extra_name(name, rank): name for name in extras}
    missing = sorted(set(names) - set(saved))
    if missing:
        have = sorted(saved) or "none"
        msg = (
            f"{path}: has no state for the checkpoint extras {missing} (it has {have}); resuming would "
            "start them afresh while the model carries on; pass resume=False or another checkpoint_dir"
        )
        raise CheckpointError(msg)
    for saved_name, name in names.items():
        tensors, meta = saved[saved_name]
        extras[name].load_state_dict(tensors, meta)
    pattern = _reserved_pattern(reserved)
    unused = sorted(
        n
        for n in set(saved) - set(names)
        if not _OTHER_RANKS.search(n) and (pattern is None or not pattern.fullmatch(n))
    )
    if unused and rank == 0:
        logger.warning("%s: its checkpoint extras %s are not restored (not given)", path, unused)
