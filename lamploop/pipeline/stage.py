"""``StageRunner``: this rank's stage on ``torch.distributed.pipelining``, one step or pass at a time.

torch's ``PipelineStage`` is told its input and output shapes up front (see
:mod:`lamploop.pipeline.split`); its receive buffers have those shapes, so a stage and its
schedule serve one micro-batch shape.  The runner keeps one per (shape, dtype, training)
and builds the next on the first batch that needs it: every rank reads the same batches,
so every rank builds it at the same step and torch's set-up messages pair up.

A training step, on every rank::

    schedule.step(...)      # micro-batches forward, then backward (GPipe or 1F1B)
                            # the last stage backprops loss_sum(micro-batch) / expected
    totals = sum over ranks of [loss sum, examples]    # only the last stage has them
    gradients *= expected / examples   (when the guess was wrong; exactly 1 otherwise)
    optimizer.step(); clear gradients

``expected`` is the batch's row count, which is the example count for lamploop's summed
losses; so the step's gradient is that of (sum of the batch's losses) / (its examples),
as in :func:`lamploop.one_epoch`, and micro-batches change only the rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from lamploop.errors import (
    BatchError,
    ConfigurationError,
    DistributedError,
    LamploopError,
    NonFiniteLossError,
)
from lamploop.loop.batch_checks import where
from lamploop.model import LossFunction
from lamploop.pipeline.spec import PipelineSpec
from lamploop.pipeline.split import stage_examples

__all__ = ["StageRunner", "all_reduce", "peer_failure"]

_Key: TypeAlias = tuple[tuple[int, ...], torch.dtype, bool]
_Schedule: TypeAlias = ScheduleGPipe | Schedule1F1B


def _from_the_transport(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is Gloo's: a peer gone, or a wait past the timeout."""
    seen: BaseException | None = exc
    while seen is not None:
        if "gloo" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def peer_failure(rank: int, what: str, exc: BaseException) -> DistributedError:
    """The error of a stage whose send, receive or sum failed because another stage is gone."""
    msg = (
        f"pipeline stage {rank}: {what}: another stage died, or did not answer within the "
        f"group's timeout: {exc}"
    )
    return DistributedError(msg)


def all_reduce(tensor: torch.Tensor, *, rank: int, what: str, op: Any = dist.ReduceOp.SUM) -> None:
    """Reduce ``tensor`` in place over the pipeline's ranks, bounded by the group's timeout.

    Raises:
        DistributedError: another stage died, or did not take part within the timeout.
    """
    try:
        dist.all_reduce(tensor, op=op)
    except RuntimeError as exc:
        raise peer_failure(rank, what, exc) from exc


