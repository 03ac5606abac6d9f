"""The :class:`Replica`: one rank's model, data and channel, and the epoch functions every rank shares.

The root and every follower call the same :meth:`Replica.train` / :meth:`Replica.validate`;
:func:`~lamploop.distributed.replica.open_replica` makes the replica and tears it down.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from lamploop.averaging import WeightAverage
from lamploop.batches import BatchContext, BatchStreamFactory
from lamploop.distributed.boundaries import RankBoundary
from lamploop.distributed.rank_extras import RankExtras
from lamploop.distributed.sharded_rank import ShardedRank
from lamploop.distributed.worker import EpochRunner, run_here
from lamploop.loop.batch_checks import check_stream
from lamploop.loop.boundary import EpochPosition
from lamploop.loop.epoch_pass import ValidationStopped, one_epoch
from lamploop.loop.precision import LOSS_SCALE_KEY, LossScale
from lamploop.loop.profiler import StepProfiler
from lamploop.loop.step_timing import StepTimes
from lamploop.model import SupervisedModel
from lamploop.schedules.step import check_step_factor
from lamploop.schedules.torch_scheduler import LR_SCHEDULER_KEY, make_lr_scheduler
from lamploop.settings import TrainingSettings
from lamploop.sync.channel import TensorChannel
from lamploop.sync.group_channel import ProcessGroupChannel

__all__ = ["Replica", "learning_rates", "saved_beside_optimizer", "set_learning_rate_factor"]


def set_learning_rate_factor(
    optimizer: torch.optim.Optimizer, base_lrs: Sequence[float], factor: float
) -> None:
    """Set every param group's learning rate to its base rate times ``factor``."""
    for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
        group["lr"] = base * factor


def learning_rates(optimizer: torch.optim.Optimizer | None) -> tuple[float, ...]:
    """Each param group's learning rate (none without an optimizer)."""
    return tuple(float(g["lr"]) for g in optimizer.param_groups) if optimizer is not None else ()


def _no_step() -> None:
    """Followers of a root-steps strategy: the new parameters arrive from the root."""


