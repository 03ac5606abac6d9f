r"""Buffers between streaming producers and a trainer: FIFO, FIRO and Reservoir.

Producers (through a receiver) ``put`` :class:`~lamploop.streaming.sample.Sample`\ s into a
buffer; the trainer ``get``\ s them, while more arrive.  The three policies share one
interface (:class:`StreamBuffer`) and differ in which sample a read returns, whether it
leaves, and what a put into a full buffer does::

    FifoBuffer: first in, first out; a put into a full buffer waits (back-pressure)

        put s6 --> [ s5 s4 s3 s2 s1 ] --> get: s1
                     ^_______________|    read fewer than max_reads times: s1 goes back in
                                          at the tail (behind s6); else it leaves

    FiroBuffer: first in, random out; a put into a full buffer waits (back-pressure)

        put s6 --> [ s1 s2 s3 s4 s5 ] --> get: s3, drawn uniformly at random; it stays
                           ^ rng          until its max_reads-th read, then leaves

    ReservoirBuffer: samples stay; a put never waits

        put s6 --> [ s1 s2 s3 s4 s5 ]  full: a random resident (s3) is evicted
                   [ s1 s2 s6 s4 s5 ]  and s6 takes its slot
        get --> a uniformly random resident; it stays (max_reads=None, the default) or
                leaves at its max_reads-th read

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
``numpy.random.Generator(numpy.random.PCG64(seed))`` (FIFO makes none), in exactly this way,
with ``resident`` the buffer's slots in order (:meth:`StreamBuffer.seen_counts`' order):

* FIRO and Reservoir read: ``i = int(rng.integers(len(resident)))``; ``resident[i]`` is read
  (seen + 1); if it leaves, it is swap-removed: ``resident[i] = resident[-1]`` then
  ``resident.pop()`` (just ``pop()`` when ``i`` is the last slot).
* Reservoir put when ``len(resident) == capacity``: ``i = int(rng.integers(len(resident)))``;
  ``resident[i]`` is evicted and the new sample takes slot ``i``.  Otherwise a put appends.
* FIFO: a read pops ``resident[0]``; a sample that stays is appended at the end.

So the same sequence of puts and gets gives the same draws, and the generator's state is
part of :meth:`StreamBuffer.state_dict` (a restored buffer continues exactly like the
uninterrupted one).

Concurrency: the synchronous core (:meth:`~StreamBuffer.try_put`,
:meth:`~StreamBuffer.try_get`, :meth:`~StreamBuffer.close`) does all the work; the async
``put``/``get``/``get_batch`` loop over it and wait on one anyio event per direction.  No
threads.  A cancelled ``get`` loses no sample (a sample is taken only in a synchronous step
right before returning it), and a cancelled ``put`` puts nothing.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import attrs
import numpy as np
import torch

from lamploop.errors import (
    BufferClosedError,
    CheckpointError,
    ConfigurationError,
    DuplicateSampleError,
    StreamEnded,
)
from lamploop.streaming.sample import Sample

__all__ = [
    "BufferClosedError",
    "BufferStats",
    "DuplicateSampleError",
    "FifoBuffer",
    "FiroBuffer",
    "ReservoirBuffer",
    "StreamBuffer",
    "StreamEnded",
]

FORMAT = "lamploop.stream-buffer/1"

OnRead = Callable[[tuple[str, int], int], None]
"""``on_read(key, seen)``: a sample was read; ``seen`` counts this read."""

OnEvict = Callable[[tuple[str, int], int], None]
"""``on_evict(key, seen)``: a reservoir evicted a sample that had been read ``seen`` times."""


@attrs.frozen
class BufferStats:
    """A buffer's counters at one moment, for metrics.

    Attributes:
        policy: ``"fifo"``, ``"firo"`` or ``"reservoir"``.
        capacity: the most samples it holds.
        fill: the samples it holds now.
        received: the samples put since it was made.
        read_total: the reads since it was made (a sample read twice counts twice).
        evicted: the samples a reservoir evicted (always 0 for FIFO and FIRO).
        closed: whether the producers said they were done.
    """

    policy: str
    capacity: int
    fill: int
    received: int
    read_total: int
    evicted: int
    closed: bool


class _Slot:
    """A resident sample and how many times it was read."""

    __slots__ = ("sample", "seen")

    def __init__(self, sample: Sample, seen: int = 0) -> None:
        self.sample = sample
        self.seen = seen


def _check_int(owner: str, name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        msg = f"{owner}: {name} must be an int >= {minimum}, got {value!r}"
        raise ConfigurationError(msg)
    return value


class StreamBuffer(abc.ABC):
    """The interface the three buffers share; see the module docstring for the policies.

    Args:
        capacity: the most samples held at once (>= 1).
        watermark: reads wait until this many samples were received in all, or the
            stream was closed (``1 <= watermark <= capacity``).
        seed: seeds the buffer's ``numpy.random.Generator(PCG64(seed))`` (>= 0).
        max_reads: a sample leaves at its ``max_reads``-th read (>= 1; ``None``, unlimited,
            only for :class:`ReservoirBuffer`).
        on_read: called as ``on_read(key, seen)`` after each read (``seen`` includes it),
            e.g. to count every sample's reads; must not raise.
        on_evict: called as ``on_evict(key, seen)`` when a reservoir evicts a sample.
    """

    policy: ClassVar[str]
    _unlimited_reads: ClassVar[bool] = False

    def __init__(
        self,
        *,
        capacity: int,
        watermark: int,
        seed: int,
        max_reads: int | None,
        on_read: OnRead | None = None,
        on_evict: OnEvict | None = None,
    ) -> None:
        owner = type(self).__name__
        self._capacity = _check_int(owner, "capacity", capacity, 1)
        self._watermark = _check_int(owner, "watermark", watermark, 1)
        if watermark > capacity:
            msg = (
                f"{owner}: watermark={watermark} is above capacity={capacity}; reads would "
                "wait for more samples than the buffer can hold"
            )
            raise ConfigurationError(msg)
        _check_int(owner, "seed", seed, 0)
        if max_reads is None:
            if not self._unlimited_reads:
                msg = (
                    f"{owner}: max_reads=None (unlimited) is only for ReservoirBuffer; a FIFO "
                    "or FIRO sample must leave after some reads, or producers wait forever"
                )
                raise ConfigurationError(msg)
        else:
            _check_int(owner, "max_reads", max_reads, 1)
        self._max_reads = max_reads
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._on_read = on_read
        self._on_evict = on_evict
        self._received = 0
        self._read_total = 0
        self._evicted = 0
        self._closed = False
        self._last_seq: dict[str, int] = {}
        self._readers: anyio.Event | None = None  # set when a read may now succeed
        self._writers: anyio.Event | None = None  # set when a put may now succeed

    # ----------------------------------------------------------------------------------------
    # Policy hooks

    @abc.abstractmethod
    def _slots(self) -> MutableSequence[_Slot]:
        """The resident samples, in buffer order."""

    @abc.abstractmethod
    def _set_slots(self, slots: list[_Slot]) -> None:
        """Replace the resident samples (restoring a checkpoint)."""

    @abc.abstractmethod
    def _full(self) -> bool:
        """Whether a put must wait."""

    @abc.abstractmethod
    def _insert(self, slot: _Slot) -> None:
        """Take a new sample (room was checked by :meth:`_full`)."""

    @abc.abstractmethod
    def _read(self) -> tuple[_Slot, bool]:
        """Read one resident sample (there is one): its slot, and whether it left."""

    def _leaves(self, slot: _Slot) -> bool:
        return self._max_reads is not None and slot.seen >= self._max_reads

    # ----------------------------------------------------------------------------------------
    # Synchronous core

    def try_put(self, sample: Sample) -> bool:
        """Put ``sample`` if there is room now: ``True`` if taken, ``False`` if full (FIFO, FIRO).

        Raises:
            BufferClosedError: after :meth:`close`.
            DuplicateSampleError: ``sample.seq`` is not after the last one put from
                ``sample.producer``.
        """
        owner = type(self).__name__
        if self._closed:
            msg = f"{owner}: sample {sample.key} put after close(): the producers said they were done"
            raise BufferClosedError(msg)
        last = self._last_seq.get(sample.producer)
        if last is not None and sample.seq <= last:
            msg = (
                f"{owner}: sample {sample.key} refused: seq {sample.seq} is not after {last}, the "
                f"last one put from {sample.producer!r} (a resend the receiver should drop, or "
                "out of order)"
            )
            raise DuplicateSampleError(msg)
        if self._full():
            return False
        self._insert(_Slot(sample))
        self._last_seq[sample.producer] = sample.seq
        self._received += 1
        self._wake_readers()
        return True

    def try_put_many(self, samples: Sequence[Sample]) -> int:
        """Put ``samples`` in order while there is room: how many were taken (a prefix).

        Exactly like :meth:`try_put` on each in turn until one finds the buffer full (the same
        draws, the same state), but all checks come first: when it raises, nothing was taken.

        Raises:
            BufferClosedError: after :meth:`close` (and ``samples`` is not empty).
            DuplicateSampleError: a sample's ``seq`` is not after the last one put (or listed
                before it) from its producer.
        """
        owner = type(self).__name__
        if samples and self._closed:
            msg = f"{owner}: sample {samples[0].key} put after close(): the producers said they were done"
            raise BufferClosedError(msg)
        last: dict[str, int] = {}
        for sample in samples:
            previous = last.get(sample.producer, self._last_seq.get(sample.producer))
            if previous is not None and sample.seq <= previous:
                msg = (
                    f"{owner}: sample {sample.key} refused: seq {sample.seq} is not after {previous}, the "
                    f"last one put or listed before it from {sample.producer!r} (a resend the receiver "
                    "should drop, or out of order)"
                )
                raise DuplicateSampleError(msg)
            last[sample.producer] = sample.seq
        taken = 0
        for sample in samples:
            if self._full():
                break
            self._insert(_Slot(sample))
            self._last_seq[sample.producer] = sample.seq
            self._received += 1
            taken += 1
        if taken:
            self._wake_readers()
        return taken

    def try_get(self) -> Sample | None:
        """Read a sample if one is readable now, else ``None`` (watermark not reached, or empty).

        Raises:
            StreamEnded: the buffer is closed and empty.
        """
        slot = self._take()
        if slot is not None:
            return slot.sample
        if self.ended:
            raise StreamEnded(f"{type(self).__name__}: closed and drained, the stream is over")
        return None

    def close(self) -> None:
        """The producers are done: puts are refused, readers drain what is left.  Idempotent."""
        self._closed = True
        self._wake_readers()
        self._wake_writers()

    def _readable(self) -> bool:
        return len(self._slots()) > 0 and (self._received >= self._watermark or self._closed)

    def _take(self) -> _Slot | None:
        if not self._readable():
            return None
        slot, left = self._read()
        self._read_total += 1
        if left:
            self._wake_writers()
        if self._on_read is not None:
            self._on_read(slot.sample.key, slot.seen)
        return slot

    def _wake_readers(self) -> None:
        if self._readers is not None:
            self._readers.set()
            self._readers = None

    def _wake_writers(self) -> None:
        if self._writers is not None:
            self._writers.set()
            self._writers = None

    # ----------------------------------------------------------------------------------------
    # Async API

    async def put(self, sample: Sample) -> None:
        """Put ``sample``, waiting while a FIFO or FIRO buffer is full (back-pressure).

        Cancelled while waiting, it has put nothing.  Raises like :meth:`try_put`
        (:class:`BufferClosedError` also when the buffer is closed while it waits).
        """
        await anyio.lowlevel.checkpoint()
        while not self.try_put(sample):
            if self._writers is None:
                self._writers = anyio.Event()
            await self._writers.wait()

    async def get(self) -> Sample:
        """Read a sample, waiting for the watermark and for a sample.

        Cancelled while waiting, it has taken nothing.

        Raises:
            StreamEnded: the buffer is closed and drained.
        """
        await anyio.lowlevel.checkpoint()
        while True:
            sample = self.try_get()
            if sample is not None:
                return sample
            await self._wait_readers()

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
        _check_int(owner, "n", n, 1)
        if n > self._capacity:
            msg = f"{owner}: get_batch(n={n}) can never be filled, capacity={self._capacity}"
            raise ConfigurationError(msg)
        await anyio.lowlevel.checkpoint()
        while not (self._readable() and (len(self._slots()) >= n or self._closed)):
            if self.ended:
                raise StreamEnded(f"{owner}: closed and drained, the stream is over")
            await self._wait_readers()
        batch: list[Sample] = []
        while len(batch) < n and (slot := self._take()) is not None:
            batch.append(slot.sample)
        return batch

    async def _wait_readers(self) -> None:
        if self._readers is None:
            self._readers = anyio.Event()
        await self._readers.wait()

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
        return len(self._slots())

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
        return self._closed and not self._slots()

    def last_seqs(self) -> dict[str, int]:
        """The largest ``seq`` put from each producer (kept in checkpoints): where a receiver
        restored with the buffer resumes each producer's stream."""
        return dict(self._last_seq)

    def seen_counts(self) -> dict[tuple[str, int], int]:
        """Each resident sample's key and how many times it was read, in buffer order."""
        return {slot.sample.key: slot.seen for slot in self._slots()}

    def seen_histogram(self) -> dict[int, int]:
        """How many resident samples were read 0, 1, 2, ... times (only counts present), sorted."""
        histogram: dict[int, int] = {}
        for slot in self._slots():
            histogram[slot.seen] = histogram.get(slot.seen, 0) + 1
        return dict(sorted(histogram.items()))

    def stats(self) -> BufferStats:
        """The counters now, as one value."""
        return BufferStats(
            policy=self.policy,
            capacity=self._capacity,
            fill=self.fill,
            received=self._received,
            read_total=self._read_total,
            evicted=self._evicted,
            closed=self._closed,
        )

    def __repr__(self) -> str:
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
        JSON-ready: the format, policy and settings, the counters, the last ``seq`` put from
        each producer, each resident's ``producer``, ``seq``, ``seen`` and tensor names, and
        the generator's PCG64 state (its 128-bit integers as decimal strings).
        """
        tensors: dict[str, torch.Tensor] = {}
        samples: list[dict[str, Any]] = []
        for i, slot in enumerate(self._slots()):
            names = list(slot.sample.tensors)
            for name in names:
                tensors[f"s{i}.{name}"] = slot.sample.tensors[name].detach()
            samples.append(
                {
                    "producer": slot.sample.producer,
                    "seq": slot.sample.seq,
                    "seen": slot.seen,
                    "tensors": names,
                }
            )
        rng = self._rng.bit_generator.state
        meta: dict[str, Any] = {
            "format": FORMAT,
            "policy": self.policy,
            "capacity": self._capacity,
            "watermark": self._watermark,
            "max_reads": self._max_reads,
            "received": self._received,
            "read_total": self._read_total,
            "evicted": self._evicted,
            "closed": self._closed,
            "last_seq": dict(self._last_seq),
            "samples": samples,
            "rng": {
                "bit_generator": rng["bit_generator"],
                "state": str(rng["state"]["state"]),
                "inc": str(rng["state"]["inc"]),
                "has_uint32": int(rng["has_uint32"]),
                "uinteger": int(rng["uinteger"]),
            },
        }
        return tensors, meta

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` exactly (contents, seen counts, counters, generator).

        The buffer must have the saved policy, capacity, watermark and max_reads.  Waiting
        readers and writers are woken to look again.

        Raises:
            CheckpointError: the state is malformed, of another format, or of another buffer.
        """
        owner = type(self).__name__
        try:
            parsed = self._parse_state(tensors, meta)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            msg = f"{owner}: malformed buffer state ({type(e).__name__}: {e})"
            raise CheckpointError(msg) from e
        slots, counters, last_seq, rng = parsed
        self._set_slots(slots)
        self._received, self._read_total, self._evicted, self._closed = counters
        self._last_seq = last_seq
        self._rng = rng
        self._wake_readers()
        self._wake_writers()

    def _parse_state(
        self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
    ) -> tuple[list[_Slot], tuple[int, int, int, bool], dict[str, int], np.random.Generator]:
        owner = type(self).__name__

        def fail(what: str) -> CheckpointError:
            return CheckpointError(f"{owner}: cannot restore buffer state: {what}")

        def integer(value: Any, what: str) -> int:
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise fail(f"{what} is {value!r}, not an int >= 0")
            return value

        if meta.get("format") != FORMAT:
            raise fail(f"format {meta.get('format')!r}, expected {FORMAT!r}")
        saved = {k: meta[k] for k in ("policy", "capacity", "watermark", "max_reads")}
        mine = {
            "policy": self.policy,
            "capacity": self._capacity,
            "watermark": self._watermark,
            "max_reads": self._max_reads,
        }
        for key, value in saved.items():
            if value != mine[key]:
                raise fail(f"it is of a buffer with {key}={value!r}, this one has {key}={mine[key]!r}")
        counters = (
            integer(meta["received"], "received"),
            integer(meta["read_total"], "read_total"),
            integer(meta["evicted"], "evicted"),
            bool(meta["closed"]),
        )
        last_seq = {str(p): integer(s, f"last_seq[{p!r}]") for p, s in dict(meta["last_seq"]).items()}
        slots: list[_Slot] = []
        expected: set[str] = set()
        for i, record in enumerate(meta["samples"]):
            seen = integer(record["seen"], f"samples[{i}].seen")
            if self._max_reads is not None and seen >= self._max_reads:
                raise fail(f"samples[{i}] was read {seen} times, max_reads={self._max_reads}")
            names = [str(name) for name in record["tensors"]]
            missing = [f"s{i}.{name}" for name in names if f"s{i}.{name}" not in tensors]
            if missing:
                raise fail(f"tensors {missing} are missing")
            expected.update(f"s{i}.{name}" for name in names)
            sample = Sample(
                producer=str(record["producer"]),
                seq=integer(record["seq"], f"samples[{i}].seq"),
                tensors={name: tensors[f"s{i}.{name}"] for name in names},
            )
            slots.append(_Slot(sample, seen))
        if len(slots) > self._capacity:
            raise fail(f"it holds {len(slots)} samples, capacity={self._capacity}")
        extra = sorted(set(tensors) - expected)
        if extra:
            raise fail(f"unexpected tensors {extra[:5]}")
        record = meta["rng"]
        if record["bit_generator"] != "PCG64":
            raise fail(f"generator {record['bit_generator']!r}, expected 'PCG64'")
        bit_generator = np.random.PCG64()
        bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": int(record["state"]), "inc": int(record["inc"])},
            "has_uint32": integer(record["has_uint32"], "rng.has_uint32"),
            "uinteger": integer(record["uinteger"], "rng.uinteger"),
        }
        return slots, counters, last_seq, np.random.Generator(bit_generator)


