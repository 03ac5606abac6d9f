"""Online training from streaming producers.

Samples (:class:`~lamploop.streaming.sample.Sample`) arrive from producers, wait in a
buffer (:mod:`lamploop.streaming.buffers`: FIFO, FIRO, reservoir), and batches are drawn
from the buffer while more arrive (:func:`~lamploop.streaming.batches.buffer_batches`); a
run ends with its stream (the first epoch in which no rank has a batch left); and
:class:`~lamploop.streaming.state.StreamState` checkpoints the buffer so that a resumed run
loses nothing.
"""

from lamploop.streaming.batches import BufferStream, buffer_batches, stack_samples, stream_ended
from lamploop.streaming.buffer_policy import FifoPolicy, FiroPolicy, Policy, ReservoirPolicy
from lamploop.streaming.buffers import (
    BufferClosedError,
    DuplicateSampleError,
    FifoBuffer,
    FiroBuffer,
    ReservoirBuffer,
    StreamBuffer,
    StreamEnded,
)
from lamploop.streaming.sample import Sample, SampleSink
from lamploop.streaming.state import STREAM_EXTRA, StreamState

__all__ = [
    "STREAM_EXTRA",
    "BufferClosedError",
    "BufferStream",
    "DuplicateSampleError",
    "FifoBuffer",
    "FifoPolicy",
    "FiroBuffer",
    "FiroPolicy",
    "Policy",
    "ReservoirBuffer",
    "ReservoirPolicy",
    "Sample",
    "SampleSink",
    "StreamBuffer",
    "StreamEnded",
    "StreamState",
    "buffer_batches",
    "stack_samples",
    "stream_ended",
]
