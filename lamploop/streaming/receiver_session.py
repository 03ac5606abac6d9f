"""One producer's session on a sample receiver: its samples into the sink, then acknowledged.

:class:`~lamploop.streaming.receiver.SampleReceiver` is the server: it listens, runs the
handshake, hands producers out and welcomes each; then a :class:`ProducerSession` takes over
the producer's connection.  It puts every new sample into the sink *before* acknowledging it
(an acknowledged sample is in the sink, so nothing acknowledged is ever lost), drops the
samples the receiver holds already (counted), refuses one that would leave a gap, and
acknowledges cumulatively: at least every ``ack_every`` samples, when the producer's stream
pauses (at most every 5 ms), and within 5 ms of any put.  What every session shares (what is
held per producer, who is done or refused for good, the stream's first sample, the counts) is
the receiver's :class:`Intake`.

.. versionadded:: 0.3
   split from :mod:`lamploop.streaming.receiver`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import repeat

import anyio
import attrs

from lamploop.errors import BufferClosedError, FrameError, StreamingError, TransportError
from lamploop.streaming.sample import Sample, SampleSink
from lamploop.streaming.tensor_bytes import Signature, describe_mismatch, signature_of
from lamploop.streaming.wire import Ack, Done, FramedStream, SamplesFrame, encode_frame
from lamploop.transport.connection import explain

__all__ = ["IngestStats", "Intake", "ProducerSession"]

logger = logging.getLogger("lamploop.streaming")

_ACK_DELAY = 0.005
"""Seconds after a put within which it is acknowledged, even if the next put waits; also the
least time between two acknowledgements sent because the producer's stream paused (each ack
is a system call that wakes the producer: one per frame cost more than the frame's decoding)."""


@attrs.frozen
class IngestStats:
    """What a receiver took in so far.

    Attributes:
        samples: samples put into the sink.
        bytes: their frames' bytes on the wire.
        duplicates: samples dropped because the receiver already held them.
        put_seconds: time spent awaiting ``sink.put`` (the back-pressure of the sink).
        max_put_seconds: the longest single ``sink.put``.
        refusals: connections refused (strangers, producers that broke the protocol or sent a
            sample unlike the stream's, and samples after the buffer closed: see ``refusals``).
    """

    samples: int
    bytes: int
    duplicates: int
    put_seconds: float
    max_put_seconds: float
    refusals: int


@attrs.define
class _Acks:
    """What was acknowledged to one producer's connection, and a wake-up for the delayed ack."""

    sent: int
    at: float = -math.inf  # when the last one was sent (anyio's clock)
    lock: anyio.Lock = attrs.field(factory=anyio.Lock)
    wake: anyio.Event = attrs.field(factory=anyio.Event)


