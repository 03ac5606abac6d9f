"""Every rank's checkpoint extras in a run of several ranks: checked as the ranks meet, gathered after passes.

A checkpoint extra (:mod:`lamploop.checkpoint.extras`) is state that lives beside the model,
such as a rank's stream buffer.  With several ranks each rank has its own, and the root
writes the checkpoints, so:

- when the ranks meet, they check that they carry extras of the same names and resumed
  from the same checkpoint (else :class:`~lamploop.errors.DistributedError` on every rank,
  before any training), and the extras that take part in the meeting
  (:class:`~lamploop.checkpoint.extras.RankAware`, such as a stream state announcing its
  receiver's address) learn every rank's description;
- after every training pass, on the thread that trains, each follower's extras are
  captured and sent to the root (safetensors bytes and JSON over the process group, no
  pickle); the root's checkpoints then hold extra ``name`` for rank 0 and
  ``name.rank<r>`` for rank ``r`` (:func:`~lamploop.checkpoint.extras.rank_extra_name`).

A follower's state captured at the end of its pass is as consistent with the model of that
epoch as the root's captured when the checkpoint is written: no rank reads its stream
between the end of a training pass and the start of the next one.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import safetensors.torch
import torch

from lamploop.checkpoint.codec import decode_tree, encode_tree
from lamploop.checkpoint.extras import (
    CheckpointExtra,
    ExtraState,
    RankAware,
    capture_extras,
    check_extras,
    rank_extra_name,
)
from lamploop.errors import CheckpointError, DistributedError
from lamploop.sync.collectives import Collectives
from lamploop.sync.strategy import GradientSync

__all__ = ["SYNC_EXTRA", "RankExtras", "SyncState", "rank_extras"]

SYNC_EXTRA = "sync"
"""The name under which a strategy that keeps state saves it (``sync``, ``sync.rank1``...)."""


class _Captured:
    """A follower's extra as the root last received it: a checkpoint extra that only saves."""

    def __init__(self, state: ExtraState) -> None:
        self.state = state

    def state_dict(self) -> ExtraState:
        return self.state

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Any) -> None:
        msg = "a follower's checkpoint extra is restored on its own rank, not on the root"
        raise CheckpointError(msg)


class RankExtras(Mapping[str, CheckpointExtra]):
    """One rank's checkpoint extras in a run of ``nranks`` ranks (see the module).

    As a mapping it is what the root's :class:`~lamploop.checkpoint.Checkpointer` saves:
    the root's own extras under their names, and each follower's last gathered state under
    ``name.rank<r>``.  On a follower it maps its own extras only.

    The run's own state beside the model joins them when its sync strategy keeps state
    (:func:`~lamploop.sync.strategy.keeps_state`: PowerSGD's error feedback...): every
    rank's :class:`SyncState` is saved as ``sync`` / ``sync.rank<r>`` and, on resume, the root
    hands each rank its own over the process group (no shared file system needed).

    Args:
        extras: this rank's extras by name.
        rank, nranks: this rank's place.
        resumed_from: the checkpoint this rank restored its extras from (its directory
            name), ``None`` on a fresh run; the ranks must agree on it.
        saved_sync: the root's: every rank's saved sync state, from the checkpoint the run
            resumes from (names ``sync`` and ``sync.rank<r>``; ``None`` on a fresh run).
    """

    def __init__(
        self,
        extras: Mapping[str, CheckpointExtra],
        *,
        rank: int,
        nranks: int,
        resumed_from: str | None = None,
        saved_sync: Mapping[str, ExtraState] | None = None,
    ) -> None:
        self.own = dict(extras)
        self.rank, self.nranks = rank, nranks
        self.resumed_from = resumed_from
        self.saved_sync = dict(saved_sync) if saved_sync is not None else None
        self.sync: SyncState | None = None
        self._lock = threading.Lock()  # gathered on the training thread, saved on the event loop
        self._gathered: dict[str, _Captured] = {}

    def _mine(self) -> dict[str, CheckpointExtra]:
        return {**self.own, SYNC_EXTRA: self.sync} if self.sync is not None else self.own

    @property
    def at_epoch_ends_only(self) -> bool:
        """Whether a checkpoint holds state that is consistent at epoch ends only (extras, sync state)."""
        return bool(self.own) or self.sync is not None

    def __getitem__(self, name: str) -> CheckpointExtra:
        mine = self._mine()
        if name in mine:
            return mine[name]
        with self._lock:
            return self._gathered[name]

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter([*self._mine(), *self._gathered])

    def __len__(self) -> int:
        with self._lock:
            return len(self._mine()) + len(self._gathered)

    def keep_sync_state(self, collectives: Collectives, sync: SyncState) -> None:
        """When the ranks meet, on every rank of a run whose strategy keeps state: save it from now on,
        and load this rank's saved state (the root sends each rank its own)."""
        self.sync = sync
        payload = b""
        if self.rank == 0 and self.saved_sync is not None:  # resuming
            per_rank = {}
            for rank in range(self.nranks):
                name = rank_extra_name(SYNC_EXTRA, rank)
                if name not in self.saved_sync:
                    have = sorted(self.saved_sync)
                    msg = (
                        f"the checkpoint the run resumes from has no sync state {name!r} for rank {rank} "
                        f"(it has {have}): was it written with another strategy or number of ranks?"
                    )
                    raise CheckpointError(msg)
                per_rank[str(rank)] = self.saved_sync[name]
            payload = _encode(per_rank)
        received = collectives.broadcast_bytes(payload, "saved sync states")
        if received:
            tensors, meta = _decode(received, 0)[str(self.rank)]
            sync.load_state_dict(tensors, meta)

    def meet(self, collectives: Collectives) -> None:
        """When the ranks meet (every rank calls it): check agreement, introduce the rank-aware extras.

        Raises:
            DistributedError: the ranks carry extras of other names, or resumed them from
                different checkpoints.
        """
        collectives.check_agreement("checkpoint extras", json.dumps(sorted(self.own)))
        collectives.check_agreement(
            "checkpoint the extras were restored from (does every rank see checkpoint_dir?)",
            json.dumps(self.resumed_from),
        )
        aware = {name: e for name, e in self.own.items() if isinstance(e, RankAware)}
        if not aware:
            return
        mine = {name: extra.rank_info() for name, extra in aware.items()}
        everyone = collectives.gather_json(mine, "checkpoint extras' rank information")
        for name, extra in aware.items():
            extra.ranks_joined([rank_info[name] for rank_info in everyone], self.rank)

    def after_training_pass(self, collectives: Collectives) -> None:
        """Send the followers' extras to the root (every rank calls it, on the thread that trains)."""
        if not self.at_epoch_ends_only or self.nranks == 1:
            return
        payload = b"" if self.rank == 0 else _encode(capture_extras(self._mine()))
        received = collectives.gather_bytes_to_root(payload, "followers' checkpoint extras")
        if received is None:
            return
        gathered = {}
        for rank, data in enumerate(received[1:], 1):
            for name, state in _decode(data, rank).items():
                gathered[rank_extra_name(name, rank)] = _Captured(state)
        with self._lock:
            self._gathered = gathered


