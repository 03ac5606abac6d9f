"""``until_stream_ends``: a learning-rate schedule that ends training when the stream does.

:func:`lamploop.epochs` stops when the schedule's factor is <= 0; this wrapper gives the
wrapped schedule's factor until the buffer's producers are done and the buffer is drained,
then 0, so a streamed run ends after its last (possibly short) epoch, explicitly, instead
of at a guessed ``max_epochs``.  It reads the buffer, so unlike lamploop's other schedules it
is not a pure function of its state: on one rank the buffer is the run's; with several
ranks, see docs/streaming.md.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from lamploop.schedules import LearningRateSchedule, noop
from lamploop.streaming.buffers import StreamBuffer

__all__ = ["until_stream_ends"]

S = TypeVar("S")


class _UntilStreamEnds(Generic[S]):
    def __init__(self, buffer: StreamBuffer, inner: LearningRateSchedule[S]) -> None:
        self.buffer, self.inner = buffer, inner

    @property
    def needs_validation_loss(self) -> bool:
        return self.inner.needs_validation_loss

    @property
    def state_type(self) -> Any:
        return self.inner.state_type

    def init(self) -> S:
        return self.inner.init()

    def learning_rate_factor(
        self, state: S, epoch: int, last_validation_loss: float | None
    ) -> tuple[S, float]:
        state, factor = self.inner.learning_rate_factor(state, epoch, last_validation_loss)
        return state, (0.0 if self.buffer.ended else factor)

    def __getattr__(self, name: str) -> Any:  # validation_frequency and the like
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"until_stream_ends({self.buffer!r}, {self.inner!r})"


def until_stream_ends(
    buffer: StreamBuffer, schedule: LearningRateSchedule[S] | None = None
) -> LearningRateSchedule[S]:
    """``schedule``'s factors (default: 1.0 throughout) until ``buffer`` ended, then 0 (stop)."""
    inner: LearningRateSchedule[Any] = schedule if schedule is not None else noop()
    return _UntilStreamEnds(buffer, inner)
