"""The learning-rate range test's two rules for suggesting a rate from the losses it recorded.

:func:`min_loss_suggestion` is the default (fastai's original rule: the rate at the lowest
loss, divided by 10); :func:`steepest_descent` is Lightning's, there to compare.  Why the
first is the default is in :mod:`lamploop.lr_find`.  Both are pure functions of the rates and
the losses.

.. versionadded:: 0.3
"""

from __future__ import annotations

import math
from typing import Final

__all__ = ["SKIP_BEGIN", "SKIP_END", "min_loss_suggestion", "steepest_descent"]

SKIP_BEGIN: Final = 10
"""Steps left out at the start when suggesting (the smoothed loss is still settling there)."""

SKIP_END: Final = 1
"""Steps left out at the end when suggesting (the step that diverged)."""


def min_loss_suggestion(
    lrs: tuple[float, ...] | list[float], losses: tuple[float, ...] | list[float], *, divisor: float = 10.0
) -> float | None:
    """The learning rate of ``lrs`` at the lowest finite loss of ``losses``, divided by ``divisor``.

    ``None`` when fewer than 2 finite losses were recorded.

    >>> min_loss_suggestion([0.01, 0.1, 1.0, 10.0], [2.0, 1.9, 1.0, 3.5])
    0.1
    """
    finite = [(loss, i) for i, loss in enumerate(losses) if math.isfinite(loss)]
    if len(finite) < 2:
        return None
    return lrs[min(finite)[1]] / divisor


def steepest_descent(
    lrs: tuple[float, ...] | list[float],
    losses: tuple[float, ...] | list[float],
    *,
    skip_begin: int = SKIP_BEGIN,
    skip_end: int = SKIP_END,
) -> float | None:
    """The learning rate of ``lrs`` where ``losses`` fall fastest against ``log(lr)`` (Lightning's rule).

    The first ``skip_begin`` and last ``skip_end`` points are left out; the slope at each
    point is a central difference (one-sided at the ends), as ``numpy.gradient``'s.  ``None``
    when fewer than 2 finite points are left.

    >>> steepest_descent([0.01, 0.1, 1.0, 10.0], [2.0, 1.9, 1.0, 0.95], skip_begin=0, skip_end=0)
    0.1
    """
    points = [
        (math.log(lrs[i]), losses[i], i)
        for i in range(skip_begin, len(lrs) - skip_end)
        if math.isfinite(losses[i])
    ]
    if len(points) < 2:
        return None
    steepest, at = math.inf, points[0][2]
    for j, (_, _, index) in enumerate(points):
        before, after = points[max(j - 1, 0)], points[min(j + 1, len(points) - 1)]
        slope = (after[1] - before[1]) / (after[0] - before[0])
        if slope < steepest:
            steepest, at = slope, index
    return lrs[at]
