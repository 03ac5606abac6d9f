"""The tensor channel: how ranks combine gradients and statistics.

:func:`lamploop.one_epoch` talks to ranks only through a :class:`TensorChannel`,
so the same epoch code serves one process (:class:`SingleProcessChannel`) and
many (a channel over a ``torch.distributed`` process group).

Gradient contract.  During a step each rank backpropagates ``loss_sum / expected``
for each of its batches (``expected`` chosen by the epoch code), so its
``.grad`` holds ``sum of its losses' gradients / expected``.  ``finish(scale)``
must leave in every rank's ``.grad`` (or, for root-steps strategies, in the
root's) the sum over ranks multiplied by ``scale``, which the epoch code sets to
``expected / global example count``: the gradient of the mean loss of the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["GradientSync", "PendingSum", "SingleProcessChannel", "TensorChannel"]


class PendingSum(Protocol):
    """A sum over ranks in flight."""

    def wait(self) -> list[float]:
        """Block until the sum is known and return it."""
        ...


class _KnownSum:
    def __init__(self, values: Sequence[float]) -> None:
        self._values = [float(v) for v in values]

    def wait(self) -> list[float]:
        return self._values


class GradientSync(Protocol):
    """Gradient reduction for one model's parameters, reused step after step."""

    def arm(self) -> None:
        """The next backward is the last of this step: reduce buckets as they fill."""
        ...

    def finish(self, scale: float) -> None:
        """Complete the reduction and multiply the reduced gradients by ``scale``."""
        ...

    def zero_grad(self) -> None:
        """Clear the gradients (called before the first step of every training pass)."""
        ...

    def after_step(self) -> None:
        """After the optimizer step: clear gradients and share parameters if needed."""
        ...

    def flush(self) -> None:
        """Wait until nothing is in flight (called at the end of every training pass)."""
        ...


class TensorChannel(Protocol):
    """What one epoch needs from the ranks that train together."""

    @property
    def rank(self) -> int: ...

    @property
    def nranks(self) -> int: ...

    def gradient_sync(self, parameters: Sequence[torch.nn.Parameter]) -> GradientSync:
        """The gradient reduction for these parameters (the same object for the same list)."""
        ...

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """Sum small float vectors over all ranks (float64, blocking)."""
        ...

    def begin_all_reduce_sum(self, values: Sequence[float]) -> PendingSum:
        """Start summing ``values`` over all ranks; ``.wait()`` gives the sums."""
        ...


class _LocalGradients:
    """One rank: gradients are already complete; only the scale is applied."""

    def __init__(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        self._parameters = [p for p in parameters if p.requires_grad]

    def arm(self) -> None:
        pass

    def finish(self, scale: float) -> None:
        if scale != 1.0:
            grads = [p.grad for p in self._parameters if p.grad is not None]
            torch._foreach_mul_(grads, scale)

    def zero_grad(self) -> None:
        for p in self._parameters:
            p.grad = None

    def after_step(self) -> None:
        self.zero_grad()

    def flush(self) -> None:
        pass


class SingleProcessChannel:
    """The trivial channel of a run with one rank."""

    rank = 0
    nranks = 1

    def gradient_sync(self, parameters: Sequence[torch.nn.Parameter]) -> GradientSync:
        """Gradients need no reduction; ``finish`` only rescales them."""
        return _LocalGradients(parameters)

    def all_reduce_sum(self, values: Sequence[float]) -> list[float]:
        """The sum over one rank is the values themselves."""
        return [float(v) for v in values]

    def begin_all_reduce_sum(self, values: Sequence[float]) -> PendingSum:
        """Already known: the values themselves."""
        return _KnownSum(values)
