"""``train_pipeline``: epochs of pipeline-parallel training, the same call on every rank.

Launch one process per stage (see docs/pipeline.md)::

    with open_pipeline_group(rank=r, world_size=n, host=..., port=...):
        state = anyio.run(partial(train_pipeline, model=model, spec=spec, ...))

Every rank builds the whole model (the same initial parameters), keeps and trains only its
stage, and reads the same batch stream (the first stage feeds the features, the last one
the targets; every stage needs the batch sizes).  The step's loss sum and example count are
summed over the ranks, so every rank computes the same losses and runs
:func:`lamploop.epochs` to the same decisions (schedule, best model, early stop) without a
control channel; each returns the same :class:`~lamploop.LoopState`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Container
from typing import Any, TypeVar

import anyio.to_thread
import torch
import torch.distributed as dist

from lamploop.batches import BatchContext, BatchStreamFactory
from lamploop.checkpoint.restore import restore_optimizer_state
from lamploop.checks import check_callable, check_int
from lamploop.distributed.replica import learning_rates, set_learning_rate_factor
from lamploop.distributed.root_setup import OptimizerFactory
from lamploop.errors import BatchError, CheckpointError, ConfigurationError, NonFiniteLossError
from lamploop.loop.batch_checks import check_stream, prepare, where
from lamploop.loop.epoch_driver import epochs
from lamploop.loop.optimizer import make_optimizer
from lamploop.model import LossFunction, cross_entropy_loss
from lamploop.pipeline.group import current_group
from lamploop.pipeline.spec import SCHEDULES, PipelineSpec
from lamploop.pipeline.split import split_sequential
from lamploop.pipeline.stage import StageRunner, all_reduce
from lamploop.schedules import LearningRateSchedule, noop
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData

__all__ = ["train_pipeline"]

S = TypeVar("S")


def _features_of(item: Any, epoch: int, index: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    features, target = prepare(item, None, epoch, index, 0)
    if not isinstance(features, torch.Tensor):
        got = type(features).__name__
        msg = f"pipeline: {where(epoch, index, 0)}: the features must be one tensor, got {got}"
        raise BatchError(msg)
    rows = int(target.shape[0])
    if rows % n:
        msg = (
            f"pipeline: {where(epoch, index, 0)}: {rows} examples do not split into {n} equal "
            f"micro-batches; every batch (the last one too: drop_last) must be a multiple of n_microbatches"
        )
        raise BatchError(msg)
    return features, target


async def _settle(spec: PipelineSpec, layers: int, parameters: int, start_epoch: int, rank: int) -> None:
    """Check, with one sum over the ranks, that every rank starts the same pipeline at the same epoch."""
    facts = {
        "number of stages": spec.num_stages,
        "n_microbatches": spec.n_microbatches,
        "schedule": SCHEDULES.index(spec.schedule),
        "number of layers": layers,
        "sum of the boundaries": sum(spec.boundaries),
        "number of parameters of the whole model": parameters,
        "epoch to start at (from init_state)": start_epoch,
    }
    mine = torch.tensor(list(facts.values()), dtype=torch.float64)
    both = torch.cat([mine, -mine])  # max of x and of -x: the largest and the smallest value

    what = "comparing the ranks' set-up"
    await anyio.to_thread.run_sync(lambda: all_reduce(both, rank=rank, what=what, op=dist.ReduceOp.MAX))
    n = len(facts)
    for position, name in enumerate(facts):
        high, low = float(both[position]), -float(both[n + position])
        if high != low:
            msg = (
                f"pipeline stage {rank}: the ranks disagree on the {name} (from {low:g} to {high:g}); "
                "every rank must be given the same model, spec and starting state"
            )
            raise ConfigurationError(msg)


class _StageEpochs:
    """The effects :func:`lamploop.epochs` awaits, on one stage."""

    def __init__(
        self,
        runner: StageRunner,
        optimizer: torch.optim.Optimizer,
        train_batches: BatchStreamFactory,
        validation_batches: BatchStreamFactory | None,
        checkpoint_state: Callable[[LoopStateWithModelAndOptimizerData, Any], Awaitable[None]] | None,
        best: dict[str, torch.Tensor],
        start_epoch: int,
        base_lrs: tuple[float, ...],
    ) -> None:
        self.runner, self.optimizer = runner, optimizer
        self.train_batches, self.validation_batches = train_batches, validation_batches
        self.checkpoint_state = checkpoint_state
        self.best = best
        self.base_lrs = base_lrs
        self.epoch = start_epoch
        self.n = runner.spec.n_microbatches

    async def train(self, lr_factor: float) -> float:
        set_learning_rate_factor(self.optimizer, self.base_lrs, lr_factor)
        stream = self.train_batches(BatchContext(epoch=self.epoch))
        check_stream(stream)
        self.optimizer.zero_grad(set_to_none=True)
        # Summed in float64 one step after the other: the same on every rank.
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        index = 0
        async for item in stream:
            features, target = _features_of(item, self.epoch, index, self.n)
            loss_sum, examples = await anyio.to_thread.run_sync(
                self.runner.train_step, features, target, self.optimizer, self.epoch, index
            )
            total += loss_sum
            count += examples
            index += 1
        if count == 0:
            msg = f"pipeline: epoch {self.epoch}: the training batch stream was empty"
            raise BatchError(msg)
        return float(total) / count

    async def validate(self) -> float:
        assert self.validation_batches is not None
        stream = self.validation_batches(BatchContext(epoch=self.epoch))
        check_stream(stream)
        self.runner.begin_forward_pass()
        index = 0
        async for item in stream:
            features, target = _features_of(item, self.epoch, index, self.n)
            await anyio.to_thread.run_sync(self.runner.forward_batch, features, target, self.epoch, index)
            index += 1
        total, count = await anyio.to_thread.run_sync(self.runner.forward_totals, self.epoch)
        if count == 0:
            msg = f"pipeline: epoch {self.epoch}: the validation batch stream was empty"
            raise BatchError(msg)
        loss = total / count
        if not math.isfinite(loss):
            msg = f"pipeline: epoch {self.epoch}: the validation loss is {loss}"
            raise NonFiniteLossError(msg, epoch=self.epoch, batch=None)
        return loss

    async def save_best(self) -> None:
        self.best = {k: v.detach().clone() for k, v in self.runner.module.state_dict().items()}

    async def after_epoch(self, state: LoopState, schedule_state: Any) -> None:
        self.epoch = state.epoch
        if self.checkpoint_state is not None:
            data = LoopStateWithModelAndOptimizerData(
                loop_state=state,
                model=self.runner.module.state_dict(),
                optimizer=self.optimizer.state_dict(),
                best_model=self.best,
            )
            await self.checkpoint_state(data, schedule_state)
            # Wait until every stage has written this epoch's checkpoint: a rank that goes on
            # (to resume from it, say) finds every stage's, not only its own.
            done = torch.zeros(1)
            what = f"waiting for every stage's checkpoint of epoch {state.epoch}"
            await anyio.to_thread.run_sync(lambda: all_reduce(done, rank=self.runner.rank, what=what))


async def train_pipeline(
    *,
    model: torch.nn.Module,
    spec: PipelineSpec,
    optimizer_factory: OptimizerFactory,
    train_batches: BatchStreamFactory,
    max_epochs: int,
    loss: LossFunction = cross_entropy_loss,
    validation_batches: BatchStreamFactory | None = None,
    validation_frequency: int = 1,
    return_min_validation_loss_model: Container[int] = (),
    learning_rate_schedule: LearningRateSchedule[S] = noop(),  # type: ignore[assignment]
    learning_rate_schedule_init_state: S | None = None,
    validation_loss_exponential_smoothing_factor: float = 1.0,
    init_state: LoopStateWithModelAndOptimizerData | None = None,
    checkpoint_state: Callable[[LoopStateWithModelAndOptimizerData, S], Awaitable[None]] | None = None,
) -> LoopState:
    """Train this rank's stage of ``model``; call it on every rank, inside :func:`open_pipeline_group`.

    Epochs run as in :func:`lamploop.epochs`.  Each batch of ``train_batches`` is one
    optimizer step on every stage: cut into ``spec.n_microbatches`` micro-batches that flow
    through the stages (``torch.distributed.pipelining``), with the gradient of (sum of the
    batch's losses) / (its examples), as one process training the whole model on the same
    batches would have.  Losses are means over every example (loss sum / examples).  When
    training ends, the stage holds the best epoch's parameters if an eligible epoch validated.

    Args:
        model: the whole model, a ``torch.nn.Sequential`` on the CPU, built alike on every
            rank; this rank trains its stage's layers in place and leaves the others alone.
        spec: where to split the model, micro-batches and schedule.
        optimizer_factory: makes this stage's optimizer from its parameters.
        train_batches: the training stream factory, called with ``BatchContext(epoch)`` (rank
            0 of 1: every stage reads the same stream); its order must depend on the epoch only.
        max_epochs: the epoch count at which to stop.
        loss: ``(output, target) -> (loss sum, example count)``, run on the last stage.
        validation_batches: the validation stream factory, or ``None``.
        validation_frequency, return_min_validation_loss_model, learning_rate_schedule,
            learning_rate_schedule_init_state, validation_loss_exponential_smoothing_factor:
            as in :func:`lamploop.epochs`.
        init_state: resume this stage from it (see :func:`load_stage_checkpoint`).
        checkpoint_state: awaited after every epoch with this stage's state (see
            :func:`stage_checkpointer`) and the schedule state the next epoch will use; the
            ranks then wait for each other, so every stage's checkpoint is written when any
            rank goes on.

    Returns:
        The loop state, the same on every rank.

    Raises:
        ConfigurationError: no process group, a world size other than the number of
            stages, a model that is not a ``Sequential`` or that ``spec`` does not fit, or
            ranks that were given different models, specs or starting epochs.
        BatchError: a malformed batch, or one whose size is not a multiple of
            ``spec.n_microbatches`` (on every rank alike: they read the same stream), or
            the stage or its loss failed on a batch.
        NonFiniteLossError: a step's loss was NaN or infinite (on every rank, before its step),
            or the validation loss was.
        DistributedError: another stage died, or did not answer within the group's timeout.
        CheckpointError: ``init_state`` does not fit this stage.
    """
    group = current_group("train_pipeline")
    if not isinstance(spec, PipelineSpec):
        msg = f"train_pipeline: spec must be a PipelineSpec, got {type(spec).__qualname__}"
        raise ConfigurationError(msg)
    check_int("train_pipeline: max_epochs", max_epochs, 0)
    check_callable("train_pipeline: train_batches", train_batches)
    check_callable("train_pipeline: validation_batches", validation_batches, optional=True)
    check_callable("train_pipeline: checkpoint_state", checkpoint_state, optional=True)
    if init_state is not None and not isinstance(init_state, LoopStateWithModelAndOptimizerData):
        msg = (
            "train_pipeline: init_state must be a LoopStateWithModelAndOptimizerData (see "
            f"load_stage_checkpoint), got {type(init_state).__name__}"
        )
        raise ConfigurationError(msg)
    stages = split_sequential(model, spec.boundaries)
    if group.world_size != spec.num_stages:
        msg = (
            f"train_pipeline: the spec has {spec.num_stages} stages but the process group has "
            f"{group.world_size} ranks; run one rank per stage"
        )
        raise ConfigurationError(msg)
    if any(t.device.type != "cpu" for t in model.parameters()):
        msg = "train_pipeline: the model must be on the CPU (this pipeline runs Gloo between CPU stages)"
        raise ConfigurationError(msg)
    for index, stage in enumerate(stages):  # every rank checks every stage: all refuse alike
        if next(stage.parameters(), None) is None:
            layers = spec.layer_ranges(model)[index]
            msg = (
                f"train_pipeline: stage {index} (layers {layers.start}..{layers.stop - 1}) has no "
                "parameters (its optimizer would have none); move a boundary so that every stage holds some"
            )
            raise ConfigurationError(msg)
    rank = group.rank
    runner = StageRunner(stages, rank, spec, loss)
    optimizer = make_optimizer(optimizer_factory, runner.module.parameters(), where="train_pipeline")
    best: dict[str, torch.Tensor] = {}
    start_epoch = 0
    base_lrs = learning_rates(optimizer)  # before a restored state sets the last epoch's rates
    if init_state is not None:
        try:
            runner.module.load_state_dict(dict(init_state.model))
        except RuntimeError as exc:
            msg = f"train_pipeline: init_state does not fit stage {rank}: {exc}"
            raise CheckpointError(msg) from exc
        restore_optimizer_state(optimizer, init_state)
        best = dict(init_state.best_model)
        start_epoch = init_state.loop_state.epoch
    parameters = sum(p.numel() for p in model.parameters())
    await _settle(spec, len(list(model.children())), parameters, start_epoch, rank)
    effects = _StageEpochs(
        runner, optimizer, train_batches, validation_batches, checkpoint_state, best, start_epoch, base_lrs
    )
    state = await epochs(
        max_epochs=max_epochs,
        train_epoch=effects.train,
        validation_epoch=effects.validate if validation_batches is not None else None,
        save_min_validation_loss_model=effects.save_best,
        checkpoint_state=effects.after_epoch,
        validation_frequency=validation_frequency,
        return_min_validation_loss_model=return_min_validation_loss_model,
        learning_rate_schedule=learning_rate_schedule,
        init_state=init_state.loop_state if init_state is not None else None,
        learning_rate_schedule_init_state=learning_rate_schedule_init_state,
        validation_loss_exponential_smoothing_factor=validation_loss_exponential_smoothing_factor,
    )
    if effects.best:
        runner.module.load_state_dict(effects.best)
    return state
