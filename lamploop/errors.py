"""The exceptions lamploop raises.

Every error lamploop raises on purpose derives from :class:`LamploopError`, so
``except LamploopError`` catches them all.  Errors about bad arguments also
derive from :class:`ValueError`, so code written against plain PyTorch keeps
working.  Each message names the offending value and where it came from.

Some failures of a run of several ranks are detected by every rank itself, at the same
point, from numbers the ranks share: a NaN loss (the per-step sums), ranks that disagree
when they meet, a checkpoint that does not fit the run.  Such an error is *detected by
every rank* (:attr:`LamploopError.detected_by_every_rank`, set by its class or by
:func:`mark_detected_by_every_rank`), and it is the error every rank raises: the abort
message that the first rank to fail sends the others does not replace their own verdict
(see docs/reliability.md).

>>> error = mark_detected_by_every_rank(DistributedError("the ranks disagree"))
>>> error.detected_by_every_rank, DistributedError("a peer is gone").detected_by_every_rank
(True, False)
>>> NonFiniteLossError("nan", epoch=1, batch=None).detected_by_every_rank
True
"""

from __future__ import annotations

from typing import TypeVar

__all__ = [
    "BatchError",
    "BufferClosedError",
    "CheckpointError",
    "ConfigurationError",
    "ControlChannelError",
    "DistributedError",
    "DuplicateSampleError",
    "FederatedError",
    "FrameError",
    "HandshakeError",
    "LamploopError",
    "MissingDependencyError",
    "NonFiniteLossError",
    "PlanNotApprovedError",
    "PeerLostError",
    "SampleMismatchError",
    "StreamEnded",
    "StreamExhausted",
    "StreamingError",
    "TrainingInterrupted",
    "TransportError",
    "error_detected_by_every_rank",
    "exception_leaves",
    "mark_detected_by_every_rank",
]

E = TypeVar("E", bound="LamploopError")


class LamploopError(Exception):
    """Base class of every error lamploop raises on purpose.

    Attributes:
        detected_by_every_rank: in a run of several ranks, every rank detects this error
            itself at the same point (from numbers the ranks share), so every rank raises
            it, never the abort it causes on another rank (see the module).  ``True`` for
            every :class:`NonFiniteLossError` and :class:`StreamExhausted`; set on one error
            by :func:`mark_detected_by_every_rank`.
    """

    detected_by_every_rank: bool = False


def mark_detected_by_every_rank(error: E) -> E:
    """``error``, marked as detected by every rank of the run itself (at the same point).

    Mark only an error that every rank raises alike when it happens (a check of values the
    ranks share, e.g. after a broadcast or a sum), never one that a rank finds alone.
    """
    error.detected_by_every_rank = True
    return error


REASON_HEAD_CHARS = 400
"""How much of a long failure's text (:func:`failure_reason`) is kept from its start."""

REASON_TAIL_CHARS = 1200
"""How much is kept from its end: the last lines of a traceback in a message (a DataLoader
worker's re-raised one) name the exception that was raised and its own message."""


def shortened(text: str, *, head: int = REASON_HEAD_CHARS, tail: int = REASON_TAIL_CHARS) -> str:
    """``text``, or, when longer than ``head + tail`` characters (and a marker), its first
    ``head`` and last ``tail`` characters with a marker saying how many were left out between.

    >>> shortened("a" * 10 + "b" * 100 + "c" * 10, head=10, tail=10)
    'aaaaaaaaaa [... 100 characters left out ...] cccccccccc'
    """
    marker_room = 48
    if len(text) <= head + tail + marker_room:
        return text
    left_out = len(text) - head - tail
    return f"{text[:head]} [... {left_out} characters left out ...] {text[len(text) - tail :]}"


def failure_reason(who: str, exc: BaseException) -> str:
    """``"the {who} failed: {type}: {message}"`` for the peers' errors, :func:`shortened`: a
    long message keeps its start (the type and first words) and its end (its last lines)."""
    return shortened(f"the {who} failed: {type(exc).__name__}: {exc}")


def exception_leaves(exc: BaseException) -> list[BaseException]:
    """``exc`` itself, or the exceptions inside its exception groups (task groups wrap errors
    in them), nested groups flattened, in order."""
    inner = getattr(exc, "exceptions", None)
    if isinstance(inner, tuple):
        return [leaf for each in inner for leaf in exception_leaves(each)]
    return [exc]


def error_detected_by_every_rank(exc: BaseException | None) -> LamploopError | None:
    """The error in ``exc`` (``exc`` itself, or one inside its exception groups, the first
    such) that every rank detects itself; ``None`` when there is none."""
    if exc is None:
        return None
    for leaf in exception_leaves(exc):
        if isinstance(leaf, LamploopError) and leaf.detected_by_every_rank:
            return leaf
    return None


class ConfigurationError(LamploopError, ValueError):
    """An argument is out of range or arguments contradict each other."""


class MissingDependencyError(ConfigurationError):
    """An optional dependency (an extra) is not installed; the message gives the pip command.

    Example: ``ProgressReporter()`` without rich says ``pip install "lamploop[progress]"``.
    """


class BatchError(LamploopError, ValueError):
    """A batch stream yielded something that cannot be trained on.

    Examples: an empty batch, features and targets with different batch
    sizes, or an item that is not a ``(features, target)`` pair.
    """


