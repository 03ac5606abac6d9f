"""``StreamBuffer``: a stream buffer's samples, limits, counters, waits and checkpoints.

Its :class:`~lamploop.streaming.buffer_policy.Policy` decides the rest; the rules every buffer
follows are :mod:`lamploop.streaming.buffers`' docstring (import the buffers from there).
"""

from __future__ import annotations

import operator
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import islice
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import numpy as np
import torch

from lamploop.checks import check_callable
from lamploop.errors import BufferClosedError, ConfigurationError, DuplicateSampleError, StreamEnded
from lamploop.streaming.buffer_policy import Policy, Slot
from lamploop.streaming.buffer_settings import (
    POLICY_DEFAULT,
    BufferSettings,
    BufferStats,
    OnEvict,
    OnRead,
    Unset,
    check_int,
)
from lamploop.streaming.buffer_state import BufferState, capture, restore
from lamploop.streaming.buffer_wakes import Waiters
from lamploop.streaming.sample import Sample

_PRODUCER = operator.attrgetter("producer")
_SEQ = operator.attrgetter("seq")
_SAMPLE = operator.attrgetter("sample")

__all__ = ["StreamBuffer"]


class StreamBuffer:
    """A buffer of streamed samples whose ``policy`` decides reads, leaving and full puts.

    :mod:`lamploop.streaming.buffers` has the rules all buffers share, and its ``FifoBuffer``,
    ``FiroBuffer`` and ``ReservoirBuffer``: this with their policy.

    Args:
        policy: the :class:`~lamploop.streaming.buffer_policy.Policy` (a subclass's own
            when left out).
        capacity: the most samples held at once (>= 1).
        watermark: reads wait until this many samples were received in all, or the
            stream was closed (``1 <= watermark <= capacity``).
        seed: seeds the buffer's ``numpy.random.Generator(PCG64(seed))`` (>= 0); required
            for a policy that draws (FIRO, reservoir), else 0 by default.
        max_reads: a sample leaves at its ``max_reads``-th read (>= 1; ``None``, unlimited,
            only for a reservoir).  Default: the policy's (1 for FIFO and FIRO, ``None`` for
            a reservoir).
        on_read: called as ``on_read(key, seen)`` after each read (``seen`` includes it),
            e.g. to count every sample's reads; must not raise.
        on_evict: called as ``on_evict(key, seen)`` when a reservoir evicts a sample.
            Both run under the buffer's lock (on the receiver's thread for ``on_evict`` when it
            has one): they must not wait for another thread.

    Raises:
        ConfigurationError: an argument is out of range or missing (naming it).
    """

    fixed_policy: ClassVar[Policy | None] = None
    """A subclass's policy: what it uses when ``policy`` is left out, and the only one it takes."""

    def __init__(
        self,
        *,
        policy: Policy | None = None,
        capacity: int,
        watermark: int,
        seed: int | None = None,
        max_reads: int | Unset | None = POLICY_DEFAULT,
        on_read: OnRead | None = None,
        on_evict: OnEvict | None = None,
    ) -> None:
        settings = BufferSettings.check(
            type(self).__name__,
            policy=policy,
            fixed_policy=type(self).fixed_policy,
            capacity=capacity,
            watermark=watermark,
            seed=seed,
            max_reads=max_reads,
        )
        self._settings = settings
        self._policy, self._capacity = settings.policy, settings.capacity
        self._watermark, self._max_reads = settings.watermark, settings.max_reads
        self._rng = np.random.Generator(np.random.PCG64(settings.seed))
        self._resident = self._policy.storage()
        check_callable(f"{type(self).__name__}: on_read", on_read, optional=True)
        check_callable(f"{type(self).__name__}: on_evict", on_evict, optional=True)
        self._on_read = on_read
        self._on_evict = on_evict
        self._received = 0
        self._read_total = 0
        self._evicted = 0
        self._closed = False
        self._last_seq: dict[str, int] = {}
        # A receiver on a thread of its own puts while the trainer reads: every change and
        # every look at the residents holds the lock (re-entrant: on_read and on_evict may
        # look at the buffer); waiters register under it, so no wake-up is lost.
        self._lock = threading.RLock()
        self._readers = Waiters()  # woken when a read may now succeed
        self._writers = Waiters()  # woken when a put may now succeed

    # ----------------------------------------------------------------------------------------
    # Synchronous core

    def try_put(self, sample: Sample) -> bool:
        """Put ``sample`` if there is room now: ``True`` if taken, ``False`` if full (FIFO, FIRO).

        Raises:
            BufferClosedError: after :meth:`close`.
            DuplicateSampleError: ``sample.seq`` is not after the last one put from
                ``sample.producer``.
        """
        return self.try_put_many((sample,)) == 1

    def try_put_many(self, samples: Sequence[Sample]) -> int:
        """Put ``samples`` in order while there is room: how many were taken (a prefix).

        Exactly like :meth:`try_put` on each in turn until one finds the buffer full (the same
        draws, the same state), but all checks come first: when it raises, nothing was taken.

        Raises:
            BufferClosedError: after :meth:`close` (and ``samples`` is not empty).
            DuplicateSampleError: a sample's ``seq`` is not after the last one put (or listed
                before it) from its producer.
        """
        with self._lock:
            one_producer = self._one_producer_in_order(samples)
            if one_producer is None:
                self._check_puts(samples)
            if self._on_evict is not None:  # it may look at the buffer between two puts
                return self._put_each(samples, self._on_evict)
            taken, evicted = self._policy.insert_many(self._resident, samples, self._capacity, self._rng)
            self._evicted += len(evicted)
            if one_producer is not None:
                if taken:
                    self._last_seq[one_producer] = samples[taken - 1].seq
            else:
                for sample in samples[:taken]:
                    self._last_seq[sample.producer] = sample.seq
            self._received += taken
            if taken:
                self._wake_readers()
            return taken

    def _put_each(self, samples: Sequence[Sample], on_evict: OnEvict) -> int:
        """:meth:`try_put_many`'s puts one at a time (checked), each eviction told at once."""
        taken = 0
        for sample in samples:
            count, evicted = self._policy.insert_many(self._resident, (sample,), self._capacity, self._rng)
            if not count:
                break
            for slot in evicted:
                self._evicted += 1
                on_evict(slot.sample.key, slot.seen)
            self._last_seq[sample.producer] = sample.seq
            self._received += 1
            taken += 1
        if taken:
            self._wake_readers()
        return taken

    def _one_producer_in_order(self, samples: Sequence[Sample]) -> str | None:
        """The producer of ``samples`` when they all come from one, in increasing seqs after its
        last one put, and the buffer is open (a frame's samples: checked by a few calls over the
        whole batch, not a step of Python per sample); else ``None`` (:meth:`_check_puts` checks
        them one by one, and says what is wrong)."""
        if not samples or self._closed:
            return None
        try:
            if len(set(map(_PRODUCER, samples))) != 1:
                return None
        except AttributeError:  # no Sample: _check_puts names it
            return None
        producer = samples[0].producer
        seqs = list(map(_SEQ, samples))
        previous = self._last_seq.get(producer)
        if previous is not None and seqs[0] <= previous:
            return None
        return producer if all(map(operator.lt, seqs, islice(seqs, 1, None))) else None

    def _check_puts(self, samples: Sequence[Sample]) -> None:
        """Raise if the buffer is closed (and ``samples`` is not empty) or a sample is out of order."""
        owner = type(self).__name__
        if samples and self._closed:
            msg = f"{owner}: sample {samples[0].key} put after close(): the producers said they were done"
            raise BufferClosedError(msg)
        listed: dict[str, int] = {}
        for sample in samples:
            if not isinstance(sample, Sample):
                msg = f"{owner}: a put takes a lamploop.streaming.Sample, got {type(sample).__name__}"
                raise ConfigurationError(msg)
            previous, source = listed.get(sample.producer), "put or listed before it"
            if previous is None:
                previous, source = self._last_seq.get(sample.producer), "put"
            if previous is not None and sample.seq <= previous:
                msg = (
                    f"{owner}: sample {sample.key} refused: seq {sample.seq} is not after {previous}, the "
                    f"last one {source} from {sample.producer!r} (a resend the receiver should drop, or "
                    "out of order)"
                )
                raise DuplicateSampleError(msg)
            listed[sample.producer] = sample.seq

    def try_get(self) -> Sample | None:
        """Read a sample if one is readable now, else ``None`` (watermark not reached, or empty).

        Raises:
            StreamEnded: the buffer is closed and empty.
        """
        with self._lock:
            slot = self._take()
            if slot is not None:
                return slot.sample
            if self.ended:
                raise StreamEnded(f"{type(self).__name__}: closed and drained, the stream is over")
            return None

    def close(self) -> None:
        """The producers are done: puts are refused, readers drain what is left.  Idempotent."""
        with self._lock:
            self._closed = True
            self._wake_readers()
            self._wake_writers()

    def _readable(self) -> bool:
        return len(self._resident) > 0 and (self._received >= self._watermark or self._closed)

    def _take(self) -> Slot | None:
        """One read, as the policy says: pick, count, leave or stay."""
        if not self._readable():
            return None
        policy, resident = self._policy, self._resident
        i = policy.pick(resident, self._rng)
        slot = resident[i]
        slot.seen += 1
        left = policy.leaves(slot.seen, self._max_reads, self._closed)
        policy.after_read(resident, i, left)
        self._read_total += 1
        if left:
            self._wake_writers()
        if self._on_read is not None:
            self._on_read(slot.sample.key, slot.seen)
        return slot

    def _take_many(self, n: int) -> list[Sample]:
        """Up to ``n`` reads in a row (the buffer is readable): as many :meth:`_take` in one step."""
        if self._on_read is not None:  # it may look at the buffer between two reads
            batch: list[Sample] = []
            while len(batch) < n and (slot := self._take()) is not None:
                batch.append(slot.sample)
            return batch
        read, any_left = self._policy.read_many(self._resident, n, self._rng, self._max_reads, self._closed)
        self._read_total += len(read)
        if any_left:
            self._wake_writers()
        return list(map(_SAMPLE, read))

    def _wake_readers(self) -> None:
        self._readers.wake()

    def _wake_writers(self) -> None:
        self._writers.wake()

    # ----------------------------------------------------------------------------------------
    # Async API

    async def put(self, sample: Sample) -> None:
        """Put ``sample``, waiting while a FIFO or FIRO buffer is full (back-pressure).

        Cancelled while waiting, it has put nothing.  Raises like :meth:`try_put`
        (:class:`BufferClosedError` also when the buffer is closed while it waits).
        """
        await anyio.lowlevel.checkpoint()
        while True:
            with self._lock:
                if self.try_put(sample):
                    return
                wake = self._writers.event()
            await wake.wait()

    async def get(self) -> Sample:
        """Read a sample, waiting for the watermark and for a sample.

        Cancelled while waiting, it has taken nothing.

        Raises:
            StreamEnded: the buffer is closed and drained.
        """
        await anyio.lowlevel.checkpoint()
        while True:
            with self._lock:
                sample = self.try_get()
                if sample is not None:
                    return sample
                wake = self._readers.event()
            await wake.wait()

    async def get_batch(self, n: int) -> list[Sample]:
        """``n`` reads in one synchronous step, once ``n`` samples are resident (and readable).

        After :meth:`close` it returns what is left when fewer (at least one sample).  FIFO
        and FIRO reads within a batch may repeat a sample when ``max_reads > 1``, like
        successive :meth:`get` calls.  Cancelled while waiting, it has taken nothing.

        Raises:
            ConfigurationError: ``n`` is not in ``1..capacity``.
            StreamEnded: the buffer is closed and drained.
        """
        owner = type(self).__name__
        check_int(owner, "n", n, 1)
        if n > self._capacity:
            msg = f"{owner}: get_batch(n={n}) can never be filled, capacity={self._capacity}"
            raise ConfigurationError(msg)
        await anyio.lowlevel.checkpoint()
        while True:
            with self._lock:
                if self._readable() and (len(self._resident) >= n or self._closed):
                    return self._take_many(n)
                if self.ended:
                    raise StreamEnded(f"{owner}: closed and drained, the stream is over")
                wake = self._readers.event()
            await wake.wait()

    def __aiter__(self) -> StreamBuffer:
        return self

    async def __anext__(self) -> Sample:
        """``async for sample in buffer``: :meth:`get` until the stream ends."""
        try:
            return await self.get()
        except StreamEnded:
            raise StopAsyncIteration from None

    # ----------------------------------------------------------------------------------------
    # Stats

    @property
    def policy(self) -> Policy:
        """Which sample a read returns, when it leaves, what a put into a full buffer does."""
        return self._policy

    @property
    def capacity(self) -> int:
        """The most samples held at once."""
        return self._capacity

    @property
    def watermark(self) -> int:
        """Reads wait until this many samples were received (or the stream was closed)."""
        return self._watermark

    @property
    def max_reads(self) -> int | None:
        """A sample leaves at its ``max_reads``-th read (``None``: never, reservoir only)."""
        return self._max_reads

    @property
    def fill(self) -> int:
        """The samples held now."""
        return len(self._resident)

    @property
    def received(self) -> int:
        """The samples put since the buffer was made."""
        return self._received

    @property
    def read_total(self) -> int:
        """The reads since the buffer was made (a sample read twice counts twice)."""
        return self._read_total

    @property
    def evicted(self) -> int:
        """The samples a reservoir evicted (FIFO and FIRO never evict)."""
        return self._evicted

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def ended(self) -> bool:
        """Closed and empty: every further read raises :class:`StreamEnded`."""
        with self._lock:
            return self._closed and not self._resident

    def last_seqs(self) -> dict[str, int]:
        """The largest ``seq`` put from each producer (kept in checkpoints): where a receiver
        restored with the buffer resumes each producer's stream."""
        with self._lock:
            return dict(self._last_seq)

    def seen_counts(self) -> dict[tuple[str, int], int]:
        """Each resident sample's key and how many times it was read, in buffer order."""
        with self._lock:
            return {slot.sample.key: slot.seen for slot in self._resident}

    def seen_histogram(self) -> dict[int, int]:
        """How many resident samples were read 0, 1, 2, ... times (only counts present), sorted."""
        with self._lock:
            return dict(sorted(Counter(slot.seen for slot in self._resident).items()))

    def stats(self) -> BufferStats:
        """The counters now, as one value (read under the lock: one state, whichever thread changes it)."""
        with self._lock:
            return BufferStats(
                policy=self._policy.name,
                capacity=self._capacity,
                fill=self.fill,
                received=self._received,
                read_total=self._read_total,
                evicted=self._evicted,
                closed=self._closed,
            )

    def __repr__(self) -> str:
        with self._lock:
            return (
                f"{type(self).__name__}(capacity={self._capacity}, watermark={self._watermark}, "
                f"max_reads={self._max_reads}, fill={self.fill}, received={self._received}, "
                f"closed={self._closed})"
            )

    # ----------------------------------------------------------------------------------------
    # Checkpoints

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The buffer's whole state: ``(tensors, meta)``, no pickle.

        ``tensors`` holds resident sample ``i``'s tensor ``name`` as ``f"s{i}.{name}"``
        (the samples' own tensors, detached, not copies), ``i`` in buffer order.  ``meta`` is
        JSON-ready (:class:`~lamploop.streaming.buffer_state.BufferState`): the format, policy
        and settings, the counters, the last ``seq`` put from each producer, each resident's
        ``producer``, ``seq``, ``seen`` and tensor names, and the generator's PCG64 state (its
        128-bit integers as decimal strings).
        """
        with self._lock:
            tensors, state = capture(self._settings, self.stats(), self._last_seq, self._resident, self._rng)
        return tensors, state.to_meta()

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` exactly (contents, seen counts, counters, generator).

        The buffer must have the saved policy, capacity, watermark and max_reads.  Waiting
        readers and writers are woken to look again.  A refused state changes nothing.

        Raises:
            CheckpointError: the state is malformed (naming the field), of another format,
                or of another buffer.
        """
        owner = type(self).__name__
        state = BufferState.from_meta(meta, owner=owner)
        slots, rng = restore(state, tensors, owner=owner, settings=self._settings)
        with self._lock:
            self._resident = self._policy.storage(slots)
            self._received, self._read_total = state.received, state.read_total
            self._evicted, self._closed = state.evicted, state.closed
            self._last_seq = dict(state.last_seq)
            self._rng = rng
            self._wake_readers()
            self._wake_writers()
