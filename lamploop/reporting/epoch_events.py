"""``EpochEvents``: what the root's epoch loop reports, and the bookkeeping that takes.

The driver (:mod:`lamploop.distributed.drive`) tells it when an epoch starts, validates and
ends; it times them, feeds the :class:`~lamploop.reporting.sampler.ProgressSampler` that the
training pass calls after every step, keeps the :class:`~lamploop.loop.step_timing.StepTimes`
the pass adds each step's breakdown to, and makes the events.  Without reporters it does
nothing, and the training pass gets no per-step call and reads no clock at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lamploop.loop.step_timing import StepBreakdown, StepTimes
from lamploop.metrics import metrics_of
from lamploop.reporting.emitter import EventEmitter
from lamploop.reporting.events import EpochFinished, EpochStarted, ValidationFinished
from lamploop.reporting.sampler import ProgressSampler
from lamploop.state import LoopState

__all__ = ["EpochEvents"]


class EpochEvents:
    """Reports a run's epochs through ``emit``; ``wait_seconds`` is the root's time blocked on collectives."""

    def __init__(self, emit: EventEmitter, wait_seconds: Callable[[], float]) -> None:
        self._emit = emit
        self._sampler = ProgressSampler(emit, wait_seconds=wait_seconds) if emit else None
        self._began = time.monotonic()
        self._validation_began = self._began
        self._last_steps: int | None = None  # the last epoch's steps: the next one's expected length
        self._step_times = StepTimes() if emit else None
        self._epoch_steps_from = StepBreakdown()  # the sums when the epoch in progress started

    @property
    def after_step(self) -> Callable[[int, float | torch.Tensor], None] | None:
        """What the training pass calls after every step (``None`` without reporters)."""
        return self._sampler.after_step if self._sampler is not None else None

    @property
    def step_times(self) -> StepTimes | None:
        """What the root's training passes add each step's breakdown to (``None`` without reporters)."""
        return self._step_times

    def epoch_started(
        self, epoch: int, lr_factor: float, steps_done: int = 0, examples_done: int = 0
    ) -> None:
        """Epoch ``epoch`` starts training (or resumes after ``steps_done`` steps and
        ``examples_done`` examples)."""
        self._began = time.monotonic()
        if self._sampler is None:
            return
        if self._step_times is not None:
            self._epoch_steps_from = self._step_times.snapshot()
        self._sampler.start_epoch(epoch, steps_done, examples_done)
        self._emit(EpochStarted(epoch, lr_factor, steps_done, self._last_steps, examples_done))

    def validation_started(self) -> None:
        """The epoch's validation starts (its time is in ``ValidationFinished.seconds``)."""
        self._validation_began = time.monotonic()

    def validated(self, epoch: int, loss: float) -> None:
        """Epoch ``epoch`` validated with this mean loss (a ``PassResult`` carries its metrics)."""
        if self._emit:
            seconds = time.monotonic() - self._validation_began
            self._emit(ValidationFinished(epoch, float(loss), metrics_of(loss), seconds))

    def epoch_finished(self, state: LoopState) -> None:
        """An epoch ended; ``state`` is the loop state after it."""
        if self._sampler is None:
            return
        steps, examples = self._sampler.steps_done, self._sampler.examples
        self._last_steps = steps
        seconds = time.monotonic() - self._began
        breakdown = None
        if self._step_times is not None:
            breakdown = self._step_times.snapshot().since(self._epoch_steps_from)
            if breakdown.steps == 0:  # the driver gave the pass no StepTimes: nothing measured
                breakdown = None
        self._emit(
            EpochFinished(state, seconds=seconds, steps=steps, examples=examples, step_breakdown=breakdown)
        )