class StreamExhausted(BatchError):
    """A training epoch had no batch on any rank because every rank's stream of samples ended.

    Raised by :func:`lamploop.one_epoch` instead of a plain :class:`BatchError` when the
    streams are :class:`~lamploop.batches.EndingBatchStream` objects that say they ended
    (such as :func:`lamploop.streaming.buffer_batches`'s); :func:`lamploop.epochs` ends the
    run there, without recording the empty epoch.  Every rank detects it (the count of
    batches is summed over the ranks).
    """

    detected_by_every_rank = True


class SampleMismatchError(BatchError):
    """Streamed samples that make one batch do not match: a tensor of another shape or dtype, or
    other tensor names, so they cannot be stacked (the message names the sample and the field).

    Attributes:
        producer: the producer of the sample that differs from the batch's first one.
        seq: that sample's sequence number.
        field: the name of the tensor that differs (the first one, by name).
        shape: its shape in that sample (``None`` if it lacks the tensor).
        expected_shape: its shape in the batch's first sample (``None`` if that one lacks it).
        epoch: the epoch of the batch (``None`` if unknown).
        batch: the 0-based index of the batch in that epoch on this rank (``None`` if unknown).
    """

    def __init__(
        self,
        message: str,
        *,
        producer: str,
        seq: int,
        field: str,
        shape: tuple[int, ...] | None,
        expected_shape: tuple[int, ...] | None,
        epoch: int | None = None,
        batch: int | None = None,
    ) -> None:
        super().__init__(message)
        self.producer = producer
        self.seq = seq
        self.field = field
        self.shape = shape
        self.expected_shape = expected_shape
        self.epoch = epoch
        self.batch = batch


class NonFiniteLossError(LamploopError, FloatingPointError):
    """A loss was NaN or infinite.

    Every rank detects it, at the same step (the per-step sums carry every rank's loss), and
    raises it with the same ``epoch``, ``step`` and ``ranks``.

    Attributes:
        epoch: the epoch in which it happened (``None`` if unknown).
        batch: the 0-based index of the first bad batch in that epoch on this
            rank, or ``None`` if the bad value came from another rank.
        step: the 0-based optimizer step of the epoch whose loss was bad (``None``
            when found at the epoch's end, e.g. in validation).
        ranks: the ranks whose loss was bad at that step (empty when unknown).
    """

    detected_by_every_rank = True

    def __init__(
        self,
        message: str,
        *,
        epoch: int | None,
        batch: int | None,
        step: int | None = None,
        ranks: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.batch = batch
        self.step = step
        self.ranks = ranks


class CheckpointError(LamploopError):
    """A checkpoint is missing, corrupt, of another format version, or does not fit the model."""


class DistributedError(LamploopError):
    """A tensor-channel collective or the process-group set-up failed."""


class TransportError(LamploopError):
    """One of lamploop's authenticated TCP protocols failed: transport errors are wrapped in this.

    The control channel, the streaming transport and the federated link all run on
    :mod:`lamploop.transport`, and every failure of theirs is one: a broken connection (this
    class itself), a bad frame (:class:`FrameError`), a refused handshake
    (:class:`HandshakeError`), a lost rank (:class:`PeerLostError`), a streaming failure
    (:class:`StreamingError`).

    .. versionadded:: 0.3
    """


ControlChannelError = TransportError
"""The name :class:`TransportError` had before the three protocols shared one transport (0.1, 0.2):
``except ControlChannelError`` still catches every transport failure, as it did."""


class StreamingError(TransportError):
    """The streaming transport failed: a producer could not deliver, or a receiver's sink failed."""


class FederatedError(LamploopError):
    """A federated run failed: too few nodes answered a round, a checkpoint does not fit the plan..."""


class PlanNotApprovedError(FederatedError):
    """A node refused a training plan whose hash is not on its allow-list (the message names the hash).

    Attributes:
        plan_hash: the refused plan's sha256.
    """

    def __init__(self, message: str, *, plan_hash: str) -> None:
        super().__init__(message)
        self.plan_hash = plan_hash


class StreamEnded(LamploopError):
    """A stream buffer is closed and nothing readable is left: the stream of samples is over."""


class BufferClosedError(LamploopError):
    """A sample was put into a stream buffer after it was closed."""


class DuplicateSampleError(LamploopError, ValueError):
    """A sample's ``seq`` is not after the last one put from its producer (a resend or out of order)."""


class FrameError(TransportError):
    """A frame is malformed, too large, or of an unknown type (any of the three protocols)."""


class HandshakeError(TransportError):
    """A peer was refused while joining, or did not prove the token: the message names why."""


class PeerLostError(TransportError):
    """A rank of the run was lost: it died, went silent, closed its connection or failed.

    Attributes:
        rank: the rank that failed (never the innocent rank that reports it), or ``None``
            when unknown.
        how: ``"died"`` (its connection broke), ``"silent"`` (no heartbeat for the heartbeat
            timeout: frozen or cut off), ``"closed"`` (it closed the connection before
            ``Stop``), ``"aborted"`` (it failed itself and said why), ``"protocol"`` (it
            broke the protocol), or ``None`` when unknown.
    """

    def __init__(self, message: str, *, rank: int | None = None, how: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.how = how


class TrainingInterrupted(LamploopError):
    """Training stopped on request (SIGTERM, SIGINT) at a step boundary, after writing a checkpoint.

    Attributes:
        epoch: the epoch that was in progress.
        steps_done: the optimizer steps done in it.
        reason: what asked for the stop (e.g. ``"SIGTERM"``).
    """

    def __init__(self, message: str, *, epoch: int, steps_done: int, reason: str) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.steps_done = steps_done
        self.reason = reason
