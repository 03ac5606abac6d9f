"""One rank's share of a training run: the epoch function root and followers share.

The root and every follower hold a :class:`Replica` and call the same
``train``/``validate`` methods; they differ only in who decides what to run
next (the root's epoch loop, or the commands a follower receives).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from lamploop.batches import BatchContext, BatchStreamFactory
from lamploop.epoch import one_epoch
from lamploop.model import SupervisedModel
from lamploop.tensors import TensorChannel

__all__ = ["Replica", "learning_rates", "set_learning_rate_factor"]


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
        accumulate_gradient_over_n_batches: batches per optimizer step.
        device: where batches are moved before the forward pass.
        optimizer: this rank's optimizer, or ``None`` when another rank steps.
        base_lrs: each param group's learning rate before any schedule factor,
            read from the fresh optimizer (a loaded state dict holds the rates of
            its last epoch, factor included).
    """

    model: SupervisedModel
    channel: TensorChannel
    train_batches: BatchStreamFactory
    validation_batches: BatchStreamFactory | None
    accumulate_gradient_over_n_batches: int
    device: torch.device
    optimizer: torch.optim.Optimizer | None
    base_lrs: tuple[float, ...] = ()

    def _context(self, epoch: int) -> BatchContext:
        return BatchContext(epoch=epoch, rank=self.channel.rank, nranks=self.channel.nranks)

    async def train(self, epoch: int, lr_factor: float) -> float:
        """Train one epoch with the learning rates scaled by ``lr_factor``; the global mean loss."""
        step: Callable[[], object] = _no_step
        if self.optimizer is not None:
            set_learning_rate_factor(self.optimizer, self.base_lrs, lr_factor)
            step = self.optimizer.step
        return await one_epoch(
            model=self.model,
            batches=self.train_batches(self._context(epoch)),
            channel=self.channel,
            step_optimizer=step,
            accumulate_gradient_over_n_batches=self.accumulate_gradient_over_n_batches,
            device=self.device,
            epoch=epoch,
        )

    async def validate(self, epoch: int) -> float:
        """One forward-only pass over the validation stream; the global mean loss."""
        if self.validation_batches is None:
            msg = "validate() called on a replica without validation batches"
            raise RuntimeError(msg)
        return await one_epoch(
            model=self.model,
            batches=self.validation_batches(self._context(epoch)),
            channel=self.channel,
            forward_only=True,
            device=self.device,
            epoch=epoch,
        )
