"""``SupervisedModel``: a module and a loss that yields (loss sum, example count).

Losses are sums, not means, so that batches of different sizes, accumulated
batches and ranks combine exactly: the mean over a step is the sum of every
loss divided by the number of examples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import attrs
import torch
import torch.nn.functional as F

__all__ = ["LossFunction", "SupervisedModel", "cross_entropy_loss", "mse_loss", "summed"]


class LossFunction(Protocol):
    """``(output, target) -> (sum of per-example losses, number of examples)``."""

    def __call__(self, output: Any, target: torch.Tensor, /) -> tuple[torch.Tensor, int]: ...


@attrs.frozen
class _Summed:
    loss: Callable[..., torch.Tensor]

    def __call__(self, output: Any, target: torch.Tensor, /) -> tuple[torch.Tensor, int]:
        return self.loss(output, target, reduction="sum"), int(target.shape[0])


def summed(loss: Callable[..., torch.Tensor]) -> LossFunction:
    """Make a :class:`LossFunction` from a PyTorch loss that takes ``reduction="sum"``.

    The example count is the target's first dimension.

    >>> import torch, torch.nn.functional as F
    >>> loss_sum, n = summed(F.l1_loss)(torch.zeros(3), torch.ones(3))
    >>> float(loss_sum), n
    (3.0, 3)
    """
    return _Summed(loss)


cross_entropy_loss: LossFunction = summed(F.cross_entropy)
"""Summed cross entropy over class logits; one example per target row."""

mse_loss: LossFunction = summed(F.mse_loss)
"""Summed squared error; an example's loss is the sum over its output elements."""


@attrs.frozen
class SupervisedModel:
    """A module trained to map features to targets.

    Attributes:
        module: the ``torch.nn.Module``; ``module(features)`` gives the output.
        loss: maps ``(output, target)`` to ``(loss sum, example count)``.
    """

    module: torch.nn.Module
    loss: LossFunction = cross_entropy_loss

    def loss_sum_and_count(self, features: Any, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Run the module and the loss on one batch."""
        return self.loss(self.module(features), target)
