"""``StreamState``: a streamed run's buffer as a checkpoint extra, restored before its receiver opens.

A streamed run that resumes after a crash loses nothing when its checkpoint holds, beside
the model, the rank's buffer (the samples received and not yet fully read, their seen
counts, the generator) and what the receiver acknowledged, and when the producers resend
the rest.  The order matters, because the receiver tells reconnecting producers what it
holds as soon as it is open::

    stream = StreamState(buffer)
    stream.restore(checkpoint_dir)  # before the receiver: nothing on a fresh run
    async with stream.open_receiver(token=token, producers=names) as receiver:
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
replayed, so every sample is read as often as the buffer's policy says.  The producers
that had finished are in the checkpoint too: a resumed run does not wait for them.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Final

import anyio
import anyio.from_thread
import anyio.lowlevel
import torch

from lamploop.checkpoint.extras import rank_extra_name
from lamploop.checkpoint.load import latest_checkpoint, load_checkpoint
from lamploop.checks import check_int
from lamploop.distributed.launch import launch_env
from lamploop.errors import CheckpointError, ConfigurationError
from lamploop.streaming.buffers import StreamBuffer
from lamploop.streaming.receiver import SampleReceiver
from lamploop.streaming.wire_messages import checked_producer_names

__all__ = ["STREAM_EXTRA", "StreamState", "producer_rank", "producers_of_rank"]

STREAM_EXTRA: Final = "stream"
"""The name :meth:`StreamState.restore` looks for by default (``checkpoint_extras={"stream": ...}``)."""


class StreamState:
    """A rank's stream (its buffer, and what its receiver recorded) as a checkpoint extra.

    The extra's tensors are the buffer's; its meta is ``{"buffer": <the buffer's meta>,
    "producers_done": [...]}``: the producers that had finished, so that a resumed run does
    not wait for a producer that is gone.  Call :meth:`restore` before the receiver opens,
    and open the receiver with :meth:`open_receiver` (it passes the restored positions on);
    ``fit``'s own restore on resume then finds the state restored and leaves it alone.

    With several ranks (each with its own buffer and receiver) it is also
    :class:`~lamploop.checkpoint.extras.RankAware`: the producers know only the root's
    receiver, which hands each out to a rank by a fixed round-robin of their names
    (:func:`producers_of_rank`); when the ranks meet, each announces its receiver's address
    and the root's receiver starts handing out
    (:meth:`~lamploop.streaming.receiver.SampleReceiver.set_directory`).  Producers that
    arrive earlier wait for that.

    Make it on the owner's event loop (the one that opens the receiver and trains): its state
    is read there, also when a rank's training thread asks for it; with the receiver on its
    own thread (``own_thread=True``) the buffer is filled on that thread's loop and read here.

    Args:
        buffer: the buffer the receiver fills and ``buffer_batches`` reads.
        name: the extra's name in ``checkpoint_extras`` (what :meth:`restore` looks for).
    """

    def __init__(self, buffer: StreamBuffer, *, name: str = STREAM_EXTRA) -> None:
        if not isinstance(buffer, StreamBuffer):
            what = type(buffer).__name__
            msg = f"StreamState: buffer must be a lamploop.streaming buffer (FifoBuffer...), got {what}"
            raise ConfigurationError(msg)
        if not isinstance(name, str) or not name:
            msg = f"StreamState: name must be a non-empty str (the extra's name), got {name!r:.100}"
            raise ConfigurationError(msg)
        self.buffer = buffer
        self.name = name
        self.receiver: SampleReceiver | None = None
        self._producers_done: list[str] = []  # restored
        self._restored: Any = None  # the meta restore() loaded, None before
        self._loop_thread = threading.get_ident()
        self._token = _current_token()
        self._joined = anyio.Event() if self._token is not None else None

    def open_receiver(
        self,
        *,
        token: bytes | str,
        producers: Sequence[str],
        nranks: int = 1,
        rank: int | None = None,
        **options: Any,
    ) -> SampleReceiver:
        """This rank's receiver into the buffer, with the restored positions; enter it with ``async with``.

        Args:
            token: the secret shared with the producers.
            producers: every producer's name (of all ranks); this rank's receiver waits for
                its share of them (:meth:`~lamploop.streaming.receiver.SampleReceiver.wait_all_done`),
                and refuses any other name at the handshake (``allowed_producers``).
            nranks: the run's number of ranks.
            rank: this rank (default: the launcher's, else 0).
            options: more :class:`~lamploop.streaming.receiver.SampleReceiver` arguments
                (``host``, ``port``, ``ssl_context``...).

        Raises:
            ConfigurationError: a receiver was opened already, or an argument is out of range.
        """
        if self.receiver is not None:
            msg = f"stream state {self.name!r}: open_receiver was called before; a stream has one receiver"
            raise ConfigurationError(msg)
        names = checked_producer_names("open_receiver: producers", producers)
        if not names:
            msg = "open_receiver: producers is empty: name every producer of the run (all ranks')"
            raise ConfigurationError(msg)
        twice = sorted(name for name, count in Counter(names).items() if count > 1)
        if twice:
            msg = f"open_receiver: producers names {twice} more than once: each producer's name is unique"
            raise ConfigurationError(msg)
        check_int("open_receiver: nranks", nranks, 1)
        rank = _this_rank(rank)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < nranks:
            msg = f"open_receiver: rank must be an int in 0..{nranks - 1} (nranks={nranks}), got {rank!r:.40}"
            raise ConfigurationError(msg)
        options.setdefault("allowed_producers", names)  # any other name is refused at the handshake
        if nranks > 1 and rank == 0:  # the root hands the producers out; the others take theirs
            options.setdefault("directory_assignments", {n: producer_rank(names, n, nranks) for n in names})
            options.setdefault("directory_index", 0)  # its own share at once; the others' wait
        self.receiver = SampleReceiver(
            self.buffer,
            token=token,
            acknowledged=self.buffer.last_seqs(),
            producers_done=self._producers_done,
            expected_producers=producers_of_rank(names, rank, nranks),
            **options,
        )
        return self.receiver

    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The buffer's state now (with ``last_seq``, the acknowledged positions) and the producers done."""
        state: tuple[dict[str, torch.Tensor], dict[str, Any]] = self._on_loop(self._capture)
        return state

    def _capture(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors, buffer_meta = self.buffer.state_dict()
        receiver = self.receiver
        # A producer refused for good (samples unlike the stream's) is not waited for after a resume either.
        done = (
            sorted(receiver.producers_done | receiver.producers_refused.keys())
            if receiver is not None
            else list(self._producers_done)
        )
        return tensors, {"buffer": buffer_meta, "producers_done": done}

    def _on_loop(self, read: Any) -> Any:
        """``read()`` on the buffer's event loop: a training thread must not race the receiver's puts."""
        if self._token is None or threading.get_ident() == self._loop_thread:
            return read()
        return anyio.from_thread.run_sync(read, token=self._token)

    def rank_info(self) -> Any:
        """This rank's receiver address ``[host, port]`` (``None`` without a receiver)."""
        if self.receiver is None:
            return None
        host, port = self.receiver.address
        return [host, port]

    def ranks_joined(self, infos: list[Any], rank: int) -> None:
        """On the root: start handing the producers out over every rank's receiver (see the class)."""
        if rank == 0 and self.receiver is not None and len(infos) > 1:
            if any(info is None for info in infos):
                missing = [r for r, info in enumerate(infos) if info is None]
                msg = (
                    f"stream state {self.name!r}: ranks {missing} opened no receiver "
                    "(StreamState.open_receiver), so the root cannot hand producers out to them"
                )
                raise ConfigurationError(msg)
            addresses = [(str(host), int(port)) for host, port in infos]
            receiver = self.receiver
            self._on_loop(lambda: receiver.set_directory(addresses))
        if self._joined is not None:
            self._on_loop(self._joined.set)

    async def wait_ranks_joined(self) -> None:
        """Return once the ranks of the run met (never with one rank: they do not meet)."""
        if self._joined is None:
            msg = "StreamState.wait_ranks_joined: the stream state was made outside an event loop"
            raise ConfigurationError(msg)
        await self._joined.wait()

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Any) -> None:
        """Restore the buffer, unless :meth:`restore` already did from this same state.

        Raises:
            CheckpointError: the meta is not a stream state's, the buffer already took samples
                (the receiver was opened before the stream was restored: restoring now would
                drop them although they were acknowledged), or :meth:`restore` loaded another
                state.
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
                "StreamState.restore(checkpoint_dir) before opening the receiver"
            )
            raise CheckpointError(msg)
        buffer_meta, done = self._parse(meta)
        self.buffer.load_state_dict(tensors, buffer_meta)
        self._producers_done = done

    def _parse(self, meta: Any) -> tuple[Mapping[str, Any], list[str]]:
        if not (
            isinstance(meta, Mapping)
            and set(meta) == {"buffer", "producers_done"}
            and isinstance(meta["buffer"], Mapping)
            and isinstance(meta["producers_done"], list)
            and all(isinstance(n, str) for n in meta["producers_done"])
        ):
            keys = sorted(meta) if isinstance(meta, Mapping) else type(meta).__name__
            msg = (
                f"stream state {self.name!r}: the checkpoint's meta is not a stream state's "
                f"(expected the keys buffer and producers_done, got {keys})"
            )
            raise CheckpointError(msg)
        return meta["buffer"], list(meta["producers_done"])

    def restore(
        self, checkpoint_dir: str | os.PathLike[str] | None, *, rank: int | None = None
    ) -> dict[str, int]:
        """Load the latest checkpoint's stream state; the receiver's ``acknowledged=``.

        Returns ``{}`` (nothing restored) when ``checkpoint_dir`` is ``None`` or holds no
        checkpoint yet.  Reads the same checkpoint ``fit(resume=True)`` then resumes from:
        with several ranks, every rank must see ``checkpoint_dir`` (one machine, or a shared
        file system) and restores its own buffer, saved as ``<name>.rank<r>``.

        Args:
            checkpoint_dir: the run's checkpoint directory.
            rank: this rank (default: the launcher's, see :mod:`lamploop.distributed.launch`,
                else 0).

        Raises:
            CheckpointError: the checkpoint is invalid, or has no stream state of this name
                (it was written without ``checkpoint_extras={name: ...}``), or does not fit
                the buffer (another policy, capacity, watermark or max_reads).
        """
        if checkpoint_dir is None or latest_checkpoint(checkpoint_dir) is None:
            return {}
        checkpoint = load_checkpoint(checkpoint_dir)
        name = rank_extra_name(self.name, _this_rank(rank))
        saved = checkpoint.extras.get(name)
        if saved is None:
            have = sorted(checkpoint.extras) or "none"
            msg = (
                f"{checkpoint.path}: has no stream state {name!r} (its checkpoint extras: {have}); "
                "it was written without checkpoint_extras or by a run of fewer ranks, so a resumed "
                "stream would lose samples"
            )
            raise CheckpointError(msg)
        tensors, meta = saved
        buffer_meta, done = self._parse(meta)
        self.buffer.load_state_dict(tensors, buffer_meta)
        self._producers_done = done
        self._restored = meta
        return self.buffer.last_seqs()

    @property
    def producers_done(self) -> list[str]:
        """The producers that had finished, as restored (give them to a receiver you open yourself)."""
        return list(self._producers_done)

    def __repr__(self) -> str:
        return f"StreamState({type(self.buffer).__name__}, name={self.name!r})"


def producer_rank(producers: Sequence[str], name: str, nranks: int) -> int:
    """The rank that trains on producer ``name``'s samples: round-robin over the sorted names."""
    return sorted(producers).index(name) % nranks


def producers_of_rank(producers: Sequence[str], rank: int, nranks: int) -> list[str]:
    """The producers whose samples rank ``rank`` of ``nranks`` trains on (see :func:`producer_rank`)."""
    return sorted(producers)[rank::nranks]


def _this_rank(rank: int | None) -> int:
    if rank is not None:
        return rank
    env = launch_env()
    return env.rank if env is not None else 0


def _current_token() -> Any:
    """The running event loop's token, ``None`` outside one."""
    try:
        return anyio.lowlevel.current_token()
    except RuntimeError:  # anyio's NoEventLoopError
        return None
