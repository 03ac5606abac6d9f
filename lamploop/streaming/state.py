"""``StreamState``: a streamed run's buffer as a checkpoint extra, restored before its receiver opens.

A streamed run that resumes after a crash loses nothing when its checkpoint holds, beside
the model, the rank's buffer (the samples received and not yet fully read, their seen
counts, the generator) and what the receiver acknowledged, and when the producers resend
the rest.  The order matters, because the receiver tells reconnecting producers what it
holds as soon as it is open::

    stream = StreamState(buffer)
    acknowledged = stream.restore(checkpoint_dir)  # before the receiver: {} on a fresh run
    async with SampleReceiver(buffer, acknowledged=acknowledged, ...) as receiver:
        await lamploop.fit_async(..., checkpoint_dir=checkpoint_dir,
                                 checkpoint_extras={"stream": stream})

The acknowledged positions are the buffer's own
:meth:`~lamploop.streaming.buffers.StreamBuffer.last_seqs`: the receiver acknowledges a
sample only after the buffer took it, so at any moment the buffer holds (or has read, or
evicted) every sample up to its last seq from each producer, and none after.  That is exact
even when a checkpoint falls between a put and its acknowledgement, where the receiver's
:attr:`~lamploop.streaming.receiver.SampleReceiver.acknowledged` lags by one.
The producers must keep what they may have to resend (``keep_acknowledged=``: at least
what arrives between two checkpoints, plus the buffer's capacity, to be safe).

Checkpoints are taken at epoch ends (``fit`` refuses step-boundary checkpoints with
extras), where the model and optimizer reflect exactly the reads done, the buffer exactly
the samples not yet fully read, and the acknowledged positions exactly what was received:
after a crash, everything after the checkpoint (updates, reads, receipts) is discarded and
replayed, so every sample is read as often as the buffer's policy says.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Final

import torch

from lamploop.checkpoint.load import latest_checkpoint, load_checkpoint
from lamploop.errors import CheckpointError
from lamploop.streaming.buffers import StreamBuffer

__all__ = ["STREAM_EXTRA", "StreamState"]

STREAM_EXTRA: Final = "stream"
"""The name :meth:`StreamState.restore` looks for by default (``checkpoint_extras={"stream": ...}``)."""


class StreamState:
    """A rank's stream buffer as a :class:`~lamploop.checkpoint.extras.CheckpointExtra`.

    Call :meth:`restore` before the receiver opens; ``fit``'s own restore on resume then
    finds the buffer restored from that same state and leaves it alone.

    Args:
        buffer: the buffer the receiver fills and ``buffer_batches`` reads.
        name: the extra's name in ``checkpoint_extras`` (what :meth:`restore` looks for).
    """

    def __init__(self, buffer: StreamBuffer, *, name: str = STREAM_EXTRA) -> None:
        self.buffer = buffer
        self.name = name
        self._restored: Any = None  # the meta restore() loaded, None before

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The buffer's state now (its meta includes ``last_seq``, the acknowledged positions)."""
        return self.buffer.state_dict()

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Any) -> None:
        """Restore the buffer, unless :meth:`restore` already did from this same state.

        Raises:
            CheckpointError: the buffer already took samples (the receiver was opened before
                the stream was restored: restoring now would drop them although they were
                acknowledged), or :meth:`restore` loaded another state.
        """
        if self._restored is not None:
            if self._restored != meta:
                msg = (
                    f"stream state {self.name!r}: restore() loaded another checkpoint's state than the one "
                    "the run resumes from (was a checkpoint written in between?)"
                )
                raise CheckpointError(msg)
            return
        if self.buffer.received > 0:
            msg = (
                f"stream state {self.name!r}: the buffer already took {self.buffer.received} samples; "
                "restoring it now would drop them although the receiver acknowledged them. Call "
                "StreamState.restore(checkpoint_dir) before opening the SampleReceiver, and pass it "
                "the acknowledged positions that restore returns"
            )
            raise CheckpointError(msg)
        self.buffer.load_state_dict(tensors, meta)

    def restore(self, checkpoint_dir: str | os.PathLike[str] | None) -> dict[str, int]:
        """Load the latest checkpoint's stream state into the buffer; the receiver's ``acknowledged=``.

        Returns ``{}`` (nothing restored) when ``checkpoint_dir`` is ``None`` or holds no
        checkpoint yet.  Reads the same checkpoint ``fit(resume=True)`` then resumes from.

        Raises:
            CheckpointError: the checkpoint is invalid, or has no stream state of this name
                (it was written without ``checkpoint_extras={name: ...}``), or does not fit
                the buffer (another policy, capacity, watermark or max_reads).
        """
        if checkpoint_dir is None or latest_checkpoint(checkpoint_dir) is None:
            return {}
        checkpoint = load_checkpoint(checkpoint_dir)
        saved = checkpoint.extras.get(self.name)
        if saved is None:
            have = sorted(checkpoint.extras) or "none"
            msg = (
                f"{checkpoint.path}: has no stream state {self.name!r} (its checkpoint extras: {have}); "
                "it was written without checkpoint_extras, so a resumed stream would lose samples"
            )
            raise CheckpointError(msg)
        tensors, meta = saved
        self.buffer.load_state_dict(tensors, meta)
        self._restored = meta
        return self.buffer.last_seqs()

    def __repr__(self) -> str:
        return f"StreamState({type(self.buffer).__name__}, name={self.name!r})"