def _encode(states: Mapping[str, ExtraState]) -> bytes:
    """``u32 JSON length | JSON {name: meta} | safetensors of every tensor as "<name>/<key>"``."""
    metas = json.dumps({name: meta for name, (_, meta) in states.items()}).encode()
    tensors = {
        f"{name}/{key}": t.detach().cpu().contiguous()
        for name, (ts, _) in states.items()
        for key, t in ts.items()
    }
    return len(metas).to_bytes(4, "big") + metas + safetensors.torch.save(tensors)


def _decode(data: bytes, rank: int) -> dict[str, ExtraState]:
    try:
        length = int.from_bytes(data[:4], "big")
        metas = json.loads(data[4 : 4 + length].decode())
        flat = safetensors.torch.load(data[4 + length :])
    except Exception as exc:  # damaged bytes: whatever the parsers raise (safetensors has its own error)
        msg = f"rank {rank}'s checkpoint extras arrived damaged: {exc}"
        raise DistributedError(msg) from exc
    states: dict[str, ExtraState] = {name: ({}, meta) for name, meta in metas.items()}
    for key, tensor in flat.items():
        name, _, tensor_key = key.partition("/")
        states[name][0][tensor_key] = tensor
    return states


class SyncState:
    """A rank's gradient-sync state (``GradientSync.state_dict()``) as a checkpoint extra.

    With ``optimizer`` (a strategy whose ranks step on their own gradients, such as local
    SGD, so that their optimizer states differ) the rank's optimizer state goes with it: its
    tensors as ``optimizer/<path>``, its structure in the meta.
    """

    def __init__(self, sync: GradientSync, optimizer: torch.optim.Optimizer | None = None) -> None:
        self._sync = sync
        self._optimizer = optimizer

    def state_dict(self) -> ExtraState:
        tensors = {k: v.detach().cpu().clone() for k, v in self._sync.state_dict().items()}
        if self._optimizer is None:
            return tensors, {}
        optimizer_tensors: dict[str, torch.Tensor] = {}
        skeleton = encode_tree(self._optimizer.state_dict(), optimizer_tensors, error=CheckpointError)
        tensors.update({f"{_OPTIMIZER}{k}": v.detach().cpu().clone() for k, v in optimizer_tensors.items()})
        return tensors, {"optimizer": skeleton}

    def load_state_dict(self, tensors: Mapping[str, torch.Tensor], meta: Any) -> None:
        own = {k: v for k, v in tensors.items() if not k.startswith(_OPTIMIZER)}
        self._sync.load_state_dict(own)
        if self._optimizer is not None:
            if not isinstance(meta, Mapping) or "optimizer" not in meta:
                msg = "the saved sync state has no optimizer state for this rank (saved by another strategy?)"
                raise CheckpointError(msg)
            optimizer_tensors = {
                k[len(_OPTIMIZER) :]: v for k, v in tensors.items() if k.startswith(_OPTIMIZER)
            }
            state = decode_tree(
                meta["optimizer"], optimizer_tensors, "a rank's optimizer state", error=CheckpointError
            )
            self._optimizer.load_state_dict(state)


_OPTIMIZER = "optimizer/"


def rank_extras(extras: Mapping[str, CheckpointExtra] | None, rank: int, nranks: int) -> RankExtras | None:
    """``extras`` as this rank's :class:`RankExtras` (as given when it is one; ``None`` for none)."""
    if extras is None or isinstance(extras, RankExtras):
        return extras
    return RankExtras(check_extras("checkpoint_extras", extras), rank=rank, nranks=nranks)
