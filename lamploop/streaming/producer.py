"""The producers' end of the streaming transport: send samples to a trainer, resend what it did not take.

:class:`AsyncProducer` numbers the samples it is given (seq 0, 1, 2, ... from
``start_seq``), keeps each until the receiver acknowledges it, and holds the caller back
(``send`` waits) when ``resend_window`` samples are unacknowledged.  When the connection
drops it reconnects with backoff, and the receiver's Welcome says which seq it holds up
to: everything after it is resent, in order.  :class:`BlockingProducer` is the same for
plain (synchronous) simulation codes: it runs an event loop on a thread of its own
(:func:`anyio.from_thread.start_blocking_portal`), to which the caller's thread hands its
samples a chunk at a time.  Samples sent in a row leave in batches (one ``"samples"`` frame
of up to 32 samples or 2 MiB, within the receiver's frame limit).

A producer knows one address.  When the trainer has several ranks, the receiver there may
answer with a :class:`~lamploop.streaming.wire.Redirect` to the rank's receiver assigned to
this producer: the producer connects there and goes on (and comes back to the first address
whenever the assigned one cannot be reached).

A producer whose process was killed and restarted may simply start again from 0: the
receiver drops every sample at or below what it already holds, by seq (the producer learns
that number in the Welcome and does not even send those).  This assumes the restarted
producer makes the same samples in the same order, as a deterministic simulation does.  Or
it may be given ``start_seq=``: the first seq the receiver had not acknowledged (say a saved
:attr:`AsyncProducer.acknowledged_seq` + 1); a later one would leave a gap, which the
receiver refuses, and the producer fails saying which seqs are missing.

.. versionadded:: 0.2
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import attrs
import torch

from lamploop.control import _tls as tls
from lamploop.control._connection import explain
from lamploop.control._settings import check_int, check_seconds
from lamploop.control._supervisor import Supervisor
from lamploop.control.wire import new_nonce, proof_matches
from lamploop.errors import (
    ConfigurationError,
    ControlChannelError,
    FrameError,
    HandshakeError,
    StreamingError,
)
from lamploop.streaming.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_SAMPLES_PER_FRAME,
    MAX_SEQ,
    PREAUTH_FRAME_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Challenge,
    Done,
    FramedStream,
    Hello,
    Redirect,
    Refuse,
    Welcome,
    check_producer_name,
    check_token,
    encode_frame,
    encode_tensors,
    producer_proof,
    receiver_proof,
    redirect_proof,
    samples_frame,
    samples_frame_bytes,
)

__all__ = [
    "BLOCKING_AHEAD",
    "BLOCKING_AHEAD_BYTES",
    "HANDOVER_BYTES",
    "HANDOVER_DELAY_S",
    "HANDOVER_SAMPLES",
    "AsyncProducer",
    "BlockingProducer",
    "ProducerStats",
]

logger = logging.getLogger("lamploop.streaming")

_WRITE_BATCH_BYTES = 256 * 1024
_WRITE_BATCH_SAMPLES = 32
_WRITE_MAX_BYTES = 2 * 1024 * 1024
"""A batch frame is cut once it holds 256 KiB of samples and at least 32 samples, or 2 MiB: a
frame's fixed costs (some 100-200 µs of Python at the receiver, whatever its size) spread over
many samples, also large ones (the receiver copies a frame of more than 8 samples in runs of 8,
so that a sample it keeps holds no more than its run's memory)."""

HANDOVER_SAMPLES = 64
HANDOVER_BYTES = 1024 * 1024
HANDOVER_DELAY_S = 0.002
"""A :class:`BlockingProducer` hands the samples sent on the caller's thread to its event loop in
chunks: at once when 64 samples or 1 MiB wait, else 2 ms after the first of them was sent."""

BLOCKING_AHEAD = 4 * HANDOVER_SAMPLES
BLOCKING_AHEAD_BYTES = 4 * HANDOVER_BYTES
"""A :class:`BlockingProducer`'s :meth:`~BlockingProducer.send` waits while this many samples
(or bytes: 4 MiB) sent on the caller's thread are not kept by the producer yet (its resend
window is full): with the window, they bound the memory a simulation's samples take."""

_WAIT_SLICE_S = 0.05
"""The longest single wait of a blocking producer's caller for its event loop (a failure is noticed
by then even if nothing wakes the caller)."""
_FIRST_BACKOFF, _MAX_BACKOFF = 0.05, 1.0


@attrs.frozen
class ProducerStats:
    """What a producer did so far.

    Attributes:
        sent: sample frames sent for the first time.
        resent: sample frames sent again after a reconnection.
        skipped: samples not sent because the receiver already held them (a restarted producer).
        connections: connections made (the first, then one per reconnection).
    """

    sent: int
    resent: int
    skipped: int
    connections: int


def _frame_full(count: int, size: int, more: int = 0) -> bool:
    """Whether a frame of ``count`` samples of ``size`` bytes is cut before ``more`` bytes."""
    total = size + more
    return total > _WRITE_BATCH_BYTES and (count >= _WRITE_BATCH_SAMPLES or total > _WRITE_MAX_BYTES)


class _Signal:
    """Wakes up every task waiting for "something changed" (one event loop, no lock needed)."""

    def __init__(self) -> None:
        self._event: anyio.Event | None = None  # made by the first waiter: notify() is per sample

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        if self._event is None:
            self._event = anyio.Event()
        await self._event.wait()


class _Retry(Exception):
    """The connection was lost or could not be made; try again (internal)."""


class _Redirected(Exception):
    """The receiver sent this producer to another one (internal)."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(f"{host}:{port}")
        self.address = (host, port)


@attrs.define
class _Session:
    """One connection's progress: the highest seq sent on it, whether Done was sent."""

    sent: int
    done_sent: bool = False


class AsyncProducer:
    """Streams samples to a :class:`~lamploop.streaming.receiver.SampleReceiver`; an async context manager.

    ``async with AsyncProducer(receiver_address, name="sim-3", token=...) as producer:`` then
    ``await producer.send({"x": x, "y": y})`` for each sample and ``await producer.done()``
    at the end (leaving the block normally calls it too).  The connection is made in the
    background, and made again when it drops.  A failure that cannot be retried (a wrong
    token, a receiver that refuses this producer, one unreachable for ``reconnect_timeout``)
    is raised by the :meth:`send` or :meth:`done` that waits, or else cancels the block's
    body and is raised when it ends.

    Args:
        address: the receiver's ``(host, port)`` (:attr:`SampleReceiver.address`).
        name: this producer's name, unique among the run's producers (1 to 200 bytes).
        token: the secret shared with the receiver.
        resend_window: unacknowledged samples kept for resending; :meth:`send` waits while
            this many are unacknowledged (back-pressure: the receiver's sink is full).
        keep_acknowledged: acknowledged samples also kept (the last ones), so that a receiver
            restored from a checkpoint older than its acknowledgements gets them again.
        start_seq: the first sample's seq: 0, or for a restarted producer the first seq not
            acknowledged before (0 works too: what the receiver holds is skipped).
        max_frame_bytes: the largest frame sent (a sample's tensors plus about 100 bytes).
        reconnect_timeout: seconds to keep trying to reach the receiver before failing.
        handshake_timeout: seconds the receiver may take to answer, once connected.
        ack_timeout: a connection on which sent samples wait this long without any
            acknowledgement is dropped and made again.
        ssl_context: TLS (a client context trusting the receiver's certificate); ``None``: no TLS.

    Raises:
        ConfigurationError: an argument is out of range.
    """

    def __init__(
        self,
        address: tuple[str, int],
        *,
        name: str,
        token: bytes | str,
        resend_window: int = 64,
        keep_acknowledged: int = 0,
        start_seq: int = 0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        reconnect_timeout: float = 300.0,
        handshake_timeout: float = 10.0,
        ack_timeout: float = 300.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        reason = check_producer_name(name)
        if reason is not None:
            raise ConfigurationError(f"name: {reason}")
        if not (isinstance(address, tuple) and len(address) == 2 and isinstance(address[0], str)):
            msg = f"address must be a (host, port) tuple, got {address!r:.80}"
            raise ConfigurationError(msg)
        check_int("port", address[1], 1, 65535)
        self._token = check_token(token)
        check_int("resend_window", resend_window, 1)
        check_int("keep_acknowledged", keep_acknowledged, 0)
        check_int("start_seq", start_seq, 0, MAX_SEQ)
        check_int("max_frame_bytes", max_frame_bytes, PREAUTH_FRAME_BYTES)
        check_seconds(
            reconnect_timeout=reconnect_timeout, handshake_timeout=handshake_timeout, ack_timeout=ack_timeout
        )
        self.name = name
        self._root = address  # the one address known; redirects lead elsewhere
        self._host, self._port = address  # where the next connection goes
        self._receiver_limit = max_frame_bytes  # the smaller of ours and the receiver's Welcome's
        # A batch's header takes at most 100 bytes, 6 per byte of the name (JSON escapes), 21 per size.
        self._header_bound = 100 + 6 * len(name.encode()) + 21
        self._window = resend_window
        self._keep_acknowledged = keep_acknowledged
        self._max_frame_bytes = max_frame_bytes
        self._reconnect_timeout = reconnect_timeout
        self._handshake_timeout = handshake_timeout
        self._ack_timeout = ack_timeout
        self._tls = tls.check_context("ssl_context", ssl_context, server_side=False)
        self._sup = Supervisor(on_failure=self._wake_up)
        self._changed = _Signal()
        self._send_lock = anyio.Lock()
        self._queued = 0  # senders waiting for room in the window
        # (seq, payload), contiguous seqs: the acknowledged ones kept, then the unacknowledged ones
        self._frames: deque[tuple[int, bytes]] = deque()
        self._next_seq = start_seq
        self._acked = start_seq - 1
        self._highest_sent = start_seq - 1
        self._entered = self._closed = False
        self._done_requested = self._finished = False
        self._sent = self._resent = self._skipped = self._connections = 0
        self._unsent = self._unsent_bytes = 0  # kept since the writer last took a batch: when to yield
        self._writer_idle = False  # the writer waits for samples

    # -- what the owner reads --

    @property
    def next_seq(self) -> int:
        """The seq the next sample gets."""
        return self._next_seq

    @property
    def acknowledged_seq(self) -> int:
        """The highest seq the receiver holds with every one before it (as far as this producer knows)."""
        return self._acked

    @property
    def unacknowledged(self) -> int:
        """Samples kept until the receiver acknowledges them."""
        if not self._frames:
            return 0
        first, last = self._frames[0][0], self._frames[-1][0]
        return max(last - max(self._acked, first - 1), 0)

    @property
    def stats(self) -> ProducerStats:
        """What was sent so far."""
        return ProducerStats(self._sent, self._resent, self._skipped, self._connections)

    @property
    def receiver_address(self) -> tuple[str, int]:
        """Where the producer connects now: the address it was given, or the one a redirect named."""
        return (self._host, self._port)

    @property
    def _receiver(self) -> str:
        return f"the receiver at {self._host}:{self._port}"

    # -- sending --

    async def send(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Queue one sample (its named tensors) for the receiver; its seq.

        Returns once the sample is kept for sending: waits while ``resend_window`` samples
        are unacknowledged.  The tensors are copied (encoded) before it returns.  It yields to
        other tasks (and can be cancelled, taking nothing) when it waits, and when a frame's
        worth of samples (256 KiB and 32 samples, or half of ``resend_window``) waits for
        the connection's writer while that writer is idle; the samples in between are kept
        without a task switch (while the writer sends, at most ``resend_window`` of them).

        Raises:
            TypeError, ValueError: ``tensors`` is not a non-empty mapping of str to tensors.
            FrameError: the sample's frame would be over ``max_frame_bytes``.
            StreamingError: the producer failed (see the class), is done, or is not entered.
        """
        return await self._submit(encode_tensors(tensors))

    def _check_size(self, seq: int, payload: bytes) -> None:
        """Raise FrameError if the frame of ``payload`` alone would be over ``max_frame_bytes``."""
        if self._header_bound + len(payload) + 7 <= self._max_frame_bytes:  # the usual case, at once
            return
        size = samples_frame_bytes(self.name, seq, [len(payload)]) - 4
        if size > self._max_frame_bytes:
            msg = f"a samples frame of {size} bytes is over the limit of {self._max_frame_bytes} bytes"
            raise FrameError(msg)

    async def _submit(self, payload: bytes, expected_seq: int | None = None) -> int:
        """Keep ``payload`` as the next seq's sample once the window has room; the seq."""
        self._check_open("send()")
        # Kept without switching tasks, so that samples sent in a row leave in one frame when
        # the caller next waits; but once a frame's worth (or half the window) waits for an idle
        # writer, the writer gets its turn first, so that the receiver takes a batch while the
        # caller makes the next one, instead of both waiting in turn for a full window.  Only
        # then is send() a checkpoint (a cancellation point): anyio's checkpoints cost more than
        # the rest of a send (and while the writer sends, yielding to it would gain nothing).
        if self._queued == 0 and self._has_room() and self._writer_due():
            await anyio.lowlevel.checkpoint()  # cancelled here, the sample is not taken
            self._check_open("send()")
        if self._queued == 0 and self._has_room():
            return self._keep(payload, expected_seq)
        self._queued += 1  # no sender overtakes this one by the path above
        try:
            async with self._send_lock:
                with self._sup.waiting():
                    while not self._has_room():
                        self._sup.raise_failure()
                        await self._changed.wait()
                self._check_open("send()")
                return self._keep(payload, expected_seq)
        finally:
            self._queued -= 1

    async def send_many(self, samples: Iterable[Mapping[str, torch.Tensor]]) -> list[int]:
        """:meth:`send` each of ``samples`` (each a mapping of names to tensors), in order; their seqs.

        The same as a loop of :meth:`send` (the same waits and errors), with fewer task switches:
        the samples are encoded and kept a chunk at a time (64 samples or 1 MiB).  Cancelled or
        failing part of the way, it has kept the samples before the one it stopped at
        (:attr:`next_seq` tells how many).
        """
        seqs: list[int] = []
        chunk: list[bytes] = []
        size = 0
        for tensors in samples:
            self._check_open("send()")
            payload = encode_tensors(tensors)
            self._check_size(self._next_seq, payload)
            chunk.append(payload)
            size += len(payload)
            if len(chunk) >= HANDOVER_SAMPLES or size >= HANDOVER_BYTES:
                first = await self._submit_many(chunk)
                seqs.extend(range(first, first + len(chunk)))
                chunk, size = [], 0
        if chunk:
            first = await self._submit_many(chunk)
            seqs.extend(range(first, first + len(chunk)))
        return seqs

    async def _submit_many(
        self,
        payloads: Sequence[bytes],
        first_seq: int | None = None,
        on_kept: Callable[[int], None] | None = None,
    ) -> int:
        """Keep ``payloads`` (their sizes checked: :meth:`_check_size`) as the next seqs, in order,
        each once the window has room; the first one's seq.

        What fits is kept at once, without switching tasks (but an idle writer gets its turn once
        a frame's worth waits); ``on_kept(n)`` is told after each run of ``n`` kept.  Cancelled
        while waiting, the samples not kept yet are not taken.
        """
        self._check_open("send()")
        index = 0
        self._queued += 1  # no sender overtakes these by _submit's path
        try:
            async with self._send_lock:
                first = self._next_seq
                while index < len(payloads):
                    if not self._has_room():
                        with self._sup.waiting():
                            while not self._has_room():
                                self._sup.raise_failure()
                                await self._changed.wait()
                        self._check_open("send()")
                    expected = None if first_seq is None else first_seq + index
                    if self._next_seq <= self._acked:  # held by the receiver already: one by one
                        self._keep(payloads[index], expected)
                        stop = index + 1
                    else:
                        stop = min(len(payloads), index + self._window - self.unacknowledged)
                        self._keep_run(payloads[index:stop], expected)
                    if on_kept is not None:
                        on_kept(stop - index)
                    index = stop
                    if self._writer_due():
                        await anyio.lowlevel.checkpoint()  # the writer takes a frame
                        self._check_open("send()")
        finally:
            self._queued -= 1
        return first

    def _writer_due(self) -> bool:
        """Whether the writer waits for samples and a frame's worth waits for it (while it sends,
        or with no connection, a sender's yielding would only cost a loop iteration per sample)."""
        return self._writer_idle and (
            _frame_full(self._unsent, self._unsent_bytes) or self._unsent * 2 >= self._window
        )

    def _has_room(self) -> bool:
        return self._next_seq <= self._acked or self.unacknowledged < self._window

    def _keep(self, payload: bytes, expected_seq: int | None) -> int:
        """Number the sample and keep it for the writer (or skip it if the receiver holds it)."""
        seq = self._next_seq
        if expected_seq is not None and expected_seq != seq:  # only after an earlier send failed
            msg = f"producer {self.name!r}: sample {expected_seq} would go out as {seq}"
            raise StreamingError(msg)
        self._check_size(seq, payload)  # raises FrameError over the limit: the seq is not taken
        if seq <= self._acked:  # the receiver holds it already (a restarted producer)
            if self._keep_acknowledged:
                # Kept like any acknowledged sample, so that the kept seqs stay contiguous (the
                # writer finds a seq at its offset from the first) and a receiver restored from
                # an older state can get it again.
                self._frames.append((seq, payload))
                self._trim()
            self._next_seq += 1
            self._skipped += 1
            return seq
        self._next_seq += 1
        self._frames.append((seq, payload))
        self._unsent_bytes += len(payload)
        self._unsent += 1
        self._changed.notify()
        return seq

    def _keep_run(self, payloads: Sequence[bytes], expected_seq: int | None) -> None:
        """:meth:`_keep` each of ``payloads`` (sizes checked, room in the window, none held by the
        receiver), in one step."""
        seq = self._next_seq
        if expected_seq is not None and expected_seq != seq:  # only after an earlier send failed
            msg = f"producer {self.name!r}: sample {expected_seq} would go out as {seq}"
            raise StreamingError(msg)
        self._next_seq = seq + len(payloads)
        self._frames.extend(zip(range(seq, self._next_seq), payloads, strict=True))
        self._unsent_bytes += sum(map(len, payloads))
        self._unsent += len(payloads)
        self._changed.notify()

    async def done(self) -> None:
        """Send Done once every sample is sent, and wait until the receiver acknowledged them all.

        Raises:
            StreamingError: the producer failed (see the class) or is not entered.
        """
        self._check_open("done()", after_done=True)
        self._done_requested = True
        self._changed.notify()
        with self._sup.waiting():
            while not self._finished:
                self._sup.raise_failure()
                await self._changed.wait()

    def _check_open(self, what: str, *, after_done: bool = False) -> None:
        self._sup.raise_failure()
        if not self._entered or self._closed:
            msg = f"producer {self.name!r}: {what} outside `async with`"
            raise StreamingError(msg)
        if self._done_requested and not after_done:
            msg = f"producer {self.name!r}: {what} after done()"
            raise StreamingError(msg)

    def _wake_up(self) -> None:
        self._changed.notify()

    # -- life --

    async def __aenter__(self) -> AsyncProducer:
        if self._entered:
            msg = f"producer {self.name!r} can be entered only once"
            raise StreamingError(msg)
        self._entered = True
        await self._sup.enter()
        self._sup.tg.start_soon(self._run)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        flushing: BaseException | None = None
        if exc is None and not self._done_requested and self._sup.failure is None:
            try:
                await self.done()  # leaving normally: deliver everything first
            except ControlChannelError:
                pass  # the supervisor's failure: close() raises it
            except BaseException as error:  # cancelled while flushing
                flushing = error
        elif exc is not None and self.unacknowledged:
            logger.warning(
                "producer %r left with %d unacknowledged samples (from seq %d)",
                self.name,
                self.unacknowledged,
                self._acked + 1,
            )
        self._closed = True
        remaining = self._sup.leave_body(exc if flushing is None else flushing)
        result = await self._sup.close(remaining, swallowed=exc is not None and remaining is None)
        if flushing is not None:
            raise flushing
        return result

    # -- the connection, in the background --

    def _has_work(self) -> bool:
        pending_done = self._done_requested and not self._finished
        return self._connections == 0 or self.unacknowledged > 0 or pending_done

    async def _run(self) -> None:
        try:
            await self._connect_forever()
        except ControlChannelError as exc:
            self._sup.fail(exc)
        except Exception as exc:  # a bug: reported like a failure, so that no send() waits on a dead task
            error = StreamingError(f"producer {self.name!r}: its connection task failed: {explain(exc)}")
            error.__cause__ = exc
            self._sup.fail(error)

    async def _connect_forever(self) -> None:
        failing_since: float | None = None
        delay = _FIRST_BACKOFF
        attempts = 0
        while not self._finished:
            while not self._has_work():  # idle: connect again when there is something to send
                await self._changed.wait()
            try:
                conn = await self._connect()
                try:
                    welcome = await self._greet(conn)
                    self._connections += 1
                    failing_since, attempts = None, 0
                    progress = await self._session(conn, welcome)
                finally:
                    await conn.aclose()
                # Lost after the handshake: again at once if it got somewhere, else after a pause.
                delay = _FIRST_BACKOFF if progress else min(delay * 2, _MAX_BACKOFF)
                if not progress and not self._finished:
                    await anyio.sleep(delay)
                continue
            except _Redirected as redirect:
                if (self._host, self._port) != self._root:
                    error = f"{self._receiver} redirected this producer again, to {redirect}"
                    self._host, self._port = self._root
                else:  # at the root: on to the assigned receiver at once
                    logger.info("producer %r: redirected to %s", self.name, redirect)
                    self._host, self._port = redirect.address
                    continue
            except _Retry as exc:
                error = str(exc)
                # The assigned receiver is unreachable or gone: ask the root again (it may have
                # restarted, with the same assignment at another address).
                self._host, self._port = self._root
            attempts += 1
            now = anyio.current_time()
            failing_since = now if failing_since is None else failing_since
            if now - failing_since >= self._reconnect_timeout:
                msg = (
                    f"producer {self.name!r} could not reach {self._receiver} for "
                    f"{self._reconnect_timeout:g} s ({attempts} attempts; last error: {error})"
                )
                raise StreamingError(msg)
            logger.debug("producer %r: %s; retrying in %g s", self.name, error, delay)
            await anyio.sleep(min(delay, self._reconnect_timeout - (now - failing_since)))
            delay = min(delay * 2, _MAX_BACKOFF)

    async def _connect(self) -> FramedStream:
        try:
            with anyio.fail_after(self._handshake_timeout):
                stream: anyio.abc.ByteStream = await anyio.connect_tcp(self._host, self._port)
        except OSError as exc:  # TimeoutError included
            raise _Retry(f"{self._receiver} is not reachable: {type(exc).__name__}: {exc}") from exc
        return FramedStream(stream, max_frame_bytes=PREAUTH_FRAME_BYTES, peer=self._receiver)

    async def _greet(self, conn: FramedStream) -> Welcome:
        """The producer's side of the handshake; the receiver's welcome.

        Raises:
            HandshakeError: the receiver refused this producer, did not prove the token, or
                speaks another protocol version.
            _Redirected: the receiver sent this producer to another receiver.
            _Retry: the connection failed, or the receiver did not answer in time.
        """
        try:
            with anyio.fail_after(self._handshake_timeout):
                if self._tls is not None:
                    conn.stream = await self._secure(conn.stream, self._tls)
                challenge = await conn.receive()
                if not isinstance(challenge, Challenge):
                    what = "closed" if challenge is None else f"sent {type(challenge).__name__}"
                    raise _Retry(f"{self._receiver} {what} instead of a challenge")
                if challenge.protocol_version != PROTOCOL_VERSION:
                    msg = (
                        f"producer {self.name!r}: {self._receiver} speaks streaming protocol version "
                        f"{challenge.protocol_version}, this producer speaks version {PROTOCOL_VERSION}"
                    )
                    raise HandshakeError(msg)
                hello = Hello(PROTOCOL_VERSION, self.name, new_nonce(), proof="")
                proof = producer_proof(self._token, receiver_nonce=challenge.nonce, hello=hello)
                hello = attrs.evolve(hello, proof=proof)
                await conn.send(encode_frame(hello))
                reply = await conn.receive()
        except TimeoutError as exc:
            msg = f"{self._receiver} did not finish the handshake in {self._handshake_timeout:g} s"
            raise _Retry(msg) from exc
        except HandshakeError:
            raise
        except ControlChannelError as exc:  # transport errors and bad frames
            raise _Retry(str(exc)) from exc
        if isinstance(reply, Refuse):
            msg = f"producer {self.name!r} refused by {self._receiver}: {reply.reason}"
            raise HandshakeError(msg)
        if isinstance(reply, Redirect):
            expected = redirect_proof(
                self._token, receiver_nonce=challenge.nonce, hello=hello, host=reply.host, port=reply.port
            )
            if not proof_matches(expected, reply.proof):
                msg = (
                    f"producer {self.name!r}: {self._receiver} redirected it without proving the shared token"
                )
                raise HandshakeError(msg)
            raise _Redirected(reply.host, reply.port)
        if not isinstance(reply, Welcome):
            what = "closed the connection" if reply is None else f"sent {type(reply).__name__}"
            raise _Retry(f"{self._receiver} {what} instead of answering the hello")
        expected = receiver_proof(
            self._token,
            receiver_nonce=challenge.nonce,
            hello=hello,
            acked_seq=reply.acked_seq,
            max_frame_bytes=reply.max_frame_bytes,
        )
        if not proof_matches(expected, reply.proof):
            msg = f"producer {self.name!r}: {self._receiver} did not prove the shared token (another token?)"
            raise HandshakeError(msg)
        return reply

    async def _secure(self, stream: anyio.abc.ByteStream, context: ssl.SSLContext) -> anyio.abc.ByteStream:
        try:
            return await tls.wrap(stream, context, server_side=False, hostname=self._host)
        except ControlChannelError as exc:
            if isinstance(exc.__cause__, ssl.SSLError):  # a certificate not trusted, no TLS there: for good
                question = f"is {self._receiver} a sample receiver with TLS, and is its certificate trusted?"
                msg = f"producer {self.name!r}: {exc} ({question})"
                raise HandshakeError(msg) from exc
            raise  # a reset or a hang-up: try again

    def _take_welcome(self, acked: int) -> None:
        """Start from what the receiver holds: resend what follows, or fail if that was dropped."""
        lowest = self._frames[0][0] if self._frames else self._next_seq
        if acked + 1 < lowest:
            msg = (
                f"producer {self.name!r}: {self._receiver} holds seqs up to {acked} only, but this producer "
                f"no longer has {acked + 1}..{lowest - 1} (acknowledged before, or before start_seq): the "
                "receiver was restored from an older state than it acknowledged; keep_acknowledged= "
                "keeps that many acknowledged samples for such a resend"
            )
            raise StreamingError(msg)
        if self._frames:  # kept but never sent, and held by the receiver already: skipped too
            first, last = self._frames[0][0], self._frames[-1][0]
            self._skipped += max(min(acked, last) - max(self._highest_sent + 1, first) + 1, 0)
        self._acked = acked
        self._trim()
        self._changed.notify()

    def _trim(self) -> None:
        """Drop acknowledged samples but the last ``keep_acknowledged``."""
        if not self._frames:
            return
        first, last = self._frames[0][0], self._frames[-1][0]
        kept = max(min(self._acked, last) - first + 1, 0)
        while kept > self._keep_acknowledged:
            self._frames.popleft()
            kept -= 1

    async def _session(self, conn: FramedStream, welcome: Welcome) -> bool:
        """Send and resend on one connection until it is lost or done (returns) or fails for good (raises).

        Returns whether the receiver acknowledged anything new on it.
        """
        self._take_welcome(welcome.acked_seq)
        self._receiver_limit = min(self._max_frame_bytes, welcome.max_frame_bytes)
        acked_before = self._acked
        conn.decoder.max_frame_bytes = PREAUTH_FRAME_BYTES  # the receiver sends only small frames
        logger.info("producer %r connected to %s (holds up to %d)", self.name, self._receiver, self._acked)
        session = _Session(sent=self._acked)
        lost: list[str] = []
        refused: list[ControlChannelError] = []  # raised outside the task group, unwrapped
        async with anyio.create_task_group() as tg:

            async def write() -> None:
                try:
                    await self._write(conn, session)
                except _Retry as exc:
                    lost.append(str(exc))
                except ControlChannelError as exc:  # a sample the receiver can never take
                    refused.append(exc)
                tg.cancel_scope.cancel()

            tg.start_soon(write)
            try:
                await self._read(conn, session)
            except _Retry as exc:
                lost.append(str(exc))
            except ControlChannelError as exc:
                refused.append(exc)
            tg.cancel_scope.cancel()
        if refused:
            raise refused[0]
        if lost and not self._finished:
            logger.info("producer %r: lost the connection (%s); reconnecting", self.name, lost[0])
        return self._acked > acked_before or self._finished

    def _batch(self, after: int) -> tuple[int, bytes] | None:
        """The frame of the kept samples after seq ``after`` (up to a batch's bytes), and how
        many it holds; ``None`` if there is none."""
        if not self._frames:
            return None
        first = self._frames[0][0]
        start = max(after + 1 - first, 0)
        header = self._header_bound - 21
        payloads: list[bytes] = []
        size = 0
        for index in range(start, min(len(self._frames), start + MAX_SAMPLES_PER_FRAME)):
            payload = self._frames[index][1]
            more = len(payload) + 7
            if payloads and (
                _frame_full(len(payloads), size, more)
                or header + 21 * (len(payloads) + 1) + size + more > self._receiver_limit
            ):
                break
            payloads.append(payload)
            size += more
        if not payloads:
            return None
        self._unsent_bytes = max(self._unsent_bytes - size, 0)
        self._unsent = max(self._unsent - len(payloads), 0)
        try:
            frame = samples_frame(self.name, first + start, payloads, max_frame_bytes=self._receiver_limit)
        except FrameError as exc:  # one sample over the receiver's limit (under ours: send() took it)
            msg = f"producer {self.name!r}: sample {first + start} cannot be sent to {self._receiver}: {exc}"
            raise StreamingError(msg) from exc
        return len(payloads), frame

    async def _write(self, conn: FramedStream, session: _Session) -> None:
        # One scope bounds every send (its deadline moved before each, lifted while idle):
        # a fail_after per frame cost as much as a tenth of the producer's time.
        with anyio.CancelScope() as stuck:
            while True:
                session.sent = max(session.sent, self._acked)
                batch = self._batch(session.sent)
                if batch is not None:
                    count, frame = batch
                    stuck.deadline = anyio.current_time() + self._ack_timeout
                    await self._send(conn, frame)
                    upto = session.sent + count
                    resent = max(min(upto, self._highest_sent) - session.sent, 0)
                    self._resent += resent
                    self._sent += count - resent
                    self._highest_sent = max(self._highest_sent, upto)
                    session.sent = upto
                    continue
                if self._done_requested and not session.done_sent and session.sent >= self._next_seq - 1:
                    stuck.deadline = anyio.current_time() + self._ack_timeout
                    await self._send(conn, encode_frame(Done(self._next_seq - 1)))
                    session.done_sent = True
                stuck.deadline = math.inf
                self._writer_idle = True
                try:
                    await self._changed.wait()
                finally:
                    self._writer_idle = False
        raise _Retry(f"sending to {self._receiver} took over {self._ack_timeout:g} s")

    async def _send(self, conn: FramedStream, data: bytes) -> None:
        try:
            await conn.send(data)
        except ControlChannelError as exc:
            raise _Retry(str(exc)) from exc

    async def _read(self, conn: FramedStream, session: _Session) -> None:
        """Read acknowledgements until the receiver answers Done; raises _Retry if the connection is lost."""
        while not self._finished:
            message = None
            with anyio.move_on_after(self._ack_timeout) as silence:
                try:
                    message = await conn.receive()
                except ControlChannelError as exc:  # FrameError included
                    raise _Retry(str(exc)) from exc
            if silence.cancelled_caught:
                if session.sent > self._acked or session.done_sent:
                    raise _Retry(f"{self._receiver} acknowledged nothing for {self._ack_timeout:g} s")
                continue
            if message is None:
                raise _Retry(f"{self._receiver} closed the connection")
            if isinstance(message, Refuse):
                msg = f"producer {self.name!r} refused by {self._receiver}: {message.reason}"
                raise StreamingError(msg)
            if isinstance(message, Done) and session.done_sent and message.last_seq >= self._next_seq - 1:
                self._acked = max(self._acked, message.last_seq)
                self._trim()
                self._finished = True  # the receiver recorded our Done and holds every sample
                self._changed.notify()
                return
            if not isinstance(message, Ack) or message.upto_seq > session.sent:
                what = f"Ack({message.upto_seq})" if isinstance(message, Ack) else type(message).__name__
                msg = f"{self._receiver} broke the protocol: it sent {what} (sent up to {session.sent})"
                raise _Retry(msg)
            if message.upto_seq > self._acked:
                self._acked = message.upto_seq
                self._trim()
                self._changed.notify()


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
            except ControlChannelError as failure:
                if exc is None:
                    raise
                if failure is not exc:  # not the failure the block's send() raised already
                    logger.warning("producer %r failed too", self.name, exc_info=True)
        except ControlChannelError:
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
        producer = self._producer
        if self._portal is None:
            self._portal_or_fail("send()")
        if self._error is not None or producer._sup.failure is not None or producer._done_requested:
            with self._lock:
                self._raise_locked("send()")
        payload = encode_tensors(tensors)  # on this thread, in parallel with the loop's work
        size = len(payload)
        if producer._header_bound + size + 7 > producer._max_frame_bytes:  # else surely under it
            producer._check_size(self._next_seq, payload)
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

    def send_many(self, samples: Iterable[Mapping[str, torch.Tensor]]) -> list[int]:
        """:meth:`send` each of ``samples``, in order; their seqs."""
        return [self.send(tensors) for tensors in samples]

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
