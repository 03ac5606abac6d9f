"""What ``fit`` runs once its arguments are checked and its rank placed: a follower's run or the root's.

:func:`~lamploop.fit.fit_async` checks every argument, places this process (its rank and
device) and makes a :class:`Job`.  Then a rank the launcher started runs :func:`follow`,
and the root resumes from the latest checkpoint and runs :func:`lead`: it writes the
checkpoints, reports, and drives the ranks.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

import anyio
import attrs

from lamploop.batches import BatchStreamFactory
from lamploop.checkpoint import Checkpointer
from lamploop.checkpoint.extras import CheckpointExtra
from lamploop.checkpoint.resume import Resumed, resume_follower_extras
from lamploop.distributed.drive import OptimizerFactory, drive_distributed_training
from lamploop.distributed.follow import follow_distributed_training
from lamploop.distributed.launch import FollowersEndedByTheStop, open_follower_control, open_root
from lamploop.distributed.placement import Placement
from lamploop.distributed.rank_extras import SYNC_EXTRA, RankExtras
from lamploop.errors import TrainingInterrupted
from lamploop.loop.boundary import EpochPosition
from lamploop.loop.stop_request import StopRequest
from lamploop.model import SupervisedModel
from lamploop.modelspec import ModelSpec
from lamploop.reporting.emitter import EventEmitter
from lamploop.reporting.events import CheckpointWritten
from lamploop.reporting.logging_reporter import LoggingReporter
from lamploop.reporting.progress import ProgressReporter
from lamploop.reporting.reporter import Reporter
from lamploop.settings import TrainingSettings
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData
from lamploop.stopping import (
    reported_run,
    share_stop_requests,
    stop_if_requested_before_training,
)
from lamploop.sync.abandon import reclaim_ended

__all__ = ["Heartbeat", "Job", "default_reporter", "follow", "lead", "resumed_epoch"]

# fit's logger (the one it had before this part moved here).
logger = logging.getLogger("lamploop")

RECLAIM_WAIT_S = 2.0
"""How long a failed run whose followers this process started waits for what was in flight on its
process group to end (the followers have exited: it fails at once) before leaving the group."""


class Heartbeat(TypedDict):
    """The control channel's heartbeat keywords (``open_root``, ``open_follower_control``)."""

    heartbeat_interval: float
    heartbeat_timeout: float


@attrs.frozen(kw_only=True)
class Job:
    """What every rank of one ``fit`` call trains with: checked, and placed."""

    model: SupervisedModel
    optimizer_factory: OptimizerFactory
    train_batches: BatchStreamFactory  # stop-aware: a stop ends a wait for samples
    validation_batches: BatchStreamFactory | None  # stop-aware too: a validation cut short is discarded
    settings: TrainingSettings
    placement: Placement
    spec: ModelSpec
    heartbeat: Heartbeat
    stop: StopRequest
    extras: Mapping[str, CheckpointExtra]
    checkpoint_dir: str | Path | None
    resume: bool


def default_reporter() -> Reporter:
    """Live progress bars when stderr is a terminal and rich is installed, else a line per epoch."""
    if sys.stderr.isatty() and importlib.util.find_spec("rich") is not None:
        return ProgressReporter(sys.stderr)
    return LoggingReporter()


def resumed_epoch(resumed: Resumed | None) -> int:
    return resumed.init_state.loop_state.epoch if resumed is not None else 0


async def follow(job: Job) -> None:
    """A follower: restore its extras from the root's checkpoint, then run the epochs the root commands."""
    placement = job.placement
    assert placement.env is not None  # a follower was started by a launcher
    restored_from = resume_follower_extras(
        job.checkpoint_dir, job.resume, placement.rank, job.extras, reserved=SYNC_EXTRA
    )
    await stop_if_requested_before_training(job.stop, 0)
    async with (
        open_follower_control(placement.env, model_spec=job.spec, **job.heartbeat) as control,
        share_stop_requests(job.stop, control),
    ):
        await follow_distributed_training(
            rank=placement.rank,
            nranks=placement.nranks,
            device=placement.device,
            control=control,
            model=job.model,
            train_batches=job.train_batches,
            validation_batches=job.validation_batches,
            optimizer_factory=job.optimizer_factory,
            settings=job.settings,
            stop=job.stop,
            checkpoint_extras=RankExtras(
                job.extras, rank=placement.rank, nranks=placement.nranks, resumed_from=restored_from
            ),
        )