class Intake:
    """What a receiver took in, shared by its producers' sessions.

    Args:
        sink: where the samples go; a ``try_put_many`` of its (a buffer's) takes runs at once.
        acknowledged: per producer, the highest seq held with every one before it.
        done: the producers that sent Done.
        uniform: every sample must match the stream's first (names, dtypes, shapes).
        on_change: called when a producer is done or refused for good.
        on_failure: called with the error when the sink's put fails (the receiver fails).

    Attributes:
        acked, done, refused: per producer, the highest seq held; the producers done; the
            producers refused for good, and why.
        reference: the stream's first sample: its producer, seq and signature.
        samples, bytes, duplicates, put_seconds, max_put_seconds: see :class:`IngestStats`.
    """

    def __init__(
        self,
        sink: SampleSink,
        *,
        acknowledged: Mapping[str, int],
        done: Iterable[str],
        uniform: bool,
        on_change: Callable[[], None],
        on_failure: Callable[[StreamingError], None],
    ) -> None:
        self.sink = sink
        try_put_many = getattr(sink, "try_put_many", None)
        self.try_put_many: Callable[[Sequence[Sample]], int] | None = (
            try_put_many if callable(try_put_many) else None
        )
        self.acked: dict[str, int] = dict(acknowledged)
        self.done: set[str] = set(done)
        self.refused: dict[str, str] = {}
        self.uniform = uniform
        self.reference: tuple[str, int, Signature] | None = None
        self.samples = self.bytes = self.duplicates = 0
        self.put_seconds = self.max_put_seconds = 0.0
        self._on_change = on_change
        self._on_failure = on_failure

    def stats(self, refusals: int) -> IngestStats:
        """What was taken in so far (``refusals``: the receiver's count)."""
        return IngestStats(
            samples=self.samples,
            bytes=self.bytes,
            duplicates=self.duplicates,
            put_seconds=self.put_seconds,
            max_put_seconds=self.max_put_seconds,
            refusals=refusals,
        )

    def finished(self, name: str) -> bool:
        """Record that ``name`` sent Done; whether that is news."""
        if name in self.done:
            return False
        self.done.add(name)
        self._on_change()
        return True

    def refuse_for_good(self, name: str, reason: str) -> None:
        """Refuse ``name`` for good (a sample unlike the stream's): it counts as ended."""
        self.refused[name] = reason
        self._on_change()

    def check_samples(self, name: str, batch: SamplesFrame, start: int) -> tuple[int, str | None]:
        """The index of the batch's first sample from ``start`` on that does not match the stream's
        first sample (its length if none), and why it does not (``None`` if none)."""
        if not self.uniform:
            return len(batch.samples), None
        signatures = batch.signatures
        if len(signatures) != len(batch.samples):  # not decoded from bytes (made by hand)
            signatures = tuple(signature_of(tensors) for tensors in batch.samples)
        if self.reference is None:
            self.reference = (name, batch.first_seq + start, signatures[start])
        expected = self.reference[2]
        for index in range(start, len(signatures)):
            signature = signatures[index]
            if signature is expected:  # the usual case: samples of one header share one object
                continue
            mismatch = describe_mismatch(signature, expected)
            if mismatch is None:
                continue
            owner, seq = self.reference[:2]
            reason = (
                f"sample seq {batch.first_seq + index} does not match the stream's samples: {mismatch[1]} "
                f"(as in its first sample, seq {seq} of producer {owner!r:.100}); refused: the samples of "
                "a batch are stacked, so they need the same tensors, dtypes and shapes "
                "(SampleReceiver(uniform_samples=False) takes samples that differ)"
            )
            return index, reason
        return len(signatures), None

    async def put_batch(
        self, name: str, batch: SamplesFrame, skip: int, stop: int, nbytes: int, acks: _Acks
    ) -> bool | str:
        """Put the batch's samples from index ``skip`` to ``stop`` into the sink, in order, and
        count them; ``False`` if the sink failed (the receiver fails), why the producer is refused
        if the sink is a closed buffer (the trainer takes no more samples), else ``True``.

        A sink with ``try_put_many`` (a buffer) takes what it has room for in one synchronous
        step; a sample it has no room for goes through ``put`` (which waits), then the rest again.
        """
        first = batch.first_seq
        begin = max(skip, 0)
        seqs = range(first + begin, first + stop)
        samples = list(map(Sample, repeat(name), seqs, batch.samples[begin:stop]))
        share = nbytes / len(batch.samples)
        done = 0
        while done < len(samples):
            started = time.perf_counter()
            try:
                if self.try_put_many is not None and (taken := self.try_put_many(samples[done:])):
                    pass
                else:
                    if done:  # what was put is acknowledged soon, even if this put waits long
                        acks.wake.set()
                    await self.sink.put(samples[done])
                    taken = 1
            except BufferClosedError:  # the producers were declared done: this one is refused, not the run
                key = samples[done].key
                return (
                    f"sample seq {key[1]} arrived after the trainer closed its buffer (its producers were "
                    "declared done): it takes no more samples"
                )
            except Exception as exc:  # the sink is the owner's code: its failure ends the receiver
                key = samples[done].key
                error = StreamingError(f"the sink's put failed for sample {key}: {explain(exc)}")
                error.__cause__ = exc
                self._on_failure(error)
                return False
            elapsed = time.perf_counter() - started
            done += taken
            self.acked[name] = samples[done - 1].seq
            self.samples += taken
            self.bytes += round(share * taken)
            self.put_seconds += elapsed
            self.max_put_seconds = max(self.max_put_seconds, elapsed)
        return True


