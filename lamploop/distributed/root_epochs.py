"""The root's epoch effects: what :func:`lamploop.epochs` awaits on the root rank.

:class:`RootEpochs` tells the followers each command, trains and validates the root's
replica, keeps the best model and writes the checkpoints (a sharded model's with the
followers, at the next command); :func:`~lamploop.distributed.drive.drive_distributed_training`
makes one and runs its :meth:`RootEpochs.epochs`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import attrs
import torch

from lamploop.checkpoint import RngStates
from lamploop.checkpoint.sharded import ShardedModelState
from lamploop.control.commands import ControlRoot, Stop, Train, Valid
from lamploop.distributed.replica import Replica, saved_beside_optimizer
from lamploop.errors import TrainingInterrupted
from lamploop.loop.boundary import EpochPosition, EpochStopped
from lamploop.loop.epoch_driver import epochs
from lamploop.loop.epoch_pass import ValidationStopped
from lamploop.model import unwrapped
from lamploop.reporting.emitter import EventEmitter
from lamploop.reporting.epoch_events import EpochEvents
from lamploop.settings import TrainingSettings
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData
from lamploop.sync.group_channel import ProcessGroupChannel

# How long the root waits for the control channel to name a stop request it heard in a pass's
# sum: a follower passes its request on within a poll (0.1 s) and a send.
_REASON_WAIT_S = 5.0

__all__ = ["CheckpointPosition", "RootEpochs"]


CheckpointPosition = Callable[
    [LoopStateWithModelAndOptimizerData, Any, EpochPosition, Sequence[RngStates]], Awaitable[bool | None]
]
"""Writes a step-boundary checkpoint: the state (its loop state at the epoch in progress), the
schedule state that epoch was asked with, the position in it, and every rank's RNG states.
Returns ``False`` when it chose to write none there (``fit`` with checkpoint extras, inside an epoch)."""


class RootEpochs:
    """The effects :func:`lamploop.epochs` awaits on the root: tell, train, validate, keep the best."""

    def __init__(
        self,
        replica: Replica,
        control: ControlRoot | None,
        checkpoint_state: Callable[[LoopStateWithModelAndOptimizerData, Any], Awaitable[None]] | None,
        checkpoint_position: CheckpointPosition | None,
        init_state: LoopStateWithModelAndOptimizerData | None,
        schedule_state: Any,
        emit: EventEmitter,
    ) -> None:
        self.replica = replica
        self.control = control
        self.checkpoint_state = checkpoint_state
        self.checkpoint_position = checkpoint_position
        self.state = init_state.loop_state if init_state is not None else LoopState()
        self.schedule_state = schedule_state  # what the epoch in progress was asked with
        self.next_epoch = self.state.epoch
        self.position_saved = True  # whether the last step-boundary save wrote a checkpoint
        self.end_reason = ""  # why the epoch loop ended, in words (RunFinished.reason)
        self.stop_after_epoch = False  # a stop was requested during the epoch's (whole) validation
        self.max_epochs = 0  # set by epochs()
        self.nranks = replica.channel.nranks
        self.best: dict[str, torch.Tensor] = dict(init_state.best_model) if init_state is not None else {}
        # A sharded model's rank: its best model is kept in every rank's shards, and what the
        # followers must do with the root (keep the best, checkpoint) waits for the next command.
        self.sharded = replica.sharded
        if self.sharded is not None:
            self.best = {}
        self.best_pending = False
        self.save_pending: tuple[LoopStateWithModelAndOptimizerData, Any, EpochPosition, Any] | None = None
        if replica.average is not None and init_state is not None and init_state.averaged_count:
            replica.average.load(init_state.averaged_model, init_state.averaged_count)
        self.events = EpochEvents(emit, _wait_seconds(replica.channel))
        replica.after_step = self.events.after_step
        replica.step_times = self.events.step_times

    def _data(self, state: LoopState) -> LoopStateWithModelAndOptimizerData:
        average = self.replica.average
        if self.sharded is not None:  # the tensors go into every rank's shards (ShardWriter)
            beside = saved_beside_optimizer(self.replica.optimizer_state())
            return LoopStateWithModelAndOptimizerData(
                loop_state=state, model=ShardedModelState(self.sharded.writer), optimizer=beside
            )
        return LoopStateWithModelAndOptimizerData(
            loop_state=state,
            model=unwrapped(self.replica.model.module).state_dict(),
            optimizer=self.replica.optimizer_state(),
            best_model=self.best,
            averaged_model=average.state_dict() if average is not None and average.count else {},
            averaged_count=average.count if average is not None else 0,
        )

    async def save_position(self, position: EpochPosition, rngs: Sequence[RngStates]) -> None:
        if self.checkpoint_position is not None:
            data = self._data(self.state)
            written = await self._checkpoint_position(data, self.schedule_state, position, rngs)
            self.position_saved = written is not False

    async def _checkpoint_position(
        self,
        data: LoopStateWithModelAndOptimizerData,
        schedule_state: Any,
        position: EpochPosition,
        rngs: Any,
    ) -> bool | None:
        """``checkpoint_position``; with a sharded model, the followers then hear how it went."""
        assert self.checkpoint_position is not None
        if self.sharded is None:
            return await self.checkpoint_position(data, schedule_state, position, rngs)
        sharded = self.sharded
        try:
            written = await self.checkpoint_position(data, schedule_state, position, rngs)
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                await sharded.on_worker(sharded.writer.end, e)
            raise
        await sharded.on_worker(sharded.writer.end, None)
        return written

    async def _sharded_point(self, finish: bool) -> None:
        """After each command: every rank keeps the best model, checkpoints, installs the result."""
        if self.sharded is None:
            return
        sharded, pending = self.sharded, self.save_pending
        request = {"best": self.best_pending, "save": pending is not None, "finish": finish}
        self.best_pending, self.save_pending = False, None
        await sharded.on_worker(sharded.point, request)
        if pending is not None:
            await self._checkpoint_position(*pending)
        if finish:
            await sharded.on_worker(sharded.install)

    async def epochs(self, settings: TrainingSettings, validates: bool) -> LoopState:
        """Run :func:`lamploop.epochs` from where this root starts, with these effects."""
        self.max_epochs = settings.max_epochs
        return await epochs(
            max_epochs=settings.max_epochs,
            train_epoch=self.train,
            validation_epoch=self.validate if validates else None,
            save_min_validation_loss_model=self.save_best,
            checkpoint_state=self.after_epoch,
            validation_frequency=settings.validation_frequency,
            return_min_validation_loss_model=settings.return_min_validation_loss_model,
            learning_rate_schedule=settings.learning_rate_schedule,
            init_state=self.state,
            learning_rate_schedule_init_state=self.schedule_state,
            validation_loss_exponential_smoothing_factor=settings.validation_loss_exponential_smoothing_factor,
            model_selection_metric=settings.model_selection_metric,
            model_selection_mode=settings.model_selection_mode,  # type: ignore[arg-type]
            early_stopping_patience=settings.early_stopping_patience,
            on_end=self._ended,
        )

    def _ended(self, reason: str) -> None:
        self.end_reason = reason

    async def tell(self, command: Train | Valid | Stop) -> None:
        if self.control is not None and self.replica.channel.nranks > 1:
            await self.control.broadcast(command)
            await self._sharded_point(finish=isinstance(command, Stop))

    def _epoch_starts(self, lr_factor: float) -> None:
        resume = self.replica.resume_at
        if resume is not None and resume.epoch == self.next_epoch:
            self.events.epoch_started(
                self.next_epoch, lr_factor, resume.steps_done, sum(resume.example_counts)
            )
        else:
            self.events.epoch_started(self.next_epoch, lr_factor)

    async def train(self, lr_factor: float) -> float:
        await self.tell(Train(epoch=self.next_epoch, lr_factor=lr_factor))
        self._epoch_starts(lr_factor)
        try:
            return await self.replica.train(self.next_epoch, lr_factor)
        except EpochStopped as stopped:
            reason = await self._stop_reason()
            steps = stopped.progress.steps_done
            saved = ""
            if self.checkpoint_position is not None:
                saved = (
                    "; a checkpoint was written there"
                    if self.position_saved
                    else "; no checkpoint was written there: the next run resumes from the last epoch's end"
                )
            msg = f"stopped by {reason} at epoch {self.next_epoch} after step {steps}{saved}"
            raise TrainingInterrupted(msg, epoch=self.next_epoch, steps_done=steps, reason=reason) from None

    async def _stop_reason(self) -> str:
        """What asked for the stop.  A request heard only in a pass's sum (another rank's, near the
        end of a validation pass) has no name here yet: the control channel brings it a little
        later, so wait for it a bounded while."""
        reason = self.replica.boundary.stop_reason if self.replica.boundary is not None else ""
        if not reason and self.control is not None:
            with anyio.move_on_after(_REASON_WAIT_S):
                reason = await self.control.wait_for_stop_request()
        return reason or "a request on another rank"

    async def validate(self) -> float:
        await self.tell(Valid(epoch=self.next_epoch))
        self.events.validation_started()
        try:
            loss = await self.replica.validate(self.next_epoch)
        except ValidationStopped as stopped:
            if stopped.result is None:  # a part of the validation batches: no epoch's end
                epoch, reason = self.next_epoch, await self._stop_reason()
                msg = (
                    f"stopped by {reason} during the validation of epoch {epoch}, which was cut short "
                    "and discarded: the epoch is not finished and no checkpoint of its end was written; "
                    "the next run resumes from the last checkpoint written before it"
                )
                raise TrainingInterrupted(msg, epoch=epoch, steps_done=-1, reason=reason) from None
            loss = stopped.result  # whole: the epoch ends, its checkpoint is written, then the run stops
            self.stop_after_epoch = True
        self.events.validated(self.next_epoch, loss)
        return loss

    async def save_best(self) -> None:
        if self.sharded is not None:  # every rank keeps its shards at the next command
            self.best_pending = True
            return
        self.best = {
            k: v.detach().clone() for k, v in unwrapped(self.replica.model.module).state_dict().items()
        }

    async def after_epoch(self, state: LoopState, schedule_state: Any) -> None:
        self.events.epoch_finished(state)
        self.state, self.schedule_state, self.next_epoch = state, schedule_state, state.epoch
        if self.checkpoint_position is not None:
            # The start of the next epoch is a step boundary too: step 0, with every rank's RNG states.
            start = EpochPosition(state.epoch, 0.0, 0, 0, (0.0,) * self.nranks, (0,) * self.nranks)
            boundary = self.replica.boundary
            rngs = (
                boundary.kept_rngs if boundary is not None and boundary.kept_rngs else [RngStates.capture()]
            )
            if self.sharded is not None:  # written with the followers, at the next command
                self.save_pending = (self._data(state), schedule_state, start, rngs)
            else:
                await self.checkpoint_position(self._data(state), schedule_state, start, rngs)
        if self.checkpoint_state is not None:
            data = self._data(state)
            if self.sharded is not None:  # the shards are written through checkpoint_position only
                data = attrs.evolve(data, model={})
            await self.checkpoint_state(data, schedule_state)
        if self.stop_after_epoch and state.epoch < self.max_epochs:  # at the last epoch: the run is done
            await self._stop_at_epoch_end(state.epoch - 1)

    async def _stop_at_epoch_end(self, epoch: int) -> None:
        """A stop requested during the validation of ``epoch``: the run ends at the epoch's end."""
        reason = await self._stop_reason()
        saved = ""
        if self.checkpoint_position is not None:
            # A sharded model's checkpoint is written with the followers, at the Stop that follows.
            saved = "; the epoch's checkpoint was written, the next run resumes from there"
        msg = f"stopped by {reason} during the validation of epoch {epoch}, at the epoch's end{saved}"
        raise TrainingInterrupted(msg, epoch=epoch + 1, steps_done=0, reason=reason)


def _wait_seconds(channel: object) -> Callable[[], float]:
    """The root's running total of seconds blocked on collectives (none with one rank)."""
    if isinstance(channel, ProcessGroupChannel):
        collectives = channel.collectives
        return lambda: collectives.wait_seconds
    return lambda: 0.0
