"""``SupervisedModel``: a module and a loss that yields (loss sum, example count).

Losses are sums, not means, so that batches of different sizes, accumulated
batches and ranks combine exactly: the mean over a step is the sum of every
loss divided by the number of examples.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
import torch
import torch.nn.functional as F

from lamploop.errors import ConfigurationError
from lamploop.metrics import Metric

__all__ = ["LossFunction", "SupervisedModel", "cross_entropy_loss", "mse_loss", "summed", "unwrapped"]


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
        metrics: named :class:`~lamploop.metrics.Metric` s, computed on the same output in
            training and validation passes (e.g. ``{"accuracy": lamploop.metrics.accuracy}``).
    """

    module: torch.nn.Module
    loss: LossFunction = cross_entropy_loss
    metrics: Mapping[str, Metric] = attrs.field(factory=dict, converter=dict, hash=False)

    def loss_sum_and_count(self, features: Any, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Run the module and the loss on one batch.

        Raises:
            ConfigurationError: the loss did not return ``(loss sum, example count)``.
        """
        return self._loss_of(self.module(features), target)

    def loss_and_metrics(
        self, features: Any, target: torch.Tensor
    ) -> tuple[torch.Tensor, int, list[tuple[torch.Tensor, int]]]:
        """:meth:`loss_sum_and_count`, and every metric's ``(sum, count)`` on the same output."""
        output = self.module(features)
        loss_sum, count = self._loss_of(output, target)
        with torch.no_grad():
            values = [metric(output, target) for metric in self.metrics.values()]
        return loss_sum, count, values

    def _loss_of(self, output: Any, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        result = self.loss(output, target)
        if type(result) is not tuple or len(result) != 2:
            raise _not_a_sum_and_count(self.loss, result)
        return result


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile`` wrapper holds, else ``module`` itself.

    Its ``state_dict()`` has the plain keys (``fc.weight``, not ``_orig_mod.fc.weight``), so
    checkpoints of a compiled model load into the uncompiled one and back; the parameters are
    the same objects.
    """
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else module


def _not_a_sum_and_count(loss: object, result: object) -> ConfigurationError:
    got = type(result).__name__
    if isinstance(result, torch.Tensor):
        got = f"a tensor of shape {tuple(result.shape)}"
    name = getattr(loss, "__name__", type(loss).__name__)
    return ConfigurationError(
        f"SupervisedModel: the loss {name} returned {got}, not (loss sum, example count); "
        "sum over the examples instead of averaging, e.g. lamploop.summed(F.mse_loss), which "
        "passes reduction='sum' and counts the target's rows"
    )
