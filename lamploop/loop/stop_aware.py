"""Batch streams that a stop request reaches while they wait for data (DESIGN.md section 8).

A training pass waits for its next batch between steps.  A stream over a source that can
stall -- samples from producers, :func:`~lamploop.streaming.buffer_batches`, any
:class:`~lamploop.batches.EndingBatchStream`, or an async stream of your own that awaits
something outside -- may wait for minutes, or for ever when no producer has started yet.  The
step boundaries, where a stop request is looked at, are then never reached.
:func:`stop_aware_batches` wraps the streams of such a factory:

- an :class:`~lamploop.batches.EndingBatchStream` (:class:`StopAwareStream`): asked for a
  batch once a stop was requested, it ends at once and draws nothing (the pass stops at its
  next boundary: a batch drawn now would never be trained on); waiting for a batch when a
  stop is requested, the wait is cancelled within :data:`WAIT_POLL_S` and the stream ends;
- any other async stream of your own (:class:`StopAwareOwnStream`): a wait for a batch that
  outlasts the request by :data:`OWN_STREAM_GRACE_S` is cancelled and the stream ends.  A
  stream that yields steadily is left alone: the training pass stops at the step boundary
  after the batch it waits for, and a validation pass runs to its end, as without the wrapper.

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
before returning it (:mod:`lamploop.streaming.buffers`).  Your own stream gets a cancellation
at the ``await`` where it waits (as any anyio or asyncio code can), and is not iterated again.

The passes watch a wrapped stream with one task each (:func:`watching`): a wait then costs one
cancel scope (a few microseconds).  A wrapped stream iterated outside a pass watches each wait
with a task of its own (tens of microseconds).  The streams that never wait on the outside
world in an await (:func:`~lamploop.tensor_batches`, :func:`~lamploop.iterable_batches`,
:func:`~lamploop.dataloader_batches`: see :func:`lamploop.batches.waits_on_nothing`) are handed
back as they are, at no cost per batch; a synchronous iterable holds the event loop while it
makes a batch, and only a second signal ends that (docs/reliability.md).

.. versionadded:: 0.3
.. versionchanged:: 0.3
   Async streams of your own are wrapped too (:class:`StopAwareOwnStream`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final, Protocol

import anyio

from lamploop.batches import (
    BatchContext,
    BatchStream,
    BatchStreamFactory,
    EndingBatchStream,
    waits_on_nothing,
)

__all__ = [
    "OWN_STREAM_GRACE_S",
    "WAIT_POLL_S",
    "StopAwareOwnStream",
    "StopAwareStream",
    "StopFlag",
    "ended_by_request",
    "stop_aware_batches",
    "watching",
]

WAIT_POLL_S: Final = 0.05
"""How often a stream waiting for a batch looks at the stop request (set from any thread)."""

OWN_STREAM_GRACE_S: Final = 1.0
"""How long a wait in an async stream of your own may outlast a stop request before it is
ended: a stream that yields steadily (a validation pass, a batch that takes a moment) is left to
reach the next step boundary or its end; one that stalls is ended."""

_NOTHING: Final = object()


class StopFlag(Protocol):
    """What asks a run to stop: :class:`lamploop.distributed.StopRequest` is one (set from any thread)."""

    def is_set(self) -> bool:
        """Whether a stop was requested."""
        ...


class _Either:
    """Two stop flags as one (``fit``'s stop request and a replica's abort)."""

    def __init__(self, first: StopFlag, second: StopFlag) -> None:
        self._first, self._second = first, second

    def is_set(self) -> bool:
        return self._first.is_set() or self._second.is_set()


def stop_aware_batches(factory: BatchStreamFactory, stop: StopFlag) -> BatchStreamFactory:
    """``factory``, whose streams that can wait on the outside world end on a stop request (see
    the module).

    Streams that never wait in an await (:func:`~lamploop.batches.waits_on_nothing`) and
    anything that is no async iterable (the pass names that mistake) are returned unchanged; a
    stream wrapped already is wrapped once, ending on either request.
    """

    def make(context: BatchContext) -> BatchStream:
        stream = factory(context)
        if isinstance(stream, _StopAware):
            return stream.also_on(stop)
        if isinstance(stream, EndingBatchStream):
            return StopAwareStream(stream, stop)
        if waits_on_nothing(stream) or not hasattr(stream, "__aiter__"):
            return stream
        return StopAwareOwnStream(stream, stop)

    return make


class _StopAware:
    """A stream whose waits end on a stop request, ``grace`` seconds after it (see the module)."""

    grace: float  # each kind's own

    def __init__(self, inner: Any, stop: StopFlag) -> None:
        self._inner = inner
        self._stop = stop
        self._cut_short = False  # set by an iterator that a request ended
        self._watched = False  # a pass's watcher (``watching``) ends the waits
        self._wait: anyio.CancelScope | None = None  # the wait in progress, for the watcher
        self._wait_began = 0.0

    def also_on(self, stop: StopFlag) -> _StopAware:
        """This stream's source, ending on this stream's request or on ``stop``."""
        return type(self)(self._inner, _Either(self._stop, stop))

    @property
    def ended_by_request(self) -> bool:
        """Whether a request ended an iteration before the inner stream ended (here or further in)."""
        return self._cut_short or ended_by_request(self._inner)

    def __aiter__(self) -> AsyncIterator[Any]:
        return _StopAwareIterator(aiter(self._inner), self)

    async def watch(self) -> None:
        """Cancel the wait in progress once it outlasts the stop request by :attr:`grace`."""
        requested: float | None = None
        while True:
            await anyio.sleep(WAIT_POLL_S)
            if not self._stop.is_set():  # set from a signal handler or another thread: polled
                continue
            now = anyio.current_time()
            requested = now if requested is None else requested
            wait = self._wait
            if wait is not None and now - max(requested, self._wait_began) >= self.grace:
                wait.cancel()


class StopAwareStream(_StopAware):
    """An :class:`~lamploop.batches.EndingBatchStream` that ends when ``stop`` is requested.

    :attr:`source_ended` is the inner stream's: a stream ended by a stop request is not the
    end of the source (the run stops; it does not end as when the samples ran out).
    """

    grace = 0.0

    def __init__(self, inner: EndingBatchStream, stop: StopFlag) -> None:
        super().__init__(inner, stop)

    @property
    def source_ended(self) -> bool:
        """The inner stream's: the producers are done and no batch will ever come."""
        return bool(self._inner.source_ended)


