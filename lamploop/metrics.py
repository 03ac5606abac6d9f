"""Metrics beside the loss: each a sum and a count per batch, reduced over the ranks like the loss.

A metric is ``(output, target) -> (sum over the batch's examples, number of examples)``,
run under ``torch.no_grad()`` on the output the loss saw.  A pass keeps the per-batch sums
as tensors (no wait for the device per batch) and adds them up at its end, where they travel
in the same all-reduce as the loss sum: a metric over ranks is the metric of the union, and
costs no extra synchronisation.  The pass's result is still its mean loss, a ``float``
(:class:`PassResult`), with the metrics' means in ``.metrics``.

>>> import torch
>>> correct, n = accuracy(torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), torch.tensor([1, 1, 1]))
>>> int(correct), n
(2, 3)
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from lamploop.errors import ConfigurationError

__all__ = ["Metric", "PassResult", "accuracy", "metrics_of"]


class Metric(Protocol):
    """``(output, target) -> (sum of per-example values, number of examples)``."""

    def __call__(self, output: Any, target: torch.Tensor, /) -> tuple[torch.Tensor, int]: ...


def accuracy(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Top-1 accuracy: how many of the target's entries have the largest score at their class.

    ``output`` is ``(batch, classes, ...)`` scores and ``target`` ``(batch, ...)`` class indices,
    as for ``torch.nn.functional.cross_entropy``: with more dimensions (a class per position,
    e.g. per token or pixel) every position counts as an example, so the result is
    ``(positions right, positions)`` and its mean the share of positions right.

    Raises:
        ConfigurationError: the output is not ``(batch, classes, ...)`` scores for the target's
            shape.
    """
    expected = (*output.shape[:1], *output.shape[2:])
    if output.dim() < 2 or tuple(target.shape) != expected:
        msg = (
            f"accuracy: the output of shape {tuple(output.shape)} is not (batch, classes, ...) scores "
            f"for the target of shape {tuple(target.shape)} (the target must be the output's shape "
            f"without its class dimension, {expected})"
        )
        raise ConfigurationError(msg)
    return (output.argmax(dim=1) == target).sum(), int(target.numel())


class PassResult(float):
    """A pass's mean loss (a ``float``, as :func:`lamploop.one_epoch` has always returned),
    with the means of the model's metrics over every example of every rank in ``metrics``."""

    metrics: Mapping[str, float]

    def __new__(cls, loss: float, metrics: Mapping[str, float]) -> PassResult:
        if isinstance(loss, bool) or not isinstance(loss, (numbers.Real, torch.Tensor)):
            msg = f"PassResult: loss must be a float, got {type(loss).__name__} {loss!r}"
            raise ConfigurationError(msg)
        if not isinstance(metrics, Mapping):
            kind = type(metrics).__name__
            msg = f"PassResult: metrics must be a mapping of metric names to floats, got {kind}"
            raise ConfigurationError(msg)
        result = super().__new__(cls, loss)
        result.metrics = dict(metrics)
        return result


def metrics_of(result: float) -> dict[str, float]:
    """The metrics a pass's result carries (none for a plain ``float``)."""
    return dict(getattr(result, "metrics", {}))
