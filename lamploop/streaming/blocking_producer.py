"""The blocking producer: :class:`~lamploop.streaming.async_producer.AsyncProducer` for synchronous code.

A simulation's thread sends samples; an event loop on a thread of its own (a blocking portal)
keeps the connection and takes the samples a chunk at a time.  :mod:`lamploop.streaming.producer`
describes the producers as a whole.

.. versionadded:: 0.3
   split from :mod:`lamploop.streaming.producer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import torch

from lamploop.errors import StreamingError, TransportError
from lamploop.streaming.async_producer import HANDOVER_BYTES, HANDOVER_SAMPLES, AsyncProducer, ProducerStats
from lamploop.streaming.tensor_bytes import check_samples
from lamploop.streaming.wire import encode_rows, encode_tensors

__all__ = ["BLOCKING_AHEAD", "BLOCKING_AHEAD_BYTES", "HANDOVER_DELAY_S", "BlockingProducer"]

logger = logging.getLogger("lamploop.streaming")

HANDOVER_DELAY_S = 0.002
"""A :class:`BlockingProducer` hands the samples sent on the caller's thread to its event loop in
chunks: at once when :data:`~lamploop.streaming.async_producer.HANDOVER_SAMPLES` samples or
:data:`~lamploop.streaming.async_producer.HANDOVER_BYTES` bytes wait, else 2 ms after the first
of them was sent."""

BLOCKING_AHEAD = 4 * HANDOVER_SAMPLES
BLOCKING_AHEAD_BYTES = 4 * HANDOVER_BYTES
"""A :class:`BlockingProducer`'s :meth:`~BlockingProducer.send` waits while this many samples
(or, with the next one, more than this many bytes: 4 MiB) sent on the caller's thread are not
kept by the producer yet (its resend window is full): with the window, they bound the memory a
simulation's samples take."""

_WAIT_SLICE_S = 0.05
"""The longest single wait of a blocking producer's caller for its event loop (a failure is noticed
by then even if nothing wakes the caller)."""


class _Abandoned(Exception):
    """The blocking producer's block ended with an error: leave without done() (internal)."""


