"""The range test's bookkeeping: the rate of each step, the losses recorded, when the test is done.

:func:`learning_rates` is the exponential schedule from ``min_lr`` to ``max_lr``;
:class:`StepRecorder` records each optimizer step's mean loss and its bias-corrected
exponential smoothing, and says when the test is done (every step taken, or the loss
diverged); :func:`batches_until_done` feeds the training pass only while the test goes on.

.. versionadded:: 0.3
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import attrs
import torch

from lamploop.batches import Batch, BatchStream

__all__ = ["StepRecorder", "batches_until_done", "learning_rates"]


@attrs.define
class StepRecorder:
    """The steps' learning rates and losses so far; says when the test is done."""

    schedule: list[float]
    smoothing: float
    threshold: float | None
    raw: list[float] = attrs.Factory(list)
    smoothed: list[float] = attrs.Factory(list)
    average: float = 0.0
    best: float = math.inf
    diverged: bool = False

    @property
    def done(self) -> bool:
        """Whether every step was taken, or the loss diverged."""
        return self.diverged or len(self.raw) >= len(self.schedule)

    @property
    def rate(self) -> float:
        """The learning rate of the step about to be taken."""
        return self.schedule[min(len(self.raw), len(self.schedule) - 1)]

    def record(self, count: int, loss_sum: float | torch.Tensor) -> None:
        """Record a step's loss (``loss_sum`` over ``count`` examples): the training pass's ``after_step``."""
        if self.done:  # a step begun before the test ended (its first batch was read ahead)
            return
        loss = float(loss_sum) / count if count else math.nan
        if not math.isfinite(loss):
            self.diverged = True
            return
        self.average = self.smoothing * self.average + (1 - self.smoothing) * loss
        smoothed = self.average / (1 - self.smoothing ** (len(self.raw) + 1))
        self.raw.append(loss)
        self.smoothed.append(smoothed)
        if self.threshold is not None and len(self.raw) > 1 and smoothed > self.threshold * self.best:
            self.diverged = True
        self.best = min(self.best, smoothed)


async def batches_until_done(
    stream: BatchStream, recorder: StepRecorder, budget: list[int]
) -> AsyncIterator[Batch]:
    """``stream``'s batches while the test goes on, ``budget[0]`` of them at most (counted down)."""
    iterator = aiter(stream)
    try:
        while budget[0] > 0 and not recorder.done:
            item = await anext(iterator, None)
            if item is None:
                return
            budget[0] -= 1
            yield item
    finally:
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()


def learning_rates(min_lr: float, max_lr: float, num_steps: int) -> list[float]:
    ratio = max_lr / min_lr
    return [min_lr * ratio ** (i / (num_steps - 1)) for i in range(num_steps)]