class ProducerSession:
    """Serves one welcomed producer's connection (see the module): :meth:`run` until it leaves.

    Args:
        conn: the connection, past the handshake (its decoder knows the producer).
        name: the producer's name.
        intake: the receiver's :class:`Intake`.
        idle_timeout: the connection silent this long is closed; also bounds each ack sent.
        ack_every: acknowledge at least every this many samples.
    """

    def __init__(
        self, conn: FramedStream, name: str, intake: Intake, *, idle_timeout: float, ack_every: int
    ) -> None:
        self.conn = conn
        self.name = name
        self.intake = intake
        self.idle_timeout = idle_timeout
        self.ack_every = ack_every

    async def run(self) -> str | None:
        """Take samples until the producer leaves; why it broke the protocol, or ``None``."""
        conn, name = self.conn, self.name
        conn.receive_into_frames()  # a producer's frames are up to 2 MiB: read into their runs
        acks = _Acks(sent=self.intake.acked.get(name, -1))
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._ack_soon, conn, name, acks)
            reason = await self._read_samples(conn, name, acks)
            tg.cancel_scope.cancel()
        return reason

    async def _read_samples(self, conn: FramedStream, name: str, acks: _Acks) -> str | None:
        # One scope bounds every wait for the producer's next frame (its deadline set before
        # the wait, lifted after: a put may wait long); a fail_after per frame cost ~5% here.
        with anyio.CancelScope() as idle:
            return await self._read_frames(conn, name, acks, idle)
        logger.info("producer %r (%s) silent for %g s: closed", name, conn.peer, self.idle_timeout)
        return None

    async def _read_frames(
        self, conn: FramedStream, name: str, acks: _Acks, idle: anyio.CancelScope
    ) -> str | None:
        """Take the producer's frames until it leaves: why it broke the protocol, or ``None``.

        Each batch drops the samples the receiver holds already, puts the rest (via the
        intake, checked against the stream's first sample) and is acknowledged every
        ``ack_every`` samples or when the stream pauses; a Done is acknowledged at once.
        ``None`` also when the connection is lost or closed, or the sink failed (the
        receiver fails then).  ``idle``'s deadline bounds each wait for a frame.
        """
        since_ack = 0
        done = False
        while True:
            try:
                if conn.has_pending:  # already here: no wait to bound
                    message = await conn.receive()
                else:
                    idle.deadline = anyio.current_time() + self.idle_timeout
                    message = await conn.receive()
                    idle.deadline = math.inf
            except FrameError as exc:
                return str(exc)
            except TransportError as exc:
                level = logging.DEBUG if done else logging.INFO  # after Done, the producer just leaves
                logger.log(level, "producer %r (%s) is gone: %s", name, conn.peer, exc)
                return None
            if message is None:
                logger.debug("producer %r (%s) closed its connection", name, conn.peer)
                return None
            acked = self.intake.acked.get(name, -1)
            if isinstance(message, SamplesFrame):
                if done:
                    return f"sample seq {message.first_seq} after Done"
                if message.first_seq > acked + 1:
                    return f"sample seq {message.first_seq} leaves a gap: the receiver holds up to {acked}"
                held = acked + 1 - message.first_seq  # resent samples the receiver holds: dropped
                if held > 0:
                    self.intake.duplicates += min(held, len(message.samples))
                size, count = conn.last_frame_bytes, len(message.samples)
                if held < count:
                    stop, unlike = self.intake.check_samples(name, message, max(held, 0))
                    put = await self.intake.put_batch(name, message, held, stop, size, acks)
                    if put is False:
                        return None  # the sink failed: so does the receiver
                    if isinstance(put, str):
                        return put
                    if unlike is not None:  # refused for good; what came before it is acknowledged
                        await self._ack(conn, name, acks, force=True)
                        self.intake.refuse_for_good(name, unlike)
                        return unlike
                since_ack += len(message.samples)
                paused = not conn.has_pending and anyio.current_time() - acks.at >= _ACK_DELAY
                if since_ack >= self.ack_every or paused:
                    if not await self._ack(conn, name, acks, force=True):
                        return None
                    since_ack = 0
                elif held < count:  # put and not acknowledged yet: within _ACK_DELAY, by _ack_soon
                    acks.wake.set()
            elif isinstance(message, Done):
                if message.last_seq > acked:
                    return f"Done after seq {message.last_seq}, but the receiver holds up to {acked}"
                done = True
                if self.intake.finished(name):
                    logger.info("producer %r is done (last seq %d)", name, message.last_seq)
                if not await self._ack(conn, name, acks, done=True):
                    return None
                since_ack = 0
            else:
                return f"sent a {type(message).__name__} message after the handshake"

    async def _ack_soon(self, conn: FramedStream, name: str, acks: _Acks) -> None:
        """Acknowledge within :data:`_ACK_DELAY` of a put, when no batch or idle stream did."""
        while True:
            await acks.wake.wait()
            await anyio.sleep(_ACK_DELAY)
            acks.wake = anyio.Event()
            if not await self._ack(conn, name, acks):
                return

    async def _ack(
        self, conn: FramedStream, name: str, acks: _Acks, *, force: bool = False, done: bool = False
    ) -> bool:
        """Send Ack (or Done) with what is in the sink, unless it was said already; ``False`` if gone."""
        async with acks.lock:
            upto = self.intake.acked.get(name, -1)
            if not (force or done) and upto <= acks.sent:
                return True
            acks.sent, acks.at = upto, anyio.current_time()
            message = Done(upto) if done else Ack(upto)
            try:
                with anyio.fail_after(self.idle_timeout):
                    await conn.send(encode_frame(message))
            except (TimeoutError, TransportError) as exc:
                logger.info("producer %r (%s) is gone: %s", name, conn.peer, exc)
                return False
            return True
