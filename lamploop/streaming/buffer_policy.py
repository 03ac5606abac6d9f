r"""Buffer policies: the four decisions that make a :class:`~lamploop.streaming.buffers.StreamBuffer`
a FIFO, a FIRO or a reservoir.

A policy decides, and the buffer does everything else (limits, counters, waits, checkpoints):

* **full**: whether a put into the buffer must wait (FIFO, FIRO: when ``capacity`` samples are
  resident) or never does (reservoir);
* **insert**: where a new sample goes (at the end; a full reservoir evicts a random resident);
* **pick**: which resident a read returns (the first; or one drawn at random);
* **leaves**: whether a read sample leaves, and where one that stays goes (FIFO: back in at
  the tail; the random policies: it keeps its slot, one that leaves is swap-removed).

::

    FifoPolicy: first in, first out; a put into a full buffer waits (back-pressure)

        put s6 --> [ s5 s4 s3 s2 s1 ] --> get: s1
                     ^_______________|    read fewer than max_reads times: s1 goes back in
                                          at the tail (behind s6); else it leaves

    FiroPolicy: first in, random out; a put into a full buffer waits (back-pressure)

        put s6 --> [ s1 s2 s3 s4 s5 ] --> get: s3, drawn uniformly at random; it stays
                           ^ rng          until its max_reads-th read, then leaves

    ReservoirPolicy: samples stay; a put never waits

        put s6 --> [ s1 s2 s3 s4 s5 ]  full: a random resident (s3) is evicted
                   [ s1 s2 s6 s4 s5 ]  and s6 takes its slot
        get --> a uniformly random resident; it stays (max_reads=None, the default) or
                leaves at its max_reads-th read; after close() every read leaves

The draws, exactly (a buffer's restored checkpoint continues them bit for bit), with
``rng`` the buffer's ``numpy.random.Generator(numpy.random.PCG64(seed))`` and ``resident``
its slots in order (:meth:`~lamploop.streaming.buffers.StreamBuffer.seen_counts`' order):

* FIRO and reservoir read: ``i = int(rng.integers(len(resident)))``; ``resident[i]`` is read
  (seen + 1); if it leaves, it is swap-removed: ``resident[i] = resident[-1]`` then
  ``resident.pop()`` (just ``pop()`` when ``i`` is the last slot).
* Reservoir put when ``len(resident) == capacity``: ``i = int(rng.integers(len(resident)))``;
  ``resident[i]`` is evicted and the new sample takes slot ``i``.  Otherwise a put appends.
* FIFO: a read takes ``resident[0]``; a sample that stays is appended at the end.  No draws.

A policy holds no state of its own (the buffer passes it the slots and the generator), so one
policy object may serve many buffers, and two equal policies are interchangeable.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Iterable, MutableSequence, Sequence
from typing import ClassVar

import numpy as np

from lamploop.streaming.sample import Sample

__all__ = ["FifoPolicy", "FiroPolicy", "Policy", "ReservoirPolicy", "Slot"]


class Slot:
    """A resident sample and how many times it was read (its *seen* count)."""

    __slots__ = ("sample", "seen")

    def __init__(self, sample: Sample, seen: int = 0) -> None:
        self.sample = sample
        self.seen = seen

    def __repr__(self) -> str:
        return f"Slot({self.sample.key}, seen={self.seen})"


class Policy(abc.ABC):
    """What a buffer does when full, where a put goes, which sample a read picks, when it leaves.

    A subclass names itself and says which resident a read picks (:meth:`pick`) and where a
    read sample goes (:meth:`after_read`); by default a put into a buffer at capacity waits,
    a put goes at the end, and a sample leaves at its ``max_reads``-th read.

    The buffer alone calls the methods, in this order: :meth:`full` then :meth:`insert` for
    a put; :meth:`pick`, then (after the seen count went up) :meth:`leaves`, then
    :meth:`after_read` for a read.  ``slots`` is the buffer's storage, made by
    :meth:`storage`; a policy changes it only in :meth:`insert` and :meth:`after_read`.

    Attributes:
        name: the policy's name in stats and checkpoints (``"fifo"``, ``"firo"``,
            ``"reservoir"``).
        draws: whether it draws from the buffer's generator (a buffer of a policy that draws
            needs a ``seed``; one that does not defaults it to 0).
        default_max_reads: a buffer's ``max_reads`` when none is given.
        unlimited_reads: whether ``max_reads=None`` (samples never leave by reads) is allowed:
            only where puts never wait, else producers would wait forever.
    """

    name: ClassVar[str]
    draws: ClassVar[bool] = True
    default_max_reads: ClassVar[int | None] = 1
    unlimited_reads: ClassVar[bool] = False

    def storage(self, slots: Iterable[Slot] = ()) -> MutableSequence[Slot]:
        """A new container of ``slots`` for the buffer (a list: indexing is O(1))."""
        return list(slots)

    def full(self, fill: int, capacity: int) -> bool:
        """Whether a put into a buffer holding ``fill`` samples must wait: at ``capacity``."""
        return fill >= capacity

    def insert(
        self, slots: MutableSequence[Slot], slot: Slot, capacity: int, rng: np.random.Generator
    ) -> Slot | None:
        """Put ``slot`` into ``slots`` (:meth:`full` said there is room): the slot it evicted, or ``None``.

        At the end, evicting nothing.
        """
        slots.append(slot)
        return None

    @abc.abstractmethod
    def pick(self, slots: MutableSequence[Slot], rng: np.random.Generator) -> int:
        """The index of the resident the next read returns (``slots`` is not empty)."""

    def leaves(self, seen: int, max_reads: int | None, closed: bool) -> bool:
        """Whether a sample just read for the ``seen``-th time leaves: at its ``max_reads``-th read."""
        return max_reads is not None and seen >= max_reads

    @abc.abstractmethod
    def after_read(self, slots: MutableSequence[Slot], index: int, left: bool) -> None:
        """Move the sample just read at ``index``: out of ``slots`` if it ``left``, else where it stays."""

    def insert_many(
        self, slots: MutableSequence[Slot], samples: Sequence[Sample], capacity: int, rng: np.random.Generator
    ) -> tuple[int, list[Slot]]:
        """Put ``samples`` in order while :meth:`full` says there is room: how many were taken,
        and the slots they evicted (in order).

        Exactly :meth:`full` then :meth:`insert` for each in turn (a subclass may do it faster,
        with the same result): the buffer calls this for a run of puts.
        """
        taken = 0
        evicted: list[Slot] = []
        for sample in samples:
            if self.full(len(slots), capacity):
                break
            old = self.insert(slots, Slot(sample), capacity, rng)
            if old is not None:
                evicted.append(old)
            taken += 1
        return taken, evicted

    def read_many(
        self,
        slots: MutableSequence[Slot],
        n: int,
        rng: np.random.Generator,
        max_reads: int | None,
        closed: bool,
    ) -> tuple[list[Slot], bool]:
        """Up to ``n`` reads in a row (fewer when ``slots`` empties): the slots read, in order
        (each one's ``seen`` counts its reads so far), and whether any read sample left.

        Exactly :meth:`pick`, :meth:`leaves` and :meth:`after_read` for each read in turn (a
        subclass may do it faster, with the same result and the same draws).
        """
        read: list[Slot] = []
        any_left = False
        while len(read) < n and slots:
            index = self.pick(slots, rng)
            slot = slots[index]
            slot.seen += 1
            left = self.leaves(slot.seen, max_reads, closed)
            self.after_read(slots, index, left)
            any_left = any_left or left
            read.append(slot)
        return read, any_left

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FifoPolicy(Policy):
    """First in, first out: a read takes the oldest resident; one that stays goes back in at the tail.

    A put into a full buffer waits.  No draws.
    """

    name: ClassVar[str] = "fifo"
    draws: ClassVar[bool] = False

    def storage(self, slots: Iterable[Slot] = ()) -> MutableSequence[Slot]:
        """A deque: reads take from the front, puts and re-queued samples go to the back."""
        return deque(slots)

    def pick(self, slots: MutableSequence[Slot], rng: np.random.Generator) -> int:
        """The front: the sample that waited longest for this read."""
        return 0

    def after_read(self, slots: MutableSequence[Slot], index: int, left: bool) -> None:
        """Out of the front; a sample that stays goes back in at the tail, behind newer ones."""
        slot = slots[index]
        del slots[index]
        if not left:
            slots.append(slot)

    def insert_many(
        self, slots: MutableSequence[Slot], samples: Sequence[Sample], capacity: int, rng: np.random.Generator
    ) -> tuple[int, list[Slot]]:
        """As many as there is room for, appended at once (the stream's hot path: a frame's samples)."""
        if type(self).full is not Policy.full or type(self).insert is not Policy.insert:
            return super().insert_many(slots, samples, capacity, rng)  # a subclass decides
        taken = min(max(capacity - len(slots), 0), len(samples))
        slots.extend(map(Slot, samples[:taken]))
        return taken, []

    def read_many(
        self,
        slots: MutableSequence[Slot],
        n: int,
        rng: np.random.Generator,
        max_reads: int | None,
        closed: bool,
    ) -> tuple[list[Slot], bool]:
        """A sample read once and leaving at its first read (``max_reads=1``, the default): the
        first ``n`` taken off the front at once (the stream's hot path: a batch)."""
        if max_reads != 1 or type(self).leaves is not Policy.leaves or not isinstance(slots, deque):
            return super().read_many(slots, n, rng, max_reads, closed)  # reads that may stay
        read = [slots.popleft() for _ in range(min(n, len(slots)))]
        for slot in read:
            slot.seen += 1
        return read, bool(read)


class _RandomOut(Policy):
    """Reads a uniformly random resident; one that leaves is swap-removed, one that stays keeps its slot."""

    def pick(self, slots: MutableSequence[Slot], rng: np.random.Generator) -> int:
        """``int(rng.integers(len(slots)))``."""
        return int(rng.integers(len(slots)))

    def after_read(self, slots: MutableSequence[Slot], index: int, left: bool) -> None:
        """A sample that leaves is swap-removed (the last slot's sample takes its place)."""
        if left:
            last = slots.pop()
            if index < len(slots):
                slots[index] = last


class FiroPolicy(_RandomOut):
    """First in, random out: a read draws a uniformly random resident; a full buffer's put waits."""

    name: ClassVar[str] = "firo"


class ReservoirPolicy(_RandomOut):
    """Samples stay after being read; a put into a full reservoir evicts a random resident.

    A read draws a uniformly random resident, which stays unless it was read ``max_reads``
    times (``None``, the default: never).  After the buffer is closed every read leaves, so
    a drain ends.
    """

    name: ClassVar[str] = "reservoir"
    default_max_reads: ClassVar[int | None] = None
    unlimited_reads: ClassVar[bool] = True

    def full(self, fill: int, capacity: int) -> bool:
        """Never: producers do not wait."""
        return False

    def insert(
        self, slots: MutableSequence[Slot], slot: Slot, capacity: int, rng: np.random.Generator
    ) -> Slot | None:
        """At the end while there is room; then into a random resident's slot, evicting it."""
        if len(slots) < capacity:
            slots.append(slot)
            return None
        i = int(rng.integers(len(slots)))
        old = slots[i]
        slots[i] = slot
        return old

    def leaves(self, seen: int, max_reads: int | None, closed: bool) -> bool:
        """At its ``max_reads``-th read, or at any read once the buffer is closed."""
        return closed or super().leaves(seen, max_reads, closed)