class StopAwareOwnStream(_StopAware):
    """An async stream of your own whose wait for a batch ends :data:`OWN_STREAM_GRACE_S` after a
    stop request (no :class:`~lamploop.batches.EndingBatchStream`: it has no ``source_ended``)."""

    grace = OWN_STREAM_GRACE_S

    def __init__(self, inner: BatchStream, stop: StopFlag) -> None:
        super().__init__(inner, stop)


def ended_by_request(stream: object) -> bool:
    """Whether ``stream`` is a stop-aware stream that a request cut short (its source may have more).

    A validation pass over such a stream saw only part of its batches: its loss is no
    validation loss (see :func:`lamploop.loop.epoch_pass.one_epoch`).
    """
    return isinstance(stream, _StopAware) and stream.ended_by_request


@asynccontextmanager
async def watching(stream: object) -> AsyncIterator[None]:
    """Around a pass over ``stream``: one task that ends its waits on a stop request (a wrapped
    stream; anything else is left alone), instead of a task per batch."""
    if not isinstance(stream, _StopAware) or stream._watched:
        yield
        return
    failure: BaseException | None = None
    async with anyio.create_task_group() as watcher:
        watcher.start_soon(stream.watch)
        stream._watched = True
        try:
            yield
        except anyio.get_cancelled_exc_class():
            raise  # the task group's own business
        except BaseException as exc:  # raised as it is, below (SystemExit, KeyboardInterrupt too):
            failure = exc  # the task group would wrap it in a group
        finally:
            stream._watched = False
            watcher.cancel_scope.cancel()
    if failure is not None:
        raise failure


class _StopAwareIterator:
    def __init__(self, inner: AsyncIterator[Any], stream: _StopAware) -> None:
        self._inner = inner
        self._stream = stream
        self._ended = False

    def __aiter__(self) -> _StopAwareIterator:
        return self

    async def __anext__(self) -> Any:
        stream = self._stream
        if self._ended:
            raise StopAsyncIteration
        if stream.grace == 0 and stream._stop.is_set():
            self._ended = stream._cut_short = True
            raise StopAsyncIteration
        if stream._watched:
            item: Any = _NOTHING  # left so when the wait is cancelled
            with anyio.CancelScope() as wait:
                stream._wait, stream._wait_began = wait, anyio.current_time()
                try:
                    item = await anext(self._inner, _NOTHING)
                finally:
                    stream._wait = None
        else:
            item, wait = await self._watched_alone()
        if item is _NOTHING:  # the stream ended, or a stop request ended the wait (wait.cancelled_caught)
            self._ended = True
            if wait.cancelled_caught:
                stream._cut_short = True
            raise StopAsyncIteration
        return item

    async def _watched_alone(self) -> tuple[Any, anyio.CancelScope]:
        """The next item, its wait watched by a task of its own (iterated outside a pass)."""
        item: Any = _NOTHING
        failure: BaseException | None = None
        with anyio.CancelScope() as wait:
            async with anyio.create_task_group() as watch:
                watch.start_soon(_cancel_on_stop, self._stream._stop, self._stream.grace, wait)
                try:
                    item = await anext(self._inner, _NOTHING)
                except anyio.get_cancelled_exc_class():
                    raise
                except BaseException as exc:  # raised below: the task group would wrap it in a group
                    failure = exc
                watch.cancel_scope.cancel()
        if failure is not None:
            raise failure
        return item, wait


async def _cancel_on_stop(stop: StopFlag, grace: float, wait: anyio.CancelScope) -> None:
    # The request is set from a signal handler or another thread, where no anyio.Event can be set: poll.
    while not stop.is_set():  # noqa: ASYNC110
        await anyio.sleep(WAIT_POLL_S)
    await anyio.sleep(grace)
    wait.cancel()
