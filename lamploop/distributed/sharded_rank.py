"""One rank of a run with a sharded model (strategy ``fsdp``): set-up, best model, checkpoints, result.

What the drivers do differently for a sharded model, on every rank alike:

- *Set-up* (:meth:`ShardedRank.set_up`, after the ranks met and the root's state was
  broadcast): the rank trains a twin of the caller's module, sharded by the strategy
  (:meth:`lamploop.sync.fsdp.FullyShard.prepare`), with the optimizer rebuilt over its
  shards.  The caller's module keeps its parameter objects, but their storage is released
  (each parameter's ``.data`` is an empty tensor while the run lasts): a rank holds ``1/R``
  of the model state, not a full copy beside it.  Resuming from a sharded checkpoint
  (``fit`` does), every rank then loads its own rows of the model, the optimizer state and
  the best model from it, at any number of ranks
  (:func:`~lamploop.checkpoint.sharded.load_sharded`); a best model given whole
  (``init_state.best_model``) is cut into every rank's shards.
- *Next actions* (:meth:`point`): the root's epoch loop decides things the followers, who
  wait for its commands, cannot know: that the epoch just validated gave the best model so
  far, that a checkpoint is due at the epoch's end, that the run is over.  Each command the
  root sends is followed by one broadcast of those actions, carried out by every rank before
  the command: keep the best model (each rank copies its own shards: the best model is
  sharded, never gathered), write the checkpoint (every rank its shards, see
  :class:`~lamploop.checkpoint.sharded.ShardWriter`), and at ``Stop`` install the result.
  The epoch-end checkpoint is therefore written when the next command goes out (the next
  epoch's ``Train``, or ``Stop``), before any step changes the model.
- *Result* (:meth:`install`): the best model's shards if one was kept, else the last ones,
  gathered whole on every rank into the caller's module (its parameters get their storage
  back): ``model.module`` holds the full trained model after the run, as with every other
  strategy.  A run that fails otherwise leaves the caller's module without storage; load
  the run's checkpoint to get the model back.
"""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Mapping
from typing import Any

import torch

from lamploop.checkpoint.sharded import ShardWriter, load_best_sharded, load_sharded
from lamploop.distributed.worker import run_on_worker
from lamploop.errors import CheckpointError, mark_detected_by_every_rank
from lamploop.sync.collectives import AbortSignal, Collectives
from lamploop.sync.fsdp import FullyShard, is_dtensor

__all__ = ["ShardedRank"]


class ShardedRank:
    """A rank's sharded twin of the caller's module, its best shards, and its checkpoint writer."""

    def __init__(
        self,
        collectives: Collectives,
        abort: AbortSignal,
        own: torch.nn.Module,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        self.collectives = collectives
        self.abort = abort
        self.own = own  # the caller's module: its parameters' storage is released meanwhile
        self.module = module  # the sharded twin the rank trains
        self.optimizer = optimizer
        self.best: dict[str, torch.Tensor] = {}
        self.writer = ShardWriter(collectives, module, optimizer, lambda: self.best)

    @classmethod
    def set_up(
        cls,
        collectives: Collectives,
        abort: AbortSignal,
        strategy: FullyShard,
        own: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        best: Mapping[str, torch.Tensor],
        shards_from: pathlib.Path | None = None,
    ) -> ShardedRank:
        """Shard a twin of ``own`` (every rank holds the root's state already); see the module doc.

        ``best``: the root's full best model to resume with (``{}``: none); ``shards_from``:
        the root's sharded checkpoint to resume from, from which every rank loads its rows of
        the model, the optimizer state and the best model (``None``: the state broadcast from
        the root stands).  The followers pass ``{}`` and ``None``.

        Raises:
            CheckpointError: (on every rank) a rank could not load its rows of ``shards_from``.
        """
        names = {id(p): name for name, p in own.named_parameters()}
        twin = copy.deepcopy(own)
        rebuilt = strategy.prepare(collectives, twin, optimizer, names=names)
        rank = cls(collectives, abort, own, twin, rebuilt)
        start = {"best": bool(best), "shards": str(shards_from) if shards_from is not None else None}
        shared = collectives.broadcast_json(start if collectives.rank == 0 else None, "sharded start")
        if shared["shards"] is not None:
            rank._load(pathlib.Path(shared["shards"]))
        elif shared["best"]:
            rank._share_best(best)
        with torch.no_grad():
            for p in own.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return rank

    def _load(self, directory: pathlib.Path) -> None:
        """Every rank its rows of the model, the optimizer state and the best model, from ``directory``."""
        problem = ""
        try:
            load_sharded(directory, module=self.module, optimizer=self.optimizer)
            self.best = load_best_sharded(directory, self.module)
        except CheckpointError as e:
            problem = str(e)
        everyone = self.collectives.gather_json(problem, "sharded checkpoint loaded")
        failed = [(rank, p) for rank, p in enumerate(everyone) if p]
        if failed:
            rank, first = failed[0]
            msg = f"rank {rank} of {len(everyone)} could not load its shards: {first}"
            raise mark_detected_by_every_rank(CheckpointError(msg))

    def _share_best(self, best: Mapping[str, torch.Tensor]) -> None:
        """The root's full best model, cut into every rank's shards."""
        state = self.module.state_dict()
        full = {
            name: (best[name] if self.collectives.rank == 0 else torch.empty(value.shape, dtype=value.dtype))
            .detach()
            .to(self.collectives.device)
            .clone()
            for name, value in state.items()
        }
        self.collectives.broadcast_tensors(list(full.values()), "root's best model")
        self.best = {name: _cut_like(full[name], value) for name, value in state.items()}

    def keep_best(self) -> None:
        """This rank's shards of the model are the best model's now."""
        self.best = {name: value.detach().clone() for name, value in self.module.state_dict().items()}

    def point(self, request: dict[str, Any] | None) -> dict[str, Any]:
        """Every rank after a command: the root's ``request`` (``None`` on followers) for all.

        ``{"best": keep the best model now, "save": a checkpoint follows, "finish": the run is over}``;
        the best model is kept here, the rest is the caller's.
        """
        shared: dict[str, Any] = self.collectives.broadcast_json(request, "the sharded run's next actions")
        if shared["best"]:
            self.keep_best()
        return shared

    async def follow_point(self) -> bool:
        """A follower, after each command: carry out the root's actions; whether the run is over."""

        def actions() -> bool:
            shared = self.point(None)
            if shared["save"]:
                self.writer.serve()
            if shared["finish"]:
                self.install()
            return bool(shared["finish"])

        return await run_on_worker(actions, self.abort)

    async def on_worker(self, work: Any, *args: Any) -> Any:
        """Run blocking collective ``work(*args)`` off the event loop (the heartbeats go on)."""
        return await run_on_worker(lambda: work(*args), self.abort)

    def install(self) -> None:
        """Every rank: the best model (else the last) gathered whole into the caller's module."""
        source = self.best or self.module.state_dict()
        own_parameters = dict(self.own.named_parameters())
        own_buffers = dict(self.own.named_buffers())
        with torch.no_grad():
            for name, value in source.items():
                full = value.full_tensor() if is_dtensor(value) else value
                if name in own_parameters:
                    target = own_parameters[name]
                    target.data = full.detach().to(target.device, copy=True)
                elif name in own_buffers:
                    own_buffers[name].copy_(full)


def _cut_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` cut as the sharded ``like`` is (every rank holds ``full``: no collective)."""
    if is_dtensor(like):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full