class FifoBuffer(StreamBuffer):
    """First in, first out: reads come in arrival order; a put into a full buffer waits.

    With ``max_reads > 1``, a read sample that stays goes back in at the tail (behind the
    samples that arrived meanwhile) until its ``max_reads``-th read.  FIFO draws nothing
    random; ``seed`` is accepted for a uniform constructor.

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

    policy: ClassVar[str] = "fifo"

    def __init__(
        self,
        *,
        capacity: int,
        watermark: int,
        seed: int = 0,
        max_reads: int = 1,
        on_read: OnRead | None = None,
        on_evict: OnEvict | None = None,
    ) -> None:
        super().__init__(
            capacity=capacity,
            watermark=watermark,
            seed=seed,
            max_reads=max_reads,
            on_read=on_read,
            on_evict=on_evict,
        )
        self._queue: deque[_Slot] = deque()

    def _slots(self) -> MutableSequence[_Slot]:
        return self._queue

    def _set_slots(self, slots: list[_Slot]) -> None:
        self._queue = deque(slots)

    def _full(self) -> bool:
        return len(self._queue) >= self._capacity

    def _insert(self, slot: _Slot) -> None:
        self._queue.append(slot)

    def _read(self) -> tuple[_Slot, bool]:
        slot = self._queue.popleft()
        slot.seen += 1
        left = self._leaves(slot)
        if not left:
            self._queue.append(slot)
        return slot, left


class _RandomOut(StreamBuffer):
    """Reads a uniformly random resident; one that leaves is swap-removed."""

    def __init__(
        self,
        *,
        capacity: int,
        watermark: int,
        seed: int,
        max_reads: int | None,
        on_read: OnRead | None,
        on_evict: OnEvict | None,
    ) -> None:
        super().__init__(
            capacity=capacity,
            watermark=watermark,
            seed=seed,
            max_reads=max_reads,
            on_read=on_read,
            on_evict=on_evict,
        )
        self._list: list[_Slot] = []

    def _slots(self) -> MutableSequence[_Slot]:
        return self._list

    def _set_slots(self, slots: list[_Slot]) -> None:
        self._list = list(slots)

    def _read(self) -> tuple[_Slot, bool]:
        i = int(self._rng.integers(len(self._list)))
        slot = self._list[i]
        slot.seen += 1
        left = self._leaves(slot)
        if left:
            last = self._list.pop()
            if i < len(self._list):
                self._list[i] = last
        return slot, left


class FiroBuffer(_RandomOut):
    """First in, random out: a read draws a uniformly random resident; a full buffer's put waits.

    The drawn sample leaves at its ``max_reads``-th read (``max_reads > 1``: pseudo-epochs,
    every sample is read exactly that many times before the stream ends).

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

    policy: ClassVar[str] = "firo"

    def __init__(
        self,
        *,
        capacity: int,
        watermark: int,
        seed: int,
        max_reads: int = 1,
        on_read: OnRead | None = None,
        on_evict: OnEvict | None = None,
    ) -> None:
        super().__init__(
            capacity=capacity,
            watermark=watermark,
            seed=seed,
            max_reads=max_reads,
            on_read=on_read,
            on_evict=on_evict,
        )

    def _full(self) -> bool:
        return len(self._list) >= self._capacity

    def _insert(self, slot: _Slot) -> None:
        self._list.append(slot)


