"""``GlobalStep``: the x axis that per-step and per-epoch values share, worked out from the events.

The global step is the count of optimizer steps this process trained so far, over every
epoch: ``ProgressSampled.total_steps`` while an epoch trains, and at ``EpochFinished`` that
count plus the epoch's last steps, which no sample saw.  A resumed process counts from 0
again (the events do not carry the steps of earlier processes).

>>> from lamploop.reporting import EpochFinished, EpochStarted, ProgressSampled
>>> from lamploop.reporting.global_step import GlobalStep
>>> from lamploop.state import LearningCurveEntry, LoopState
>>> steps = GlobalStep()
>>> steps.see(EpochStarted(epoch=0, learning_rate_factor=1.0))
0
>>> steps.see(ProgressSampled(0, 30, 960, 0.5, 30, 0.1, 0.0, 320.0, total_steps=30, total_examples=960))
30
>>> steps.see(EpochFinished(LoopState(epoch=1, learning_curve=[LearningCurveEntry(0, 0.5)]), steps=40))
40
"""

from __future__ import annotations

from lamploop.reporting.events import CheckpointWritten, EpochFinished, EpochStarted, Event, ProgressSampled

__all__ = ["GlobalStep"]


class GlobalStep:
    """Follows a run's events and says at which global step each one happened.

    :meth:`see` takes every event in order and returns its global step: a sample's
    ``total_steps``; an epoch's end: the step its last step brought the count to; a
    checkpoint inside an epoch: the step of its step boundary; other events (a checkpoint
    at an epoch's start included): the latest step.
    """

    def __init__(self) -> None:
        self.step = 0
        self._epoch: int | None = None  # the epoch whose first step is _base + 1
        self._base = 0

    def see(self, event: Event) -> int:
        """The global step of ``event`` (see the class docstring)."""
        if isinstance(event, ProgressSampled):
            self.step = max(self.step, event.total_steps)
            self._epoch, self._base = event.epoch, event.total_steps - event.steps_done
        elif isinstance(event, EpochStarted):
            # A resumed epoch's steps_done were trained by an earlier process.
            self._epoch, self._base = event.epoch, self.step - event.steps_done
        elif isinstance(event, EpochFinished):
            epoch = event.state.learning_curve[-1].epoch
            base = self._base if epoch == self._epoch else self.step
            self.step = max(self.step, base + event.steps)
            self._epoch = None
        elif isinstance(event, CheckpointWritten) and event.steps_done > 0 and event.epoch == self._epoch:
            return self._base + event.steps_done
        return self.step
