"""Where a training step's time goes: the cheap, always-on breakdown of every step.

A training pass given a :class:`StepTimes` (the root's, whenever someone listens to the run's
events) splits the wall-clock time of every optimizer step into five parts:

``data_wait``
    awaiting the next batch from the stream (a stream that cannot keep up shows here);
``forward_backward``
    the forward and backward passes of the step's batches, moving them to the device included;
``communication_wait``
    blocked in a collective: the gradient sync that backward did not hide, and the step's
    sum of example counts (:attr:`lamploop.sync.collectives.Collectives.wait_seconds`; zero on
    one rank);
``optimizer``
    the step on the complete gradients: the sync's scaling, unscaling and clipping, the
    learning-rate hooks, ``optimizer.step()`` and what the sync does after it;
``checkpoint``
    a step-boundary checkpoint or stop (:mod:`lamploop.loop.boundary`).

What is left of a step's wall time (the reporters' per-step call, turns given to the event
loop) is :attr:`StepBreakdown.other`, so the five parts never add up to more than the step.

The clock is :func:`time.perf_counter`, read about eight times per step; nothing waits for a
device.  On a GPU the numbers are therefore host-side times: ``forward_backward`` is the time
taken to launch the kernels, and the device's own time shows up where the host first waits
for it (usually ``communication_wait`` with NCCL, or ``optimizer``/``other`` where a value
is read).  On a CPU they are the compute itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs

from lamploop.sync.channel import TensorChannel
from lamploop.sync.group_channel import ProcessGroupChannel

__all__ = ["PARTS", "StepBreakdown", "StepTimes", "communication_clock"]

PARTS = ("data_wait", "forward_backward", "communication_wait", "optimizer", "checkpoint")
"""The five parts of a step, in the order they are shown."""

_clock = time.perf_counter


@attrs.frozen
class StepBreakdown:
    """Seconds spent in each part of ``steps`` optimizer steps (summed, not averaged).

    Attributes:
        steps: how many steps these seconds are the sum of.
        seconds: their wall-clock time, from each step's start to the next one's.
        data_wait, forward_backward, communication_wait, optimizer, checkpoint: the parts
            (see :mod:`lamploop.loop.step_timing`); each >= 0, together <= ``seconds``.
    """

    steps: int = 0
    seconds: float = 0.0
    data_wait: float = 0.0
    forward_backward: float = 0.0
    communication_wait: float = 0.0
    optimizer: float = 0.0
    checkpoint: float = 0.0

    @property
    def other(self) -> float:
        """What the five parts leave of the steps' wall time (reporters, event-loop turns)."""
        return max(0.0, self.seconds - sum(self.parts().values()))

    def parts(self) -> dict[str, float]:
        """The five parts by name, in :data:`PARTS` order."""
        return {name: getattr(self, name) for name in PARTS}

    def since(self, earlier: StepBreakdown) -> StepBreakdown:
        """The steps taken after ``earlier`` (a snapshot of the same :class:`StepTimes`)."""
        return StepBreakdown(
            steps=self.steps - earlier.steps,
            seconds=self.seconds - earlier.seconds,
            **{name: value - getattr(earlier, name) for name, value in self.parts().items()},
        )


def communication_clock(channel: TensorChannel) -> Callable[[], float] | None:
    """The running total of seconds ``channel`` has blocked in collectives (``None``: it never blocks)."""
    if isinstance(channel, ProcessGroupChannel):
        collectives = channel.collectives
        return lambda: collectives.wait_seconds
    return None


class StepTimes:
    """The running sums of a training pass's step breakdown; :meth:`snapshot` reads them.

    The training pass calls the marks in this order for each step: :meth:`begin` (once per
    pass), then :meth:`waited_for_data` around each batch it awaits, :meth:`backward_done`,
    :meth:`optimizer_done`, :meth:`checkpointed` (at a boundary), and :meth:`step_done`.
    Every mark is one clock read and a few additions, on the thread that trains.
    """

    __slots__ = (
        "_backward_at",
        "_backward_waits",
        "_comm",
        "_optimizer_at",
        "_optimizer_waits",
        "_start",
        "_start_waits",
        "_step_checkpoint",
        "_step_data",
        "checkpoint",
        "communication_wait",
        "data_wait",
        "forward_backward",
        "optimizer",
        "seconds",
        "steps",
    )

    def __init__(self) -> None:
        self.steps = 0
        self.seconds = 0.0
        self.data_wait = 0.0
        self.forward_backward = 0.0
        self.communication_wait = 0.0
        self.optimizer = 0.0
        self.checkpoint = 0.0
        self._comm: Callable[[], float] | None = None
        self._start = self._backward_at = self._optimizer_at = 0.0
        self._start_waits = self._backward_waits = self._optimizer_waits = 0.0
        self._step_data = 0.0
        self._step_checkpoint = 0.0

    def snapshot(self) -> StepBreakdown:
        """The sums so far."""
        return StepBreakdown(
            steps=self.steps,
            seconds=self.seconds,
            data_wait=self.data_wait,
            forward_backward=self.forward_backward,
            communication_wait=self.communication_wait,
            optimizer=self.optimizer,
            checkpoint=self.checkpoint,
        )

    def begin(self, communication: Callable[[], float] | None) -> None:
        """A pass starts its first step now; ``communication`` reads its collectives' wait total."""
        self._comm = communication
        self._start = _clock()
        self._start_waits = communication() if communication is not None else 0.0
        self._step_data = 0.0
        self._step_checkpoint = 0.0

    def waited_for_data(self, since: float) -> None:
        """The pass awaited a batch from clock reading ``since`` until now."""
        self._step_data += _clock() - since

    def backward_done(self) -> None:
        """The step's last backward has returned."""
        self._backward_at = _clock()
        self._backward_waits = self._comm() if self._comm is not None else 0.0

    def optimizer_done(self) -> None:
        """The optimizer step (and the sync's work around it) is done."""
        self._optimizer_at = _clock()
        self._optimizer_waits = self._comm() if self._comm is not None else 0.0

    def checkpointed(self, since: float) -> None:
        """A step boundary's checkpoint or stop took from clock reading ``since`` until now."""
        self._step_checkpoint += _clock() - since

    def step_done(self) -> None:
        """The step is over: add its parts; the next step starts now."""
        now = _clock()
        data, start_waits = self._step_data, self._start_waits
        backward_waits = self._backward_waits - start_waits
        optimizer_waits = self._optimizer_waits - self._backward_waits
        self.steps += 1
        self.seconds += now - self._start
        self.data_wait += data
        self.forward_backward += max(0.0, self._backward_at - self._start - data - backward_waits)
        self.communication_wait += self._optimizer_waits - start_waits
        self.optimizer += max(0.0, self._optimizer_at - self._backward_at - optimizer_waits)
        self.checkpoint += self._step_checkpoint
        self._start = now
        # Read again: a checkpoint's collectives are the checkpoint's, not the next step's.
        self._start_waits = self._comm() if self._comm is not None else 0.0
        self._step_data = 0.0
        self._step_checkpoint = 0.0

    def not_a_step(self) -> None:
        """The pass's last round found no batch on any rank: its time is no step's."""
        self._step_data = 0.0
        self._step_checkpoint = 0.0
