r"""Buffers between streaming producers and a trainer: one :class:`StreamBuffer`, three policies.

Producers (through a receiver) ``put`` :class:`~lamploop.streaming.sample.Sample`\ s into a
buffer; the trainer ``get``\ s them, while more arrive.  A buffer keeps the samples, its
limits, counters and waits; its :class:`~lamploop.streaming.buffer_policy.Policy` decides
which sample a read returns, whether it leaves, and what a put into a full buffer does
(:mod:`lamploop.streaming.buffer_policy` draws the three and spells out their draws)::

    FifoBuffer       = StreamBuffer(policy=FifoPolicy())       first in, first out; a put waits when full
    FiroBuffer       = StreamBuffer(policy=FiroPolicy())       first in, random out; a put waits when full
    ReservoirBuffer  = StreamBuffer(policy=ReservoirPolicy())  random out, samples stay; a put never
                                                               waits: a full reservoir evicts at random

Common rules:

* **watermark**: reads wait until ``watermark`` samples have been received in all (since the
  buffer was made), or the stream was closed.  Once reached it stays reached.
  ``1 <= watermark <= capacity``.
* **max_reads** ("pseudo-epochs"): a resident sample's *seen* count is how many times it was
  read.  FIFO and FIRO remove a sample at its ``max_reads``-th read, so every sample put is
  read exactly ``max_reads`` times before the stream ends (``max_reads=1``: each once); a
  sample waiting for its next read keeps its place, so puts wait until one is read out.  A
  reservoir removes a sample at its ``max_reads``-th read, never when ``max_reads=None``; a
  sample may be evicted before it was read at all.
* **close()**: the producers are done.  Readers drain what is left: FIFO and FIRO keep
  their ``max_reads`` rule; a closed reservoir removes every sample it returns (each
  resident is read once more and leaves, so a drain ends even with ``max_reads=None``).
  Then :meth:`~StreamBuffer.get` raises :class:`StreamEnded`.  A put after close raises
  :class:`BufferClosedError`.
* **duplicates**: a buffer remembers the largest ``seq`` put from each producer and refuses
  (:class:`DuplicateSampleError`) a sample whose ``seq`` is not larger: a receiver dedupes
  resends before putting, and samples from one producer arrive in order (gaps are fine, e.g.
  when producers are spread over several buffers).

Determinism: every random choice comes from the buffer's own
``numpy.random.Generator(numpy.random.PCG64(seed))`` (FIFO makes none), exactly as
:mod:`~lamploop.streaming.buffer_policy` says, so the same sequence of puts and gets gives the
same draws; the generator's state is part of :meth:`StreamBuffer.state_dict` (a restored
buffer continues exactly like the uninterrupted one; the format is
:mod:`~lamploop.streaming.buffer_state`'s).

Concurrency: the synchronous core (:meth:`~StreamBuffer.try_put`,
:meth:`~StreamBuffer.try_get`, :meth:`~StreamBuffer.close`) does all the work, under the
buffer's lock; the async ``put``/``get``/``get_batch`` loop over it and wait on an anyio event
of their own loop per direction.  Puts and reads may come from two threads, each with its own
event loop (a receiver on a thread of its own, ``SampleReceiver(own_thread=True)``, and the
trainer): a change made on one thread wakes the waits of the other on their loop
(:mod:`~lamploop.streaming.buffer_wakes`), and the draws are those the same sequence of puts
and reads makes on one thread.  A cancelled ``get`` loses no sample (a sample is taken only in
a synchronous step right before returning it), and a cancelled ``put`` puts nothing.
"""

from __future__ import annotations

from typing import ClassVar

from lamploop.errors import BufferClosedError, DuplicateSampleError, StreamEnded
from lamploop.streaming.buffer_core import StreamBuffer
from lamploop.streaming.buffer_policy import FifoPolicy, FiroPolicy, Policy, ReservoirPolicy
from lamploop.streaming.buffer_settings import BufferStats, OnEvict, OnRead

