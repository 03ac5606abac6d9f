"""``buffer_batches``: a batch-stream factory that draws its batches from a stream buffer.

An "epoch" of a streamed run is ``batches_per_epoch`` batches drawn from the rank's buffer
while producers keep filling it (validation and checkpoints then come every
``batches_per_epoch`` batches, as after any epoch), or fewer when the producers are done
and the buffer runs dry: the last batch may be short, and an epoch after the end of the
stream has no batch on this rank (it takes part with zero examples, lamploop's
uneven-stream rule).  The first epoch in which *no* rank has a batch ends the run (on
one rank or many alike): :func:`lamploop.one_epoch` raises
:class:`~lamploop.errors.StreamExhausted` and :func:`lamploop.epochs` returns the state
of the epochs before it.  :func:`stream_ended` tells whether this rank's end came.

The buffer lives on the event loop that fills it (its receiver's).  A run of several ranks
trains on a worker thread with an event loop of its own (docs/architecture.md): the stream
then reads the buffer on the buffer's loop, through anyio's thread portal, in slices of
``WAIT_SLICE_S`` seconds, so a run that ends while producers are silent is never stuck.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Sequence
from operator import attrgetter
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import torch

from lamploop.batches import BatchContext, BatchStreamFactory
from lamploop.checks import check_callable, check_int
from lamploop.errors import ConfigurationError, SampleMismatchError
from lamploop.streaming.buffers import StreamBuffer, StreamEnded
from lamploop.streaming.sample import Sample
from lamploop.streaming.sample_rows import row_runs, stack_runs
from lamploop.streaming.tensor_bytes import describe_mismatch, signature_of

__all__ = [
    "WAIT_SLICE_S",
    "BufferStream",
    "buffer_batches",
    "sample_mismatch",
    "stack_samples",
    "stream_ended",
]

WAIT_SLICE_S = 0.1
"""Longest single wait of a worker thread on the buffer's event loop."""

Collate = Callable[[Sequence[Sample]], Any]

_TENSORS = attrgetter("tensors")