class BlockingProducer:
    """:class:`AsyncProducer` for synchronous code: the same arguments, without ``await``.

    ``with BlockingProducer(address, name=..., token=...) as producer:`` starts an event
    loop on a thread of its own (:func:`anyio.from_thread.start_blocking_portal`), which keeps
    the connection while the caller computes.  :meth:`send` encodes the sample on the
    caller's thread and puts it with the ones sent before it, without waiting for the loop; the
    loop takes them in chunks (at once when :data:`HANDOVER_SAMPLES` samples or
    :data:`HANDOVER_BYTES` bytes wait, else :data:`HANDOVER_DELAY_S` after the first of them), so
    that the caller and the loop meet once a chunk, not once a sample.  :meth:`flush` hands over
    at once what waits.  Past :data:`BLOCKING_AHEAD` samples (or :data:`BLOCKING_AHEAD_BYTES`)
    not kept by the loop yet (its resend window is full: the receiver takes nothing), ``send``
    waits.  Leaving the block normally calls :meth:`done`; a failure in the background is raised
    by the next :meth:`send`, :meth:`flush` or :meth:`done`, or on leaving: a receiver that is
    gone fails the producer ``reconnect_timeout`` seconds after it was last reached, also while
    samples sent wait for room in the window.  A block that ends with an exception leaves
    without waiting for them (they are dropped, as unacknowledged samples are).  One thread at
    a time may use it; not for use from inside an event loop (use :class:`AsyncProducer` there).
    """

    def __init__(self, address: tuple[str, int], *, name: str, token: bytes | str, **options: Any) -> None:
        self._producer = AsyncProducer(address, name=name, token=token, **options)
        self._portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._hosting: Future[None] | None = None
        self._leave: anyio.Event | None = None
        self._abandon = False
        self._next_seq = self._producer.next_seq
        # What the caller's thread and the loop's share, under _lock:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # the loop kept samples, or failed
        self._inbox: list[bytes] = []  # sent, not taken by the loop yet: seqs _inbox_seq, ...
        self._inbox_seq = self._next_seq
        self._inbox_bytes = 0
        self._inbox_since = 0.0  # when the first of them was sent (time.monotonic)
        self._poked = self._urgent = False  # the loop was told that samples wait / that a chunk is full
        self._looking = False  # the loop looks at the inbox every HANDOVER_DELAY_S: no poke needed
        self._in_hand = self._in_hand_bytes = 0  # taken by the loop, not kept yet (the window is full)
        self._error: BaseException | None = None  # the loop's, raised to the caller
        self._wake: anyio.Event | None = None  # the loop's side of a poke (made on the loop)
        self._loop: asyncio.AbstractEventLoop | None = None  # the portal's, when asyncio

    @property
    def name(self) -> str:
        return self._producer.name

    @property
    def next_seq(self) -> int:
        """The seq the next sample gets."""
        return self._next_seq

    @property
    def acknowledged_seq(self) -> int:
        """The highest seq the receiver holds with every one before it (as far as this producer knows)."""
        return self._producer.acknowledged_seq

    @property
    def stats(self) -> ProducerStats:
        """What was sent so far."""
        return self._producer.stats

    def __enter__(self) -> BlockingProducer:
        if self._portal_cm is not None:
            msg = f"producer {self.name!r} can be entered only once"
            raise StreamingError(msg)
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        portal = self._portal = self._portal_cm.__enter__()
        try:
            self._leave = portal.call(anyio.Event)
            self._hosting, _ = portal.start_task(self._host)
        except BaseException:
            self._portal_cm.__exit__(*sys.exc_info())
            raise
        return self

    async def _host(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """The async producer's block, on the portal's loop, until the blocking block ends."""
        assert self._leave is not None
        self._wake = anyio.Event()
        with contextlib.suppress(RuntimeError):  # asyncio, the portal's backend (else: portal tasks)
            self._loop = asyncio.get_running_loop()
        try:
            async with self._producer:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._collect)
                    task_status.started()
                    await self._leave.wait()
                    tg.cancel_scope.cancel()  # idle when leaving normally: the caller waited for it
                if self._abandon and self._producer._sup.failure is None:  # else leaving raises it
                    raise _Abandoned
        except _Abandoned:
            pass

    async def _collect(self) -> None:
        """The loop's side: take the samples the caller sent, a chunk at a time, and keep them."""
        try:
            while True:
                assert self._wake is not None
                await self._wake.wait()  # the caller sent a sample while the loop did not look
                self._wake = anyio.Event()
                # While samples come, look again every HANDOVER_DELAY_S (or at once when a chunk
                # is full: the caller pokes again), without the caller poking for each chunk.
                while True:
                    with self._lock:
                        since = self._inbox_since if self._inbox else time.monotonic()
                        delay = 0.0 if self._urgent else since + HANDOVER_DELAY_S - time.monotonic()
                    if delay > 0:
                        with anyio.move_on_after(delay):
                            await self._wake.wait()
                        self._wake = anyio.Event()
                    with self._lock:
                        chunk, first = self._inbox, self._inbox_seq
                        self._inbox = []
                        self._inbox_seq += len(chunk)
                        self._in_hand, self._in_hand_bytes = len(chunk), self._inbox_bytes
                        self._inbox_bytes = 0
                        self._poked = self._urgent = False
                        self._looking = bool(chunk)  # else the next sample pokes
                    if not chunk:
                        break
                    await self._keep_chunk(chunk, first)
        except Exception as exc:  # the producer failed, or a bug: the caller raises it
            with self._lock:
                if self._error is None:
                    self._error = exc
        finally:
            with self._lock:
                self._changed.notify_all()

    async def _keep_chunk(self, chunk: list[bytes], first: int) -> None:
        done = 0

        def kept(count: int) -> None:  # runs of them kept: the caller may send more
            nonlocal done
            size = sum(len(payload) for payload in chunk[done : done + count])
            done += count
            with self._lock:
                self._in_hand -= count
                self._in_hand_bytes -= size
                self._changed.notify_all()

        await self._producer._submit_many(chunk, first, on_kept=kept)

    def _poke(self) -> None:
        """Tell the loop that samples wait (from the caller's thread).

        With the portal's asyncio loop, a callback scheduled from this thread (a few µs); a
        portal task would cost some 45 µs.
        """
        with contextlib.suppress(RuntimeError):  # the loop stopped: the next wait raises why
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._set_wake)
            elif self._portal is not None:
                self._portal.start_task_soon(self._set_wake_async)

    def _set_wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _set_wake_async(self) -> None:
        self._set_wake()

    def _raise_locked(self, what: str) -> None:
        """Raise the loop's failure, if any (the caller holds _lock)."""
        if self._error is not None:
            raise self._error
        self._producer._sup.raise_failure()
        if self._producer._done_requested:
            msg = f"producer {self.name!r}: {what} after done()"
            raise StreamingError(msg)
        hosting = self._hosting
        if hosting is not None and hosting.done():
            failure = None if hosting.cancelled() else hosting.exception()
            if failure is not None:
                raise failure
            msg = f"producer {self.name!r}: its event loop ended"
            raise StreamingError(msg)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        portal, hosting, leave = self._portal, self._hosting, self._leave
        if self._portal_cm is None or portal is None or hosting is None or leave is None:
            return
        try:
            # Whatever happens here, the hosting task is told to leave before the portal is
            # joined: the join waits for it (a failure raised by a waiting send once skipped
            # this, and a simulation whose trainer was gone never exited).
            abandon = exc is not None
            try:
                if not abandon:
                    self._settle("leaving the block")  # raises a failure (within reconnect_timeout)
            except BaseException:
                abandon = True
                raise
            finally:
                self._abandon = abandon
                if abandon:  # samples not kept yet are dropped, not waited for (a full window)
                    self._drop()
                if not hosting.done():
                    portal.call(leave.set)
            try:
                hosting.result()  # raises the producer's failure; done() first when leaving normally
            except TransportError as failure:
                if exc is None:
                    raise
                if failure is not exc:  # not the failure the block's send() raised already
                    logger.warning("producer %r failed too", self.name, exc_info=True)
        except TransportError:
            raise  # the hosting task was told to leave, and leaves at once: the producer failed
        except BaseException:
            # Interrupted while waiting (KeyboardInterrupt...): nothing is waited for any more,
            # so that joining the portal is quick.
            hosting.cancel()
            self._drop()
            raise
        finally:
            self._portal_cm.__exit__(None, None, None)
            self._portal = None

    def _drop(self) -> None:
        """Forget the samples not taken by the loop yet (leaving on an error)."""
        with self._lock:
            self._inbox = []
            self._inbox_bytes = 0
            self._poked = self._urgent = False
            self._changed.notify_all()

    def _portal_or_fail(self, what: str) -> anyio.from_thread.BlockingPortal:
        if self._portal is None:
            msg = f"producer {self.name!r}: {what} outside `with`"
            raise StreamingError(msg)
        return self._portal

    def _settle(self, what: str) -> None:
        """Hand over what waits at once, and wait until the loop kept it; raise the first error.

        Every wait is a slice of :data:`_WAIT_SLICE_S`: the loop's failure (a receiver unreachable
        for ``reconnect_timeout``) ends it, even if nothing wakes this thread.
        """
        poke = False
        with self._lock:
            if self._inbox and not self._urgent:
                self._urgent = poke = True
        if poke:
            self._poke()
        with self._lock:
            while self._inbox or self._in_hand:
                self._raise_locked(what)
                self._changed.wait(_WAIT_SLICE_S)
            if self._error is not None:
                raise self._error
            self._producer._sup.raise_failure()

    def send(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """As :meth:`AsyncProducer.send`: the sample's seq.

        The sample is encoded (copied) on this thread before it returns, and handed to the loop
        with the ones sent around it; it waits while :data:`BLOCKING_AHEAD` samples (or
        :data:`BLOCKING_AHEAD_BYTES`) sent are not kept yet (the window is full).
        """
        self._check_sending()
        payload = encode_tensors(tensors)  # on this thread, in parallel with the loop's work
        self._check_size(payload, self._next_seq)
        return self._hand_over(payload)

    def send_many(self, samples: Iterable[Mapping[str, torch.Tensor]]) -> list[int]:
        """:meth:`send` each of ``samples``, in order; their seqs."""
        check_samples(samples)
        return [self.send(tensors) for tensors in samples]

    def send_rows(self, columns: Mapping[str, torch.Tensor]) -> list[int]:
        """As :meth:`AsyncProducer.send_rows`: each row of ``columns`` sent as a sample, in order;
        their seqs.

        Every row is encoded (copied) on this thread before the first is handed over, then each
        is handed over as :meth:`send` hands over a sample (the same waits; failing part of the
        way, the rows before are sent).

        .. versionadded:: 0.3
        """
        self._check_sending()
        payloads = encode_rows(columns)
        if payloads:  # the rows are alike: the last seq's frame header is the longest
            self._check_size(payloads[0], self._next_seq + len(payloads) - 1)
        return [self._hand_over(payload) for payload in payloads]

    def _check_sending(self) -> None:
        """Raise what a send raises now: not entered, failed, or done."""
        producer = self._producer
        if self._portal is None:
            self._portal_or_fail("send()")
        if self._error is not None or producer._sup.failure is not None or producer._done_requested:
            with self._lock:
                self._raise_locked("send()")

    def _check_size(self, payload: bytes, seq: int) -> None:
        """Raise FrameError if ``payload``'s frame as sample ``seq`` is over ``max_frame_bytes``."""
        box = self._producer._outbox
        if box.header_bound + len(payload) + 7 > box.max_frame_bytes:  # else surely under it
            box.check_size(seq, payload)

    def _hand_over(self, payload: bytes) -> int:
        """Put an encoded sample with the ones for the loop to take; its seq.  Waits while
        :data:`BLOCKING_AHEAD` samples (or bytes) wait for the loop."""
        producer = self._producer
        size = len(payload)
        poke = False
        with self._lock:
            while (self._inbox or self._in_hand) and (
                len(self._inbox) + self._in_hand >= BLOCKING_AHEAD
                or self._inbox_bytes + self._in_hand_bytes + size > BLOCKING_AHEAD_BYTES
            ):
                self._raise_locked("send()")
                self._changed.wait(_WAIT_SLICE_S)
            if self._error is not None or producer._sup.failure is not None:
                self._raise_locked("send()")
            seq = self._next_seq
            inbox = self._inbox
            inbox.append(payload)
            self._inbox_bytes += size
            self._next_seq = seq + 1
            if len(inbox) == 1:  # the first one since the loop last took them
                self._inbox_since = time.monotonic()
                if not self._looking and not self._poked:
                    self._poked = poke = True
            if not self._urgent and (len(inbox) >= HANDOVER_SAMPLES or self._inbox_bytes >= HANDOVER_BYTES):
                self._urgent = poke = True  # a chunk's worth: at once
        if poke:
            self._poke()
        return seq

    def flush(self) -> None:
        """Hand the samples sent so far to the loop now, and wait until it kept them (it sends
        them, and resends them if need be); waits while the window is full, as :meth:`send`.

        Raises:
            StreamingError: the producer failed, is done, or is not entered.
        """
        self._portal_or_fail("flush()")
        self._settle("flush()")

    def done(self) -> None:
        """As :meth:`AsyncProducer.done` (what was sent is handed over first)."""
        portal = self._portal_or_fail("done()")
        self._settle("done()")
        portal.call(self._producer.done)