class ReservoirBuffer(_RandomOut):
    """Samples stay after being read; a put into a full reservoir evicts a random resident.

    Producers never wait.  A read draws a uniformly random resident, which stays unless it
    was read ``max_reads`` times (``None``, the default: never).  After :meth:`close` each
    read removes its sample, so a drain ends.

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

    policy: ClassVar[str] = "reservoir"
    _unlimited_reads: ClassVar[bool] = True

    def __init__(
        self,
        *,
        capacity: int,
        watermark: int,
        seed: int,
        max_reads: int | None = None,
        on_read: OnRead | None = None,
        on_evict: OnEvict | None = None,
    ) -> None:
        super().__init__(
            capacity=capacity,
            watermark=watermark,
            seed=seed,
            max_reads=max_reads,
            on_read=on_read,
            on_evict=on_evict,
        )

    def _full(self) -> bool:
        return False

    def _insert(self, slot: _Slot) -> None:
        if len(self._list) < self._capacity:
            self._list.append(slot)
            return
        i = int(self._rng.integers(len(self._list)))
        old = self._list[i]
        self._list[i] = slot
        self._evicted += 1
        if self._on_evict is not None:
            self._on_evict(old.sample.key, old.seen)

    def _leaves(self, slot: _Slot) -> bool:
        return self._closed or super()._leaves(slot)