async def lead(
    job: Job,
    resumed: Resumed | None,
    listeners: Sequence[Reporter],
    keep_last: int | None,
    on_epoch: Callable[[LoopState], object] | None,
    launch_command: Sequence[str] | None,
    at_once: anyio.CancelScope,
) -> LoopState:
    """The root: checkpoint, report, and drive the ranks (alone, under a launcher, or its own followers)."""
    placement = job.placement
    run_extras = RankExtras(
        job.extras,
        rank=0,
        nranks=placement.nranks,
        resumed_from=resumed.extras_from if resumed is not None else None,
        saved_sync=resumed.reserved if resumed is not None else None,
    )
    save = None
    if job.checkpoint_dir is not None:
        save = Checkpointer(job.checkpoint_dir, keep_last=keep_last, extras=run_extras)
    emit = EventEmitter(listeners)

    async def after_epoch(data: LoopStateWithModelAndOptimizerData, schedule_state: Any) -> None:
        # The checkpoint itself is written through checkpoint_position, with every rank's RNG states.
        if on_epoch is not None:
            on_epoch(data.loop_state)

    async def save_position(
        data: LoopStateWithModelAndOptimizerData, schedule_state: Any, at: EpochPosition, rngs: Sequence[Any]
    ) -> bool:
        assert save is not None
        if run_extras.at_epoch_ends_only and at.steps_done > 0:  # a stop inside an epoch
            logger.warning(
                "stopped inside epoch %d after step %d: no checkpoint written there, since the "
                "checkpoint extras %s are consistent at epoch ends only; the next run resumes from "
                "the last epoch's end",
                at.epoch,
                at.steps_done,
                sorted(run_extras),
            )
            return False
        began = time.monotonic()
        await save.save_position(data, schedule_state, at, rngs)
        path = str(save.last_path) if save.last_path is not None else None
        emit(CheckpointWritten(at.epoch, at.steps_done, path, time.monotonic() - began))
        return True

    async def run() -> LoopState:
        try:
            return await drive()
        except FollowersEndedByTheStop as ended:
            # A Ctrl-C to the process group while a follower still imported torch: the stop
            # request it was, not a lost rank.  No rank trained: nothing was written.
            msg = (
                f"stopped by {job.stop.reason} before training started ({ended}): nothing was "
                "written, a checkpoint resumed from is untouched"
            )
            epoch = resumed_epoch(resumed)
            raise TrainingInterrupted(msg, epoch=epoch, steps_done=0, reason=job.stop.reason) from None

    async def drive() -> LoopState:
        try:
            return await drive_in_group()
        finally:
            # A failed run abandons its process group (lamploop.sync.abandon); the followers this
            # process started have exited by now, ending what was in flight: release it, with its
            # threads and its store's port, rather than keep it for the process's life.
            with anyio.move_on_after(RECLAIM_WAIT_S if placement.env is None else 0.0):
                while reclaim_ended():  # noqa: ASYNC110  (Gloo's threads end the work: no event)
                    await anyio.sleep(0.05)

    async def drive_in_group() -> LoopState:
        async with (
            open_root(
                placement.env,
                placement.nranks,
                model_spec=job.spec,
                command=launch_command,
                stop=job.stop,
                **job.heartbeat,
            ) as (control, host),
            share_stop_requests(job.stop, control),  # a rank that waits for data hears the others' stops
        ):
            return await drive_distributed_training(
                nranks=placement.nranks,
                device=placement.device,
                control=control,
                model=job.model,
                optimizer_factory=job.optimizer_factory,
                train_batches=job.train_batches,
                validation_batches=job.validation_batches,
                max_epochs=job.settings.max_epochs,
                checkpoint_state=after_epoch,
                settings=job.settings,
                host=host,
                checkpoint_position=save_position if save is not None else None,
                stop=job.stop,
                reporters=listeners,
                checkpoint_extras=run_extras,
                **(resumed.drive_arguments() if resumed is not None else {}),
            )

    return await reported_run(run(), job.stop, emit, at_once)
