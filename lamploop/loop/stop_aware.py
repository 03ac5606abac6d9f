"""Batch streams that a stop request reaches while they wait for data (DESIGN.md section 8).

A training pass waits for its next batch between steps.  A stream over a source that can
stall -- samples from producers, :func:`~lamploop.streaming.buffer_batches`, any
:class:`~lamploop.batches.EndingBatchStream` -- may wait for minutes, or for ever when no
producer has started yet.  The step boundaries, where a stop request is looked at, are then
never reached.  :func:`stop_aware_batches` wraps the streams of such a factory so that:

- asked for a batch once a stop was requested, the stream ends at once and draws nothing
  (the pass stops at its next boundary: a batch drawn now would never be trained on);
- waiting for a batch when a stop is requested, the wait is cancelled within
  :data:`WAIT_POLL_S` and the stream ends.

The pass then does what it does at the end of its stream: it steps with the batches it holds
(a group of ``accumulate_gradient_over_n_batches`` that was being filled steps with what it
has, as at the end of an epoch), and the stop request travels with that step's example count,
so every rank stops at that boundary, where the checkpoint is written.  When no rank holds a
batch (no producer yet), every rank's step counts zero examples and carries the request: the
ranks stop at the boundary where they waited.

A validation pass (``fit`` wraps ``validation_batches`` too) has no boundary to stop at:
a stream the request ended says so (:func:`ended_by_request`), the pass carries that in its
sum over the ranks, and a validation cut short on any rank is discarded on every rank
(:class:`~lamploop.loop.epoch_pass.ValidationStopped`).

A cancelled wait loses no sample: the buffers take a sample only in a synchronous step right
before returning it (:mod:`lamploop.streaming.buffers`).  A stream that is no
``EndingBatchStream`` (:func:`~lamploop.tensor_batches`, :func:`~lamploop.iterable_batches`,
:func:`~lamploop.dataloader_batches`, which never wait on the outside world in an await) is
handed back as it is, at no cost per batch; a wrapped stream costs one short-lived task per
batch (tens of microseconds, beside milliseconds of receiving a batch of samples).

.. versionadded:: 0.3
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Final, Protocol

import anyio

from lamploop.batches import BatchContext, BatchStream, BatchStreamFactory, EndingBatchStream

__all__ = ["WAIT_POLL_S", "StopAwareStream", "StopFlag", "ended_by_request", "stop_aware_batches"]

WAIT_POLL_S: Final = 0.05
"""How often a stream waiting for a batch looks at the stop request (set from any thread)."""

_NOTHING: Final = object()


class StopFlag(Protocol):
    """What asks a run to stop: :class:`lamploop.distributed.StopRequest` is one (set from any thread)."""

    def is_set(self) -> bool:
        """Whether a stop was requested."""
        ...


def stop_aware_batches(factory: BatchStreamFactory, stop: StopFlag) -> BatchStreamFactory:
    """``factory``, whose streams over a source that can stall end on a stop request (see the module).

    Streams that are not :class:`~lamploop.batches.EndingBatchStream` are returned unchanged.
    """

    def make(context: BatchContext) -> BatchStream:
        stream = factory(context)
        if isinstance(stream, EndingBatchStream):
            return StopAwareStream(stream, stop)
        return stream

    return make


class StopAwareStream:
    """An :class:`~lamploop.batches.EndingBatchStream` that ends when ``stop`` is requested.

    :attr:`source_ended` is the inner stream's: a stream ended by a stop request is not the
    end of the source (the run stops; it does not end as when the samples ran out).
    """

    def __init__(self, inner: EndingBatchStream, stop: StopFlag) -> None:
        self._inner = inner
        self._stop = stop
        self._cut_short = False  # set by an iterator that a request ended

    @property
    def source_ended(self) -> bool:
        """The inner stream's: the producers are done and no batch will ever come."""
        return self._inner.source_ended

    @property
    def ended_by_request(self) -> bool:
        """Whether a request ended an iteration before the inner stream ended (here or further in)."""
        return self._cut_short or ended_by_request(self._inner)

    def __aiter__(self) -> AsyncIterator[Any]:
        return _StopAwareIterator(aiter(self._inner), self._stop, self)


def ended_by_request(stream: object) -> bool:
    """Whether ``stream`` is a :class:`StopAwareStream` that a request cut short (its source may have more).

    A validation pass over such a stream saw only part of its batches: its loss is no
    validation loss (see :func:`lamploop.loop.epoch_pass.one_epoch`).
    """
    return isinstance(stream, StopAwareStream) and stream.ended_by_request


class _StopAwareIterator:
    def __init__(self, inner: AsyncIterator[Any], stop: StopFlag, stream: StopAwareStream) -> None:
        self._inner = inner
        self._stop = stop
        self._stream = stream
        self._ended = False

    def __aiter__(self) -> _StopAwareIterator:
        return self

    async def __anext__(self) -> Any:
        if self._ended:
            raise StopAsyncIteration
        if self._stop.is_set():
            self._ended = self._stream._cut_short = True
            raise StopAsyncIteration
        item: Any = _NOTHING
        failure: Exception | None = None
        with anyio.CancelScope() as wait:
            async with anyio.create_task_group() as watch:
                watch.start_soon(_cancel_on_stop, self._stop, wait)
                try:
                    item = await anext(self._inner, _NOTHING)
                except Exception as exc:  # raised below: the task group would wrap it in a group
                    failure = exc
                watch.cancel_scope.cancel()
        if failure is not None:
            raise failure
        if item is _NOTHING:  # the stream ended, or a stop request ended the wait (wait.cancelled_caught)
            self._ended = True
            if wait.cancelled_caught:
                self._stream._cut_short = True
            raise StopAsyncIteration
        return item


async def _cancel_on_stop(stop: StopFlag, wait: anyio.CancelScope) -> None:
    # The request is set from a signal handler or another thread, where no anyio.Event can be set: poll.
    while not stop.is_set():  # noqa: ASYNC110
        await anyio.sleep(WAIT_POLL_S)
    wait.cancel()
