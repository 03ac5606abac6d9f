"""Step boundaries: where a training pass may be checkpointed or stopped, and resumed.

A pass reaches a boundary after every optimizer step.  At each one every rank says
whether it asks for a checkpoint or a stop (:meth:`StepBoundary.requests`); the requests
travel with the step's example count, which the ranks sum anyway, so all ranks agree on
the same boundary without an extra synchronisation.  At an agreed boundary every rank
calls :meth:`StepBoundary.reached` with its :class:`StepProgress`; after a stop the pass
raises :class:`EpochStopped`.

A pass resumed at a boundary starts from an :class:`EpochStart`: it skips the batches of
the steps already done (the batch order is a pure function of seed, epoch and rank) and
carries on with the running loss sum and example count, so the epoch ends exactly as
the uninterrupted one would have.
"""

from __future__ import annotations

from typing import Protocol

import attrs

__all__ = ["EpochPosition", "EpochStart", "EpochStopped", "StepBoundary", "StepProgress"]


@attrs.frozen
class EpochStart:
    """Where a training pass starts on this rank (all zero: the beginning of the epoch).

    Attributes:
        steps_done: optimizer steps already done in this epoch.
        loss_sum: this rank's running sum of training losses so far (float64).
        example_count: this rank's examples so far.
        last_step_examples: the global example count of the last step done.
        metric_sums: this rank's metric ``[sum, count]`` pairs so far, flattened (see
            :class:`~lamploop.loop.metric_sums.MetricSums`); empty without metrics.
    """

    steps_done: int = 0
    loss_sum: float = 0.0
    example_count: int = 0
    last_step_examples: int = 0
    metric_sums: tuple[float, ...] = ()


StepProgress = EpochStart
"""What a rank has done at a boundary: the same numbers a resumed pass starts from."""


@attrs.frozen
class EpochPosition:
    """Where every rank stood at a step boundary of epoch ``epoch``: enough to resume there.

    Attributes:
        epoch: the epoch in progress.
        lr_factor: the learning-rate factor it runs with.
        steps_done: optimizer steps done in it (the same on every rank).
        last_step_examples: the global example count of the last step done.
        loss_sums: per rank, the running sum of the epoch's training losses so far.
        example_counts: per rank, the examples trained on so far in the epoch.
        metric_sums: per rank, its metric sums so far (empty without metrics).
    """

    epoch: int
    lr_factor: float
    steps_done: int
    last_step_examples: int
    loss_sums: tuple[float, ...]
    example_counts: tuple[int, ...]
    metric_sums: tuple[tuple[float, ...], ...] = ()

    def start_of(self, rank: int) -> EpochStart:
        """Where rank ``rank``'s resumed pass starts."""
        return EpochStart(
            steps_done=self.steps_done,
            loss_sum=self.loss_sums[rank],
            example_count=self.example_counts[rank],
            last_step_examples=self.last_step_examples,
            metric_sums=self.metric_sums[rank] if self.metric_sums else (),
        )


class StepBoundary(Protocol):
    """Decides, and acts, at the step boundaries of a training pass (runs on the training thread)."""

    def requests(self, steps_done: int) -> tuple[bool, bool]:
        """``(checkpoint, stop)``: what this rank asks for at the boundary after step ``steps_done + 1``."""
        ...

    async def reached(self, progress: StepProgress, *, stop: bool) -> None:
        """Every rank, at a boundary the ranks agreed on (it may run collectives)."""
        ...


class EpochStopped(Exception):
    """A training pass stopped at a boundary on request; ``progress`` says where."""

    def __init__(self, progress: StepProgress) -> None:
        super().__init__(f"stopped after step {progress.steps_done}")
        self.progress = progress