def stack_samples(features: str = "x", target: str = "y") -> Collate:
    """A collate function: ``(stack of samples' features, stack of their targets)``.

    Received samples that follow each other in their frame are copied as one slice per tensor
    (:func:`~lamploop.streaming.sample_rows.stack_runs`), equal to ``torch.stack``'s result.

    Raises (from the collate function):
        SampleMismatchError: a sample's tensor has another shape than the first sample's
            (it names the sample's producer and seq, the tensor and both shapes).
        ConfigurationError: a sample has no tensor named ``features`` or ``target``; when made,
            ``features`` or ``target`` is not a str.
    """
    for name, value in (("features", features), ("target", target)):
        if not isinstance(value, str):
            msg = f"stack_samples: {name} is a tensor's name (a str), got {type(value).__name__}"
            raise ConfigurationError(msg)

    def collate(samples: Sequence[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            rows = list(map(_TENSORS, samples))
            runs = row_runs(rows)
            if runs is not None:
                x, y = stack_runs(runs, features), stack_runs(runs, target)
            else:  # not all of them received rows: one by one
                x = torch.stack([row[features] for row in rows])
                y = torch.stack([row[target] for row in rows])
        except KeyError as missing:
            name = missing.args[0] if missing.args else None
            short = next((s for s in samples if name not in s.tensors), samples[0])
            msg = (
                f"stack_samples: sample seq {short.seq} of producer {short.producer!r:.100} has no "
                f"tensor {name!r:.100}; its tensors are {sorted(short.tensors)}"
            )
            raise ConfigurationError(msg) from None
        except RuntimeError as exc:  # torch: "stack expects each tensor to be equal size"
            mismatch = sample_mismatch(samples, (features, target))
            if mismatch is None:
                raise
            raise mismatch from exc
        return x, y

    return collate


def sample_mismatch(
    samples: Sequence[Sample], fields: Sequence[str] | None = None
) -> SampleMismatchError | None:
    """The error naming the first of ``samples`` whose tensors (of ``fields``, default all)
    differ in shape, dtype or presence from the first sample's; ``None`` if none does."""

    def signature(sample: Sample) -> Any:
        found = signature_of(sample.tensors)
        return found if fields is None else tuple(entry for entry in found if entry[0] in fields)

    expected = signature(samples[0])
    for sample in samples[1:]:
        mismatch = describe_mismatch(signature(sample), expected)
        if mismatch is None:
            continue
        field, what = mismatch
        first = samples[0]
        msg = (
            f"sample seq {sample.seq} of producer {sample.producer!r:.100} does not match the batch's "
            f"first sample (seq {first.seq} of producer {first.producer!r:.100}): {what}"
        )
        shape, expected_shape = (
            tuple(s.tensors[field].shape) if field in s.tensors else None for s in (sample, first)
        )
        return SampleMismatchError(
            msg,
            producer=sample.producer,
            seq=sample.seq,
            field=field,
            shape=shape,
            expected_shape=expected_shape,
        )
    return None


def stream_ended(buffer: StreamBuffer) -> bool:
    """Whether the producers are done and ``buffer`` is drained: no batch will come."""
    return buffer.ended


class _BufferReader:
    """Reads batches from a buffer on its own event loop, from that loop or from another thread."""

    def __init__(self, buffer: StreamBuffer) -> None:
        self.buffer = buffer
        self._loop_thread = threading.get_ident()
        self._token = anyio.lowlevel.current_token()

    async def batch(self, n: int) -> list[Sample] | None:
        """Up to ``n`` samples (fewer at the end of the stream); ``None`` once it ended."""
        if threading.get_ident() == self._loop_thread:
            try:
                return await self.buffer.get_batch(n)
            except StreamEnded:
                return None
        while True:  # a worker thread: wait on the buffer's loop, a slice at a time
            got = anyio.from_thread.run(self._within, n, token=self._token)
            if got is not None:
                return got or None
            await anyio.lowlevel.checkpoint()  # let the worker's loop see a cancellation

    async def _within(self, n: int) -> list[Sample] | None:
        """A batch, ``[]`` when the stream ended, ``None`` when nothing came within a slice."""
        with anyio.move_on_after(WAIT_SLICE_S):
            try:
                return await self.buffer.get_batch(n)
            except StreamEnded:
                return []
        return None


def buffer_batches(
    buffer: StreamBuffer,
    *,
    batch_size: int,
    batches_per_epoch: int,
    collate: Collate | None = None,
) -> BatchStreamFactory:
    """A :data:`~lamploop.batches.BatchStreamFactory` over ``buffer`` (this rank's).

    Make it on the owner's event loop, where the receiver was opened (with the receiver on its
    own thread, ``own_thread=True``, the buffer is filled on that thread and drawn from here).

    Args:
        buffer: where the samples wait.
        batch_size: samples per batch (at most the buffer's capacity).
        batches_per_epoch: how many batches make an epoch (fewer at the end of the stream).
        collate: turns a list of samples into a batch (default: :func:`stack_samples`,
            ``(x, y)`` from the tensors named ``"x"`` and ``"y"``).

    Returns:
        The factory.  Its streams are :class:`BufferStream` objects: the run ends at the
        first training epoch in which no rank drew a batch because every rank's stream
        ended (:class:`~lamploop.errors.StreamExhausted`, caught by :func:`lamploop.epochs`).

    Raises:
        ConfigurationError: ``buffer`` is not a streaming buffer, ``collate`` not callable, a
            count not a positive int, ``batch_size`` exceeds the buffer's capacity (a batch
            could never be filled), or no event loop runs here.
    """
    if not isinstance(buffer, StreamBuffer):
        what = type(buffer).__name__
        msg = f"buffer_batches: buffer must be a lamploop.streaming buffer (FifoBuffer...), got {what}"
        raise ConfigurationError(msg)
    try:
        check_int("batch_size", batch_size, 1)
        check_int("batches_per_epoch", batches_per_epoch, 1)
        check_callable("collate", collate, optional=True)
    except ConfigurationError as exc:
        msg = f"buffer_batches: {exc}"
        raise ConfigurationError(msg) from None
    if batch_size > buffer.capacity:
        msg = f"buffer_batches: batch_size={batch_size} exceeds the buffer's capacity {buffer.capacity}"
        raise ConfigurationError(msg)
    try:
        reader = _BufferReader(buffer)  # takes the running event loop's token
    except RuntimeError:  # anyio's NoEventLoopError
        msg = (
            "buffer_batches: make it on the event loop where the receiver was opened (inside "
            "anyio.run / fit_async), not outside any event loop: its streams wait on that loop"
        )
        raise ConfigurationError(msg) from None
    make_batch = collate if collate is not None else stack_samples()

    def factory(context: BatchContext) -> BufferStream:
        return BufferStream(reader, batch_size, batches_per_epoch, make_batch, epoch=context.epoch)

    return factory


class BufferStream:
    """One epoch's batches from a buffer; an :class:`~lamploop.batches.EndingBatchStream`.

    Its :attr:`source_ended` tells :func:`lamploop.one_epoch` that an epoch without batches
    on every rank is the end of the stream (the run ends) rather than a mistake.
    """

    def __init__(
        self,
        reader: _BufferReader,
        batch_size: int,
        batches: int,
        collate: Collate,
        *,
        epoch: int | None = None,
    ) -> None:
        self._reader, self._batch_size, self._batches, self._collate = reader, batch_size, batches, collate
        self._epoch = epoch

    @property
    def source_ended(self) -> bool:
        """The producers are done and the buffer is drained: no batch will come again."""
        return self._reader.buffer.ended

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[Any]:
        for index in range(self._batches):
            samples = await self._reader.batch(self._batch_size)
            if samples is None:
                return
            try:
                batch = self._collate(samples)
            except SampleMismatchError as exc:
                raise self._placed(exc, index) from exc
            yield batch

    def _placed(self, exc: SampleMismatchError, index: int) -> SampleMismatchError:
        """``exc`` saying which epoch and batch it happened in."""
        place = f"batch {index}" if self._epoch is None else f"epoch {self._epoch}, batch {index}"
        return SampleMismatchError(
            f"{place}: {exc}",
            producer=exc.producer,
            seq=exc.seq,
            field=exc.field,
            shape=exc.shape,
            expected_shape=exc.expected_shape,
            epoch=self._epoch,
            batch=index,
        )