__all__ = [
    "BufferClosedError",
    "BufferStats",
    "DuplicateSampleError",
    "FifoBuffer",
    "FiroBuffer",
    "OnEvict",
    "OnRead",
    "ReservoirBuffer",
    "StreamBuffer",
    "StreamEnded",
]


class FifoBuffer(StreamBuffer):
    """First in, first out: reads come in arrival order; a put into a full buffer waits.

    A :class:`StreamBuffer` with a :class:`~lamploop.streaming.buffer_policy.FifoPolicy`:
    ``seed`` defaults to 0 (FIFO draws nothing) and ``max_reads`` to 1.  With
    ``max_reads > 1``, a read sample that stays goes back in at the tail (behind the samples
    that arrived meanwhile) until its ``max_reads``-th read.

    >>> import torch
    >>> from lamploop.streaming import Sample
    >>> buffer = FifoBuffer(capacity=2, watermark=2)
    >>> buffer.try_put(Sample("sim", 0, {"x": torch.zeros(1)}))
    True
    >>> buffer.try_get() is None  # the watermark (2 received) is not reached
    True
    >>> buffer.try_put(Sample("sim", 1, {"x": torch.ones(1)}))
    True
    >>> buffer.try_put(Sample("sim", 2, {"x": torch.ones(1)}))  # full
    False
    >>> [buffer.try_get().key, buffer.try_get().key]
    [('sim', 0), ('sim', 1)]
    >>> buffer.close()
    >>> buffer.try_get()
    Traceback (most recent call last):
    ...
    lamploop.errors.StreamEnded: FifoBuffer: closed and drained, the stream is over
    """

    fixed_policy: ClassVar[Policy | None] = FifoPolicy()


class FiroBuffer(StreamBuffer):
    """First in, random out: a read draws a uniformly random resident; a full buffer's put waits.

    A :class:`StreamBuffer` with a :class:`~lamploop.streaming.buffer_policy.FiroPolicy`:
    ``seed`` is required, ``max_reads`` defaults to 1.  The drawn sample leaves at its
    ``max_reads``-th read (``max_reads > 1``: pseudo-epochs, every sample is read exactly that
    many times before the stream ends).

    >>> import torch
    >>> from lamploop.streaming import Sample
    >>> buffer = FiroBuffer(capacity=4, watermark=3, seed=0)
    >>> for seq in range(3):
    ...     buffer.try_put(Sample("sim", seq, {"x": torch.tensor([seq])}))
    True
    True
    True
    >>> buffer.close()
    >>> sorted(buffer.try_get().seq for _ in range(3))
    [0, 1, 2]
    """

    fixed_policy: ClassVar[Policy | None] = FiroPolicy()


class ReservoirBuffer(StreamBuffer):
    """Samples stay after being read; a put into a full reservoir evicts a random resident.

    A :class:`StreamBuffer` with a :class:`~lamploop.streaming.buffer_policy.ReservoirPolicy`:
    ``seed`` is required, ``max_reads`` defaults to ``None``.  Producers never wait.  A read
    draws a uniformly random resident, which stays unless it was read ``max_reads`` times
    (``None``: never).  After :meth:`close` each read removes its sample, so a drain ends.

    >>> import anyio, torch
    >>> from lamploop.streaming import Sample
    >>> evicted = []
    >>> buffer = ReservoirBuffer(
    ...     capacity=2, watermark=2, seed=1, on_evict=lambda key, seen: evicted.append(key)
    ... )
    >>> async def main():
    ...     for seq in range(5):
    ...         await buffer.put(Sample("sim", seq, {"x": torch.tensor([seq])}))
    ...     reads = [(await buffer.get()).seq for _ in range(4)]
    ...     buffer.close()
    ...     drained = [sample.seq async for sample in buffer]
    ...     return len(reads), len(drained)
    >>> anyio.run(main)
    (4, 2)
    >>> len(evicted), buffer.stats().read_total
    (3, 6)
    """

    fixed_policy: ClassVar[Policy | None] = ReservoirPolicy()