class StageRunner:
    """Runs stage ``rank`` of ``stages`` with ``spec``'s schedule; the last stage computes ``loss``.

    Args:
        stages: every stage of the model (this rank runs ``stages[rank]``; the others are
            used on the ``meta`` device only, for shapes).
        rank: this rank, the index of its stage.
        spec: micro-batches and schedule.
        loss: ``(output, target) -> (loss sum, example count)``, on the last stage.
    """

    def __init__(
        self, stages: Sequence[torch.nn.Module], rank: int, spec: PipelineSpec, loss: LossFunction
    ) -> None:
        self.stages = tuple(stages)
        self.rank = rank
        self.spec = spec
        self.module = self.stages[rank]
        self.is_first = rank == 0
        self.is_last = rank == len(self.stages) - 1
        self._loss = loss
        self._schedules: dict[_Key, _Schedule] = {}
        self._expected = 1
        self._sums: list[torch.Tensor] = []
        self._counts: list[int] = []

    def _loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """torch's loss for one micro-batch: its loss sum over the step's expected example count."""
        result = self._loss(output, target)
        if type(result) is not tuple or len(result) != 2:
            name = getattr(self._loss, "__name__", type(self._loss).__name__)
            msg = (
                f"pipeline: the loss {name} returned {type(result).__name__}, not (loss sum, example "
                "count); e.g. lamploop.summed(F.mse_loss)"
            )
            raise ConfigurationError(msg)
        loss_sum, count = result
        self._sums.append(loss_sum.detach())
        self._counts.append(int(count))
        return loss_sum / self._expected if self._expected != 1 else loss_sum

    def _schedule(self, features: torch.Tensor, *, training: bool) -> _Schedule:
        n = self.spec.n_microbatches
        shape = (features.shape[0] // n, *features.shape[1:])
        key = (shape, features.dtype, training)
        schedule = self._schedules.get(key)
        if schedule is None:
            example = torch.empty(shape, dtype=features.dtype, device="meta")
            io = stage_examples(self.stages, example, training=training)[self.rank]
            stage = PipelineStage(
                self.module,
                self.rank,
                len(self.stages),
                torch.device("cpu"),
                input_args=io.inputs,
                output_args=io.outputs,
            )
            # scale_grads=False: the loss is already divided by the step's examples.
            kind = Schedule1F1B if training and self.spec.schedule == "1f1b" else ScheduleGPipe
            schedule = kind(stage, n, loss_fn=self._loss_fn, scale_grads=False)
            self._schedules[key] = schedule
        return schedule

    def _run(
        self, features: torch.Tensor, target: torch.Tensor, epoch: int, index: int, *, training: bool
    ) -> None:
        schedule = self._schedule(features, training=training)
        args: tuple[Any, ...] = (features,) if self.is_first else ()
        last_target = target if self.is_last else None
        try:
            if training:
                schedule.step(*args, target=last_target, return_outputs=False)
            else:
                with torch.no_grad():
                    schedule.eval(*args, target=last_target)
        except LamploopError:
            raise
        except (RuntimeError, ValueError, TypeError, IndexError) as exc:
            place = where(epoch, index, 0)
            if _from_the_transport(exc):
                raise peer_failure(self.rank, place, exc) from exc
            what = type(exc).__name__
            msg = f"pipeline stage {self.rank}: {place}: the stage or its loss failed: {what}: {exc}"
            raise BatchError(msg) from exc

    def _totals(self, what: str) -> tuple[float, int]:
        """The loss sum and example count over every rank (only the last stage holds them)."""
        local = torch.zeros(2, dtype=torch.float64)
        if self._sums:
            local[0] = torch.stack(self._sums).to(torch.float64).sum()
            local[1] = float(sum(self._counts))
        all_reduce(local, rank=self.rank, what=f"the sum of the {what}")
        return float(local[0]), int(local[1])

    def train_step(
        self,
        features: torch.Tensor,
        target: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        epoch: int,
        index: int,
    ) -> tuple[float, int]:
        """One optimizer step on one batch; its loss sum and example count over every rank.

        Raises:
            NonFiniteLossError: the step's loss is NaN or infinite (on every rank, before the step).
            BatchError: the stage or the loss failed on this batch.
            DistributedError: another stage died, or did not answer within the group's timeout.
        """
        self.module.train()
        self._expected = int(target.shape[0])
        self._sums.clear()
        self._counts.clear()
        self._run(features, target, epoch, index, training=True)
        loss_sum, count = self._totals(f"loss of epoch {epoch}, batch {index}")
        if not math.isfinite(loss_sum):
            msg = f"pipeline: {where(epoch, index, 0)}: the loss is {loss_sum} (step {index} not taken)"
            raise NonFiniteLossError(msg, epoch=epoch, batch=index, step=index)
        if count == 0:
            msg = f"pipeline: {where(epoch, index, 0)}: the loss counted 0 examples"
            raise BatchError(msg)
        if count != self._expected:  # a loss that counts otherwise than rows: fix the guess up
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(self._expected / count)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum, count

    def forward_batch(self, features: torch.Tensor, target: torch.Tensor, epoch: int, index: int) -> None:
        """Validation: one batch forward, its loss kept on the last stage until :meth:`forward_totals`."""
        self.module.eval()
        self._run(features, target, epoch, index, training=False)

    def begin_forward_pass(self) -> None:
        """Forget the loss sums of an earlier pass."""
        self._expected = 1
        self._sums.clear()
        self._counts.clear()

    def forward_totals(self, epoch: int) -> tuple[float, int]:
        """The validation pass's loss sum and example count over every rank."""
        return self._totals(f"validation loss of epoch {epoch}")
