"""``ProgressSampler``: per-step calls in, a :class:`ProgressSampled` event now and then out.

The training pass calls :meth:`ProgressSampler.after_step` after every optimizer step with
the step's example count and loss sum (every rank's).  That call only adds numbers and
reads a monotonic clock; every ``interval`` seconds (and after an epoch's first step, so a
progress bar moves at once) it makes one event.  A loss still on a device is read only
then: one wait for the device per sample, never one per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from lamploop.reporting.events import Event, ProgressSampled

__all__ = ["DEFAULT_PROGRESS_INTERVAL_S", "ProgressSampler"]

DEFAULT_PROGRESS_INTERVAL_S = 0.5


def _no_waits() -> float:
    return 0.0


class ProgressSampler:
    """Samples a training pass's progress for the reporters.

    Args:
        emit: hands an event to the reporters (from the thread the pass runs on).
        interval: seconds between samples (default: :data:`DEFAULT_PROGRESS_INTERVAL_S`).
        wait_seconds: the root's running total of seconds blocked on collectives.
    """

    def __init__(
        self,
        emit: Callable[[Event], None],
        *,
        interval: float | None = None,
        wait_seconds: Callable[[], float] = _no_waits,
    ) -> None:
        self._emit = emit
        self._interval = interval if interval is not None else DEFAULT_PROGRESS_INTERVAL_S
        self._wait_seconds = wait_seconds
        self.epoch = 0
        self.steps_done = 0  # in the epoch in progress
        self.examples = 0  # in the epoch in progress, every rank
        self.total_steps = 0
        self.total_examples = 0
        self._reset_window(time.monotonic())
        self._due = 0.0

    def _reset_window(self, now: float) -> None:
        self._window_start = now
        self._window_waits = self._wait_seconds()
        self._window_steps = 0
        self._window_examples = 0
        self._window_loss = 0.0
        self._window_device_losses: list[torch.Tensor] = []

    def start_epoch(self, epoch: int, steps_done: int = 0, examples_done: int = 0) -> None:
        """Epoch ``epoch`` starts (or resumes after ``steps_done`` steps and ``examples_done``
        examples of every rank): the next step is sampled."""
        self.epoch, self.steps_done, self.examples = epoch, steps_done, examples_done
        now = time.monotonic()
        self._reset_window(now)
        self._due = now  # the first step makes a sample: the bar moves at once

    def after_step(self, examples: int, loss_sum: float | torch.Tensor) -> None:
        """One optimizer step of ``examples`` examples (every rank) with this loss sum is done."""
        self.steps_done += 1
        self.examples += examples
        self.total_steps += 1
        self.total_examples += examples
        self._window_steps += 1
        self._window_examples += examples
        if isinstance(loss_sum, torch.Tensor):
            self._window_device_losses.append(loss_sum.detach())
        else:
            self._window_loss += loss_sum
        now = time.monotonic()
        if now >= self._due:
            self._sample(now)

    def _sample(self, now: float) -> None:
        seconds = max(now - self._window_start, 1e-9)
        steps = self._window_steps
        loss_sum = self._window_loss
        if self._window_device_losses:  # the one wait for the device of this sample
            loss_sum += float(torch.stack(self._window_device_losses).sum())
        waits = self._wait_seconds() - self._window_waits
        event = ProgressSampled(
            epoch=self.epoch,
            steps_done=self.steps_done,
            examples=self.examples,
            loss=loss_sum / self._window_examples if self._window_examples else None,
            steps=steps,
            seconds_per_step=seconds / steps if steps else 0.0,
            communication_seconds_per_step=waits / steps if steps else 0.0,
            examples_per_second=self._window_examples / seconds,
            total_steps=self.total_steps,
            total_examples=self.total_examples,
        )
        self._reset_window(now)
        self._due = now + self._interval
        self._emit(event)
