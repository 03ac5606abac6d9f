"""Saving a sharded model: every rank writes its own rows to its shard file, rank 0 the index.

Two ways in.  :func:`save_sharded` writes a checkpoint of its own, atomically: every rank
writes its file into one temporary directory (its name chosen by rank 0 and broadcast),
fsynced; the ranks then exchange their files' hashes; rank 0 writes the index and renames
the directory into place, then moves ``latest``.  A rank killed at any point before the
rename leaves the previous checkpoint and ``latest`` as they were (the temporary directory
is removed by the next save on that host, as for other checkpoints).  :class:`ShardWriter`
instead puts every rank's shards into the ordinary checkpoint the root is writing
(:func:`~lamploop.checkpoint.save_checkpoint`, given a :class:`ShardedModelState`).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lamploop.checkpoint.codec import encode_tree
from lamploop.checkpoint.files import (
    _prune,
    _remove_stale_temporaries,
    _temp_name,
    _write_latest,
    _write_tensors,
    make_directory,
)
from lamploop.checkpoint.format import checkpoint_name
from lamploop.checkpoint.sharded_index import (
    _BEST,
    _MODEL,
    _OPTIMIZER,
    _index,
    _rows_of,
    _write_index,
    shard_file,
)
from lamploop.errors import CheckpointError
from lamploop.strict_json import fsync_dir
from lamploop.sync.collectives import Collectives
from lamploop.sync.fsdp import is_dtensor

__all__ = ["ShardWriter", "ShardedModelState", "save_sharded"]


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """(this rank's rows, the full shape, sharded?) of a parameter or state tensor."""
    if is_dtensor(tensor):
        return tensor.to_local(), tuple(tensor.shape), True
    return tensor, tuple(tensor.shape), False


def _own_tensors(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rank: int,
    nranks: int,
    best: Mapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors to write, and their index entries (``rows`` per name)."""
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, Any] = {}

    def put(key: str, value: torch.Tensor) -> None:
        local, shape, sharded = _local(value.detach())
        if not sharded and rank != 0:
            return  # the same on every rank: rank 0's copy is the one
        offset, rows = (
            _rows_of(shape[0], rank, nranks) if sharded and shape else (0, shape[0] if shape else 0)
        )
        if sharded and local.shape[0] != rows:
            msg = f"{key}: rank {rank} holds {local.shape[0]} rows, dim-0 chunking gives {rows}"
            raise CheckpointError(msg)
        tensors[key] = local.cpu().contiguous()
        entries[key] = {
            "dtype": str(local.dtype).removeprefix("torch."),
            "shape": list(shape),
            "offset": offset,
            "rows": rows,
        }

    names = {}
    for name, p in module.named_parameters():
        names[id(p)] = name
        put(_MODEL + name, p)
    for name, b in module.named_buffers():
        put(_MODEL + name, b)
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                for key, value in optimizer.state.get(p, {}).items():
                    if not isinstance(value, torch.Tensor):
                        kind = type(value).__name__
                        msg = f"optimizer state {key!r} of {names[id(p)]!r} is a {kind}, not a tensor"
                        raise CheckpointError(msg)
                    put(f"{_OPTIMIZER}{names[id(p)]}/{key}", value)
    for name, value in (best or {}).items():
        put(_BEST + name, value)
    return tensors, entries


def _param_groups(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
    """The optimizer's param groups as JSON, parameters by name (``None`` without an optimizer)."""
    if optimizer is None:
        return None
    names = {id(p): name for name, p in module.named_parameters()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    tensors: dict[str, torch.Tensor] = {}
    encoded = encode_tree(groups, tensors, error=CheckpointError)
    if tensors:
        msg = "the optimizer's param groups hold tensors; a sharded checkpoint keeps them as JSON"
        raise CheckpointError(msg)
    return encoded


def _write_and_gather(
    directory: pathlib.Path,
    collectives: Collectives,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    best: Mapping[str, torch.Tensor] | None,
) -> list[Any]:
    """Every rank: its shard file into ``directory``; returns every rank's file, hash, size and entries."""
    rank, nranks = collectives.rank, collectives.nranks
    tensors, entries = _own_tensors(module, optimizer, rank, nranks, best)
    file = shard_file(rank, nranks)
    record = _write_tensors(directory / file, tensors, f"{directory / file}")
    mine = {"file": file, "sha256": record.sha256, "size": record.size, "entries": entries}
    return collectives.gather_json(mine, "sharded checkpoint's files")


def save_sharded(
    root: str | os.PathLike[str],
    *,
    collectives: Collectives,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    epoch: int,
    step: int | None = None,
    meta: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
) -> pathlib.Path:
    """Write this rank's shards of ``module`` and ``optimizer``; every rank calls it alike.

    Returns the checkpoint directory (``root/epoch-...``), in place on every rank when the
    call returns.  ``meta`` (JSON-ready) goes into the index as is.

    Raises:
        CheckpointError: (on every rank) a tensor cannot be stored, the directory exists
            already, or rank 0 could not put it in place.
        DistributedError: a collective failed (a rank was lost while saving).
    """
    root_path = pathlib.Path(root)
    name = checkpoint_name(epoch, step)
    rank, nranks = collectives.rank, collectives.nranks
    final = root_path / name
    chosen: list[str] | None = None
    if rank == 0:
        make_directory(root_path, "save_sharded_checkpoint")
        _remove_stale_temporaries(root_path)
        taken = f"{final}: a checkpoint of that name exists already" if final.exists() else ""
        chosen = [_temp_name(name), taken]
    temp_name, taken = collectives.broadcast_json(chosen, "sharded checkpoint's name")
    if taken:  # every rank refuses alike, before anything is written
        raise CheckpointError(taken)
    temp = root_path / temp_name
    temp.mkdir(parents=True, exist_ok=True)
    everyone = _write_and_gather(temp, collectives, module, optimizer, None)
    problem = ""
    if rank == 0:
        try:
            _place(root_path, temp, final, _index(everyone, nranks, _param_groups(module, optimizer), meta))
            if keep_last is not None:
                _prune(root_path, keep_last, final)
        except (OSError, CheckpointError) as e:
            problem = f"{final}: rank 0 could not put the checkpoint in place: {e}"
    # The followers return once the checkpoint is in place, or raise with rank 0.
    problem = collectives.broadcast_json(problem if rank == 0 else None, "sharded checkpoint placed")
    if problem:
        raise CheckpointError(problem)
    return final


def _place(root: pathlib.Path, temp: pathlib.Path, final: pathlib.Path, index: dict[str, Any]) -> None:
    """Rank 0: the index into the temporary directory, the directory into place, then ``latest``."""
    _write_index(temp, index)
    fsync_dir(temp)
    os.rename(temp, final)  # the step that makes it a checkpoint: before it, nothing changed
    fsync_dir(root)
    _write_latest(root, final.name)


class ShardWriter:
    """Every rank's part of a checkpoint of a sharded run: its shards, into the root's directory.

    The drivers' checkpoints of a sharded model (strategy ``fsdp``) are ordinary checkpoint
    directories (descriptor, RNG states, extras: written by the root alone, see
    :func:`~lamploop.checkpoint.save_checkpoint`) that also hold the shard files and
    ``sharded.json`` (:mod:`lamploop.checkpoint.sharded`), in place of ``model.safetensors``'s and
    ``optimizer.safetensors``' tensors and of the best model.  The root's
    :func:`~lamploop.checkpoint.save_checkpoint` calls :meth:`write_into` with its temporary
    directory before renaming it into place; every follower answers with :meth:`serve` at the
    same point of its run.  The root then calls :meth:`end` once per checkpoint it was asked
    for, written or not, so that the followers never wait for a write that will not come.

    Args:
        collectives: the run's process group.
        module: this rank's sharded module.
        optimizer: its optimizer over the shards.
        best: this rank's shards of the best model so far (``{}``: none yet), asked at each write.
    """

    def __init__(
        self,
        collectives: Collectives,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        best: Callable[[], Mapping[str, torch.Tensor]],
    ) -> None:
        self.collectives = collectives
        self.module = module
        self.optimizer = optimizer
        self.best = best
        self._wrote = False

    def _write_own(self, directory: pathlib.Path) -> list[Any]:
        return _write_and_gather(directory, self.collectives, self.module, self.optimizer, self.best())

    def write_into(self, directory: pathlib.Path) -> None:
        """The root, inside ``save_checkpoint``: every rank's shards and the index into ``directory``."""
        self._wrote = True
        self.collectives.broadcast_json({"directory": str(directory)}, "sharded checkpoint's directory")
        everyone = self._write_own(directory)
        index = _index(everyone, self.collectives.nranks, _param_groups(self.module, self.optimizer), None)
        _write_index(directory, index)

    def end(self, error: BaseException | None) -> None:
        """The root, after each checkpoint it was asked for: tell the followers how it ended."""
        if not self._wrote:  # no write came (a writer that chose not to): the followers skip it
            self.collectives.broadcast_json(None, "sharded checkpoint's directory")
            return
        self._wrote = False
        problem = "" if error is None else f"rank 0 could not write the checkpoint: {error}"
        self.collectives.broadcast_json(problem, "sharded checkpoint written")

    def serve(self) -> None:
        """A follower, where the root checkpoints: write this rank's shards into its directory.

        Raises:
            CheckpointError: the root could not write or place the checkpoint.
        """
        request = self.collectives.broadcast_json(None, "sharded checkpoint's directory")
        if request is None:
            return
        self._write_own(pathlib.Path(request["directory"]))
        problem = self.collectives.broadcast_json(None, "sharded checkpoint written")
        if problem:
            raise CheckpointError(problem)


class ShardedModelState(dict[str, torch.Tensor]):
    """The ``model`` of a sharded run's checkpoint state: empty, with the :class:`ShardWriter` to call.

    :func:`~lamploop.checkpoint.save_checkpoint` then writes the shards of every rank into the
    checkpoint (see :class:`ShardWriter`) instead of a model state dict.
    """

    def __init__(self, writer: ShardWriter) -> None:
        super().__init__()
        self.shard_writer = writer
