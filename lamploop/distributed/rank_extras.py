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

__all__ = ["RankExtras", "rank_extras"]


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

    Args:
        extras: this rank's extras by name.
        rank, nranks: this rank's place.
        resumed_from: the checkpoint this rank restored its extras from (its directory
            name), ``None`` on a fresh run; the ranks must agree on it.
    """

    def __init__(
        self,
        extras: Mapping[str, CheckpointExtra],
        *,
        rank: int,
        nranks: int,
        resumed_from: str | None = None,
    ) -> None:
        self.own = dict(extras)
        self.rank, self.nranks = rank, nranks
        self.resumed_from = resumed_from
        self._lock = threading.Lock()  # gathered on the training thread, saved on the event loop
        self._gathered: dict[str, _Captured] = {}

    def __getitem__(self, name: str) -> CheckpointExtra:
        if name in self.own:
            return self.own[name]
        with self._lock:
            return self._gathered[name]

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter([*self.own, *self._gathered])

    def __len__(self) -> int:
        with self._lock:
            return len(self.own) + len(self._gathered)

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
        if not self.own or self.nranks == 1:
            return
        payload = b"" if self.rank == 0 else _encode(capture_extras(self.own))
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


def rank_extras(extras: Mapping[str, CheckpointExtra] | None, rank: int, nranks: int) -> RankExtras | None:
    """``extras`` as this rank's :class:`RankExtras` (as given when it is one; ``None`` for none)."""
    if extras is None or isinstance(extras, RankExtras):
        return extras
    return RankExtras(check_extras("checkpoint_extras", extras), rank=rank, nranks=nranks)
