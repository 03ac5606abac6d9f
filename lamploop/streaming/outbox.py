"""A producer's numbering and resend window, without I/O (sans-IO): what is kept, sent, acknowledged.

:class:`Outbox` numbers the samples it is given (seq ``start_seq``, ``start_seq + 1``, ...),
keeps each one's encoded tensors until the receiver acknowledges it, and cuts the frames
that a connection sends: the kept samples after the last one sent on it, up to a batch's
worth.  A reconnection starts from the receiver's Welcome (:meth:`Outbox.take_welcome`):
what it holds is dropped (or skipped, never sent), the rest is sent again.  The kept seqs
are always contiguous: the last ``keep_acknowledged`` acknowledged ones (for a receiver
restored from an older state), then the unacknowledged ones, at most ``window`` of them.

:class:`~lamploop.streaming.producer.AsyncProducer` owns one and does the waiting, the
connections and the handshake around it; tests/streaming/test_stream_outbox.py tests it without a
socket.

>>> outbox = Outbox("sim", window=2, keep_acknowledged=0, start_seq=0, max_frame_bytes=1 << 20)
>>> outbox.keep(b"a" * 8), outbox.keep(b"b" * 8), outbox.has_room()
(0, 1, False)
>>> count, frame = outbox.batch(after=-1, receiver="the receiver")
>>> count, outbox.record_sent(after=-1, count=count)
(2, 1)
>>> outbox.acknowledge(1), outbox.unacknowledged, outbox.has_room()
(True, 0, True)

.. versionadded:: 0.3
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import islice

from lamploop.errors import FrameError, StreamingError
from lamploop.streaming.wire import MAX_SAMPLES_PER_FRAME, samples_frame_bytes, samples_frame_parts

__all__ = [
    "DEFAULT_WINDOW_BYTES",
    "DEFAULT_WINDOW_FLOOR",
    "DEFAULT_WINDOW_SAMPLES",
    "WRITE_BATCH_BYTES",
    "WRITE_BATCH_SAMPLES",
    "WRITE_MAX_BYTES",
    "Outbox",
    "frame_full",
]

DEFAULT_WINDOW_SAMPLES = 256
DEFAULT_WINDOW_BYTES = 4 * 1024 * 1024
DEFAULT_WINDOW_FLOOR = 64
"""A producer's default resend window (``resend_window=None``): up to 256 unacknowledged
samples that hold at most 4 MiB together, and 64 whatever their size.  Small samples then
travel in frames of a hundred or more (a frame's and an acknowledgement's fixed costs spread
over them), while the memory kept for resending is no more than 4 MiB or 64 samples, the
former default."""

WRITE_BATCH_BYTES = 256 * 1024
WRITE_BATCH_SAMPLES = 32
WRITE_MAX_BYTES = 2 * 1024 * 1024
"""A batch frame is cut once it holds 256 KiB of samples and at least 32 samples, or 2 MiB: a
frame's fixed costs (some 100-200 µs of Python at the receiver, whatever its size) spread over
many samples, also large ones (the receiver copies a frame of more than 8 samples in runs of 8,
so that a sample it keeps holds no more than its run's memory)."""

_SIZE_BOUND = 21
"""The most bytes one sample's size takes in a batch's header (20 digits and a comma)."""


def frame_full(count: int, size: int, more: int = 0) -> bool:
    """Whether a frame of ``count`` samples of ``size`` bytes is cut before ``more`` bytes."""
    total = size + more
    return total > WRITE_BATCH_BYTES and (count >= WRITE_BATCH_SAMPLES or total > WRITE_MAX_BYTES)


class Outbox:
    """One producer's kept samples (see the module).

    Args:
        name: the producer's name (it goes in every frame's header).
        window: the most unacknowledged samples kept (:meth:`has_room`).
        window_bytes: ``None``, or the most bytes the unacknowledged samples hold together...
        window_floor: ...except that this many are always kept (default: ``window``).
        keep_acknowledged: acknowledged samples kept too (the last ones).
        start_seq: the first sample's seq.
        max_frame_bytes: the largest frame this producer makes.

    Attributes:
        next_seq: the seq the next sample gets.
        acked: the highest seq the receiver holds with every one before it, as far as known.
        highest_sent: the highest seq ever sent.
        receiver_limit: the largest frame sent: the smaller of ``max_frame_bytes`` and the
            receiver's (its Welcome's).
        sent, resent, skipped: samples sent for the first time, sent again, never sent
            because the receiver held them already.
        unsent, unsent_bytes: samples (and their bytes) kept since a frame was last cut.
    """

    def __init__(
        self,
        name: str,
        *,
        window: int,
        keep_acknowledged: int,
        start_seq: int,
        max_frame_bytes: int,
        window_bytes: int | None = None,
        window_floor: int | None = None,
    ) -> None:
        self.name = name
        self.window = window
        self.window_bytes = window_bytes
        self.window_floor = window if window_floor is None else min(window_floor, window)
        self.keep_acknowledged = keep_acknowledged
        self.max_frame_bytes = max_frame_bytes
        self.receiver_limit = max_frame_bytes
        # A batch's header takes at most 100 bytes, 6 per byte of the name (JSON escapes), 21 per size.
        self.header_bound = 100 + 6 * len(name.encode()) + _SIZE_BOUND
        # (seq, payload), contiguous seqs: the acknowledged ones kept, then the unacknowledged ones
        self.frames: deque[tuple[int, bytes]] = deque()
        self.next_seq = start_seq
        self.acked = start_seq - 1
        self.highest_sent = start_seq - 1
        self.sent = self.resent = self.skipped = 0
        self.unsent = self.unsent_bytes = 0
        self.pending_bytes = 0  # the bytes of the unacknowledged samples (seqs after acked)

    @property
    def unacknowledged(self) -> int:
        """Samples kept until the receiver acknowledges them."""
        if not self.frames:
            return 0
        first, last = self.frames[0][0], self.frames[-1][0]
        return max(last - max(self.acked, first - 1), 0)

    @property
    def lowest_kept(self) -> int:
        """The lowest seq still kept (:attr:`next_seq` when none is)."""
        return self.frames[0][0] if self.frames else self.next_seq

    def has_room(self, size: int = 0) -> bool:
        """Whether the next sample, of ``size`` bytes, may be kept now (the receiver holds it,
        or the window has room for it)."""
        return self.next_seq <= self.acked or self._room(self.unacknowledged, self.pending_bytes, size)

    def _room(self, pending: int, pending_bytes: int, size: int) -> bool:
        """Whether ``pending`` unacknowledged samples of ``pending_bytes`` leave room for one
        more of ``size`` bytes."""
        if pending < self.window_floor:
            return True
        if self.window_bytes is not None and pending_bytes + size > self.window_bytes:
            return False
        return pending < self.window

    def fitting(self, payloads: Sequence[bytes]) -> int:
        """How many of ``payloads`` (none held by the receiver) the window takes now, in order."""
        pending, pending_bytes = self.unacknowledged, self.pending_bytes
        count = 0
        for payload in payloads:
            if not self._room(pending, pending_bytes, len(payload)):
                break
            pending += 1
            pending_bytes += len(payload)
            count += 1
        return count

    def frame_due(self) -> bool:
        """Whether a frame's worth (or half the window) was kept since a frame was last cut."""
        return frame_full(self.unsent, self.unsent_bytes) or self.unsent * 2 >= self.window

    def check_size(self, seq: int, payload: bytes) -> None:
        """Raise FrameError if the frame of ``payload`` alone would be over ``max_frame_bytes``."""
        if self.header_bound + len(payload) + 7 <= self.max_frame_bytes:  # the usual case, at once
            return
        size = samples_frame_bytes(self.name, seq, [len(payload)]) - 4
        if size > self.max_frame_bytes:
            msg = f"a samples frame of {size} bytes is over the limit of {self.max_frame_bytes} bytes"
            raise FrameError(msg)

    def _check_expected(self, expected_seq: int | None) -> None:
        if expected_seq is not None and expected_seq != self.next_seq:  # only after an earlier send failed
            msg = f"producer {self.name!r}: sample {expected_seq} would go out as {self.next_seq}"
            raise StreamingError(msg)

    def keep(self, payload: bytes, expected_seq: int | None = None) -> int:
        """Number the sample and keep it for the writer (or skip it if the receiver holds it); its seq.

        Raises:
            FrameError: its frame would be over ``max_frame_bytes`` (the seq is not taken).
            StreamingError: ``expected_seq`` is given and is not the next seq.
        """
        self._check_expected(expected_seq)
        seq = self.next_seq
        self.check_size(seq, payload)
        if seq <= self.acked:  # the receiver holds it already (a restarted producer)
            if self.keep_acknowledged:
                # Kept like any acknowledged sample, so that the kept seqs stay contiguous (the
                # writer finds a seq at its offset from the first) and a receiver restored from
                # an older state can get it again.
                self.frames.append((seq, payload))
                self.trim()
            self.next_seq += 1
            self.skipped += 1
            return seq
        self.next_seq += 1
        self.frames.append((seq, payload))
        self.unsent_bytes += len(payload)
        self.pending_bytes += len(payload)
        self.unsent += 1
        return seq

    def keep_run(self, payloads: Sequence[bytes], expected_seq: int | None = None) -> None:
        """:meth:`keep` each of ``payloads`` (sizes checked, room in the window, none held by the
        receiver), in one step."""
        self._check_expected(expected_seq)
        seq = self.next_seq
        self.next_seq = seq + len(payloads)
        self.frames.extend(zip(range(seq, self.next_seq), payloads, strict=True))
        size = sum(map(len, payloads))
        self.unsent_bytes += size
        self.pending_bytes += size
        self.unsent += len(payloads)

    def take_welcome(self, acked: int, max_frame_bytes: int, *, receiver: str) -> None:
        """Start a connection from what the receiver holds (its Welcome): resend what follows.

        Raises:
            StreamingError: the receiver holds less than this producer still keeps (it was
                restored from an older state than it acknowledged).
        """
        lowest = self.lowest_kept
        if acked + 1 < lowest:
            msg = (
                f"producer {self.name!r}: {receiver} holds seqs up to {acked} only, but this producer "
                f"no longer has {acked + 1}..{lowest - 1} (acknowledged before, or before start_seq): the "
                "receiver was restored from an older state than it acknowledged; keep_acknowledged= "
                "keeps that many acknowledged samples for such a resend"
            )
            raise StreamingError(msg)
        if self.frames:  # kept but never sent, and held by the receiver already: skipped too
            first, last = self.frames[0][0], self.frames[-1][0]
            self.skipped += max(min(acked, last) - max(self.highest_sent + 1, first) + 1, 0)
        self.acked = acked
        self.pending_bytes = sum(len(payload) for seq, payload in self.frames if seq > acked)
        self.receiver_limit = min(self.max_frame_bytes, max_frame_bytes)
        self.trim()

    def acknowledge(self, upto: int) -> bool:
        """The receiver holds every seq up to ``upto``; whether that is news."""
        if upto <= self.acked:
            return False
        if self.frames:  # the newly acknowledged samples' bytes leave the window
            first, last = self.frames[0][0], self.frames[-1][0]
            begin, end = max(self.acked + 1, first) - first, min(upto, last) + 1 - first
            if begin < end:
                self.pending_bytes -= sum(len(payload) for _, payload in islice(self.frames, begin, end))
        self.acked = upto
        self.trim()
        return True

    def trim(self) -> None:
        """Drop acknowledged samples but the last ``keep_acknowledged``."""
        if not self.frames:
            return
        first, last = self.frames[0][0], self.frames[-1][0]
        kept = max(min(self.acked, last) - first + 1, 0)
        while kept > self.keep_acknowledged:
            self.frames.popleft()
            kept -= 1

    def batch(self, after: int, *, receiver: str) -> tuple[int, bytes] | None:
        """The frame of the kept samples after seq ``after`` (up to a batch's bytes, within the
        receiver's limit), and how many it holds; ``None`` if there is none.

        Raises:
            StreamingError: a sample is over the receiver's limit (under this producer's).
        """
        batch = self.batch_parts(after, receiver=receiver)
        return None if batch is None else (batch[0], b"".join(batch[1]))

    def batch_parts(self, after: int, *, receiver: str) -> tuple[int, list[bytes]] | None:
        """:meth:`batch`'s frame as parts whose concatenation is its bytes, the large samples
        not copied (:func:`~lamploop.streaming.wire.samples_frame_parts`).

        Raises:
            StreamingError: as :meth:`batch`.
        """
        if not self.frames:
            return None
        first = self.frames[0][0]
        start = max(after + 1 - first, 0)
        header = self.header_bound - _SIZE_BOUND
        payloads: list[bytes] = []
        size = 0
        for index in range(start, min(len(self.frames), start + MAX_SAMPLES_PER_FRAME)):
            payload = self.frames[index][1]
            more = len(payload) + 7
            if payloads and (
                frame_full(len(payloads), size, more)
                or header + _SIZE_BOUND * (len(payloads) + 1) + size + more > self.receiver_limit
            ):
                break
            payloads.append(payload)
            size += more
        if not payloads:
            return None
        self.unsent_bytes = max(self.unsent_bytes - size, 0)
        self.unsent = max(self.unsent - len(payloads), 0)
        try:
            parts = samples_frame_parts(
                self.name, first + start, payloads, max_frame_bytes=self.receiver_limit
            )
        except FrameError as exc:  # one sample over the receiver's limit (under ours: keep() took it)
            msg = f"producer {self.name!r}: sample {first + start} cannot be sent to {receiver}: {exc}"
            raise StreamingError(msg) from exc
        return len(payloads), parts

    def record_sent(self, after: int, count: int) -> int:
        """A frame of ``count`` samples after seq ``after`` went out; the last seq sent now."""
        upto = after + count
        resent = max(min(upto, self.highest_sent) - after, 0)
        self.resent += resent
        self.sent += count - resent
        self.highest_sent = max(self.highest_sent, upto)
        return upto