@attrs.define
class Replica:
    """A model, its data and its channel: everything one rank needs to run an epoch.

    Attributes:
        model: this rank's copy of the model.
        channel: the tensor channel joining the ranks.
        train_batches: makes this rank's training stream for an epoch.
        validation_batches: makes this rank's validation stream, or ``None``.
        settings: the run's training settings.
        device: where batches are moved before the forward pass.
        optimizer: this rank's optimizer, or ``None`` when another rank steps.
        base_lrs: each param group's learning rate before any schedule factor, read from
            the fresh optimizer (a loaded state dict holds its last epoch's rates).
        run_epoch: runs an epoch's coroutine: on the event loop (one rank) or a worker thread.
    """

    model: SupervisedModel
    channel: TensorChannel
    train_batches: BatchStreamFactory
    validation_batches: BatchStreamFactory | None
    settings: TrainingSettings
    device: torch.device
    optimizer: torch.optim.Optimizer | None
    base_lrs: tuple[float, ...] = ()
    run_epoch: EpochRunner = run_here
    boundary: RankBoundary | None = None
    resume_at: EpochPosition | None = None
    saved: Mapping[str, Any] = attrs.field(factory=dict)
    extras: RankExtras | None = None
    loss_scale: LossScale | None = attrs.field(init=False, default=None)
    lr_scheduler: Any = attrs.field(init=False, default=None)
    average: WeightAverage | None = attrs.field(init=False, default=None)
    # The root's progress sampler (when someone listens): called after every training step.
    after_step: Callable[[int, float | torch.Tensor], object] | None = attrs.field(init=False, default=None)
    # The root's step breakdown (when someone listens), summed by every training pass.
    step_times: StepTimes | None = attrs.field(init=False, default=None)
    # torch.profiler over the run's steps (see lamploop.loop.profiler), closed by open_replica.
    profiler: StepProfiler | None = attrs.field(init=False, default=None)
    # A sharded model's rank (strategy fsdp): ``model`` is then its sharded twin of the caller's.
    sharded: ShardedRank | None = None

    def __attrs_post_init__(self) -> None:
        # ``saved``: what a checkpoint kept beside the optimizer state (the root's, shared).
        if self.settings.precision == "fp16":  # one scale per run: it carries over epochs
            self.loss_scale = LossScale()
            if LOSS_SCALE_KEY in self.saved:
                self.loss_scale.load_json(self.saved[LOSS_SCALE_KEY])
        if self.settings.lr_scheduler is not None and self.optimizer is not None:
            saved = self.saved.get(LR_SCHEDULER_KEY)
            self.lr_scheduler = make_lr_scheduler(self.settings.lr_scheduler, self.optimizer, saved)
        if self.settings.averaging is not None and self.channel.rank == 0 and self.optimizer is not None:
            self.average = WeightAverage(self.settings.averaging, self.model.module)
        if self.settings.profile is not None:
            self.profiler = StepProfiler(self.settings.profile, rank=self.channel.rank, device=self.device)

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` with the loss scale and scheduler beside it, to checkpoint."""
        if self.optimizer is None:
            return {}
        state = self.optimizer.state_dict()
        if self.loss_scale is not None:
            state[LOSS_SCALE_KEY] = self.loss_scale.to_json()
        if self.lr_scheduler is not None:
            state[LR_SCHEDULER_KEY] = self.lr_scheduler.state_dict()
        return state

    def _context(self, epoch: int) -> BatchContext:
        return BatchContext(epoch=epoch, rank=self.channel.rank, nranks=self.channel.nranks)

    async def train(self, epoch: int, lr_factor: float) -> float:
        """Train one epoch with the learning rates scaled by ``lr_factor``; the global mean loss.

        The first epoch after resuming from a step boundary starts at that boundary.

        Raises:
            EpochStopped: the ranks stopped at a step boundary on request.
        """
        step: Callable[[], object] = _no_step
        if self.optimizer is not None:
            if self.lr_scheduler is None:  # a torch scheduler owns the rates
                set_learning_rate_factor(self.optimizer, self.base_lrs, lr_factor)
            step = self.optimizer.step
            if self._scheduled_per_step() or self.average is not None:  # else nothing more per step
                step = _then(step, self._after_step)
        start = None
        if self.resume_at is not None and self.resume_at.epoch == epoch:
            start = self.resume_at.start_of(self.channel.rank)
        self.resume_at = None
        if self.boundary is not None:
            self.boundary.epoch, self.boundary.lr_factor = epoch, lr_factor
        loss = await self._run(
            self.train_batches,
            epoch,
            step_optimizer=step,
            accumulate_gradient_over_n_batches=self.settings.accumulate_gradient_over_n_batches,
            on_non_finite_loss=self.settings.on_non_finite_loss,
            max_gradient_norm=self.settings.max_gradient_norm,
            precision=self.settings.precision,
            loss_scale=self.loss_scale,
            before_step=self._step_learning_rates(epoch, lr_factor),
            after_step=self.after_step,
            step_times=self.step_times,
            profiler=self.profiler,
            start=start,
            boundary=self.boundary,
        )
        if self.lr_scheduler is not None and self.settings.lr_scheduler_interval == "epoch":
            self.lr_scheduler.step()
        if self.average is not None:
            self.average.after_epoch(epoch)
        return loss

    def _scheduled_per_step(self) -> bool:
        return self.lr_scheduler is not None and self.settings.lr_scheduler_interval == "step"

    def _after_step(self) -> None:
        if self._scheduled_per_step():
            self.lr_scheduler.step()
        if self.average is not None:
            self.average.after_step()

    def _step_learning_rates(self, epoch: int, lr_factor: float) -> Callable[[int], None] | None:
        """Sets each step's learning rates: base * epoch factor * step factor (with a step schedule)."""
        schedule, optimizer = self.settings.step_schedule, self.optimizer
        if schedule is None or optimizer is None:
            return None

        def before_step(step: int) -> None:
            factor = lr_factor * check_step_factor(schedule, epoch, step)
            set_learning_rate_factor(optimizer, self.base_lrs, factor)

        return before_step

    async def validate(self, epoch: int) -> float:
        """One forward-only pass over the validation stream; the global mean loss.

        Raises:
            ValidationStopped: a stop was requested on some rank during the pass (every rank
                raises it): with the pass's result when it ran to its end, else ``None``.
        """
        if self.validation_batches is None:
            msg = f"rank {self.channel.rank}: asked to validate epoch {epoch} without validation_batches"
            raise RuntimeError(msg)
        return await self._run(
            self.validation_batches,
            epoch,
            forward_only=True,
            precision=self.settings.precision,  # training.md: training and validation under autocast
            boundary=self.boundary,
        )

    async def _run(self, batches: BatchStreamFactory, epoch: int, **how: Any) -> float:
        context = self._context(epoch)
        stream = batches(context)
        forward_only = how.get("forward_only", False)
        factory = "validation_batches" if forward_only else "train_batches"
        check_stream(stream, f"{factory}(epoch {epoch}, rank {context.rank} of {context.nranks})")

        async def one_pass() -> float:
            try:
                loss = await one_epoch(
                    model=self.model,
                    batches=stream,
                    channel=self.channel,
                    device=self.device,
                    epoch=epoch,
                    **how,
                )
            except ValidationStopped as stopped:
                if stopped.result is not None and self.boundary is not None:
                    self.boundary.keep_rng_states()  # the epoch ends: its checkpoint is written
                raise
            if self.boundary is not None:
                self.boundary.keep_rng_states()  # for the checkpoint at the end of the epoch
            if self.extras is not None and isinstance(self.channel, ProcessGroupChannel) and not forward_only:
                self.extras.after_training_pass(self.channel.collectives)  # the followers' to the root
            return loss

        return await self.run_epoch(one_pass)


def saved_beside_optimizer(optimizer_state: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint's optimizer state keeps beside the optimizer's own (loss scale, scheduler)."""
    return {key: optimizer_state[key] for key in (LOSS_SCALE_KEY, LR_SCHEDULER_KEY) if key in optimizer_state}


def _then(step: Callable[[], object], after: Callable[[], None]) -> Callable[[], None]:
    def step_then() -> None:
        step()
        after()

    return step_then
