"""Loading a sharded checkpoint: each rank reads only its own rows, at any world size, or one process all.

Every file's size and sha256 is checked first (:mod:`~lamploop.checkpoint.sharded_verify`);
then :class:`_Reader` reads rows by safetensors slices.  :func:`load_sharded` and
:func:`load_best_sharded` cut each tensor as the (sharded, or not) module's is, so a
checkpoint written at one world size loads at another; :func:`read_full` and
:func:`read_best` give the whole tensors, for an ordinary checkpoint or a run of one rank.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import safetensors
import torch
from safetensors import safe_open

from lamploop.checkpoint.codec import decode_tree
from lamploop.checkpoint.format import _CHECKPOINT_NAME
from lamploop.checkpoint.sharded_index import (
    _BEST,
    _MODEL,
    _OPTIMIZER,
    SHARDED_INDEX,
    _Index,
    _read_index,
    _rows_of,
)
from lamploop.checkpoint.sharded_verify import verify_sharded
from lamploop.errors import CheckpointError
from lamploop.sync.fsdp import is_dtensor

__all__ = ["ShardsOnDisk", "load_best_sharded", "load_sharded", "read_best", "read_full"]


def _checked(path: str | os.PathLike[str]) -> _Index:
    """The index of the checkpoint ``path`` names (itself, or a root's ``latest``), its files verified."""
    directory = pathlib.Path(path)
    if not _CHECKPOINT_NAME.fullmatch(directory.name) and (directory / "latest").is_file():
        directory = directory / (directory / "latest").read_text(encoding="utf-8").strip()
    index = _read_index(directory)
    problems = verify_sharded(directory)
    if problems:
        raise CheckpointError("; ".join(problems))  # each names its file: the message starts with one
    return index


class _Reader:
    """Rows of the index's tensors, read from the shard files by safetensors slices."""

    def __init__(self, index: _Index) -> None:
        self.index = index
        self._open: dict[str, Any] = {}

    def _file(self, name: str) -> Any:
        handle = self._open.get(name)
        if handle is None:
            try:
                handle = safe_open(str(self.index.directory / name), framework="pt")
            except (OSError, safetensors.SafetensorError) as e:
                msg = f"{self.index.directory / name}: cannot read: {e}"
                raise CheckpointError(msg) from e
            self._open[name] = handle
        return handle

    def rows(self, key: str, start: int, count: int) -> torch.Tensor:
        entry = self.index.tensors.get(key)
        if entry is None:
            msg = (
                f"{self.index.directory}: the checkpoint has no tensor {key!r} (another model or optimizer?)"
            )
            raise CheckpointError(msg)
        if not entry["shape"]:  # a 0-dim tensor: rank 0's
            whole: torch.Tensor = self._file(entry["shards"][0]["file"]).get_tensor(key)
            return whole
        parts = []
        for shard in entry["shards"]:
            lo, hi = (
                max(start, int(shard["offset"])),
                min(start + count, int(shard["offset"]) + int(shard["rows"])),
            )
            if lo < hi:
                base = int(shard["offset"])
                parts.append(self._file(shard["file"]).get_slice(key)[lo - base : hi - base])
        if not parts:
            dtype = getattr(torch, entry["dtype"])
            return torch.empty((0, *entry["shape"][1:]), dtype=dtype)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def like(self, key: str, target: torch.Tensor) -> torch.Tensor:
        """``key`` cut as ``target`` is: this rank's rows of a DTensor, else the whole tensor."""
        entry = self.index.tensors.get(key)
        if entry is not None and list(entry["shape"]) != list(target.shape):
            msg = f"{key}: saved with shape {entry['shape']}, the model's is {list(target.shape)}"
            raise CheckpointError(msg)
        if is_dtensor(target):
            mesh = target.device_mesh
            full_rows = target.shape[0]
            coordinate = mesh.get_coordinate()  # from the mesh itself: no default group asked
            if coordinate is None:
                msg = f"{key}: this rank is not in the parameter's device mesh"
                raise CheckpointError(msg)
            start, count = _rows_of(full_rows, coordinate[0], mesh.size())
            local = self.rows(key, start, count).to(target.device)
            return type(target).from_local(
                local, mesh, target.placements, shape=target.shape, stride=target.stride()
            )
        full = target.shape[0] if target.dim() else 0
        return self.rows(key, 0, full).to(target.device)


def load_sharded(
    path: str | os.PathLike[str],
    *,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Load a sharded checkpoint into ``module`` (sharded at any world size, or not) and ``optimizer``.

    ``path`` is a checkpoint directory or a root with a ``latest`` pointer.  Each rank reads
    only its own rows.  Returns the index's ``meta``.

    Raises:
        CheckpointError: a file is missing, truncated or altered, or the checkpoint does
            not fit the model or optimizer (names what).
    """
    index = _checked(path)
    reader = _Reader(index)
    with torch.no_grad():
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            value = reader.like(_MODEL + name, p)
            target = p.to_local() if is_dtensor(p) else p
            source = value.to_local() if is_dtensor(value) else value
            target.copy_(source)
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state(index, reader, module, optimizer))
    return index.meta


def _optimizer_state(
    index: _Index, reader: _Reader, module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The ``state_dict()`` for ``optimizer``: this rank's rows of each state tensor, the groups checked."""
    names = {id(p): name for name, p in module.named_parameters()}
    where = f"{index.directory / SHARDED_INDEX}: param_groups"
    saved_groups = decode_tree(index.param_groups, {}, where, error=CheckpointError)
    if not isinstance(saved_groups, list) or len(saved_groups) != len(optimizer.param_groups):
        count = len(saved_groups) if isinstance(saved_groups, list) else 0
        msg = f"{where}: {count} groups saved, the optimizer has {len(optimizer.param_groups)}"
        raise CheckpointError(msg)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    position = 0
    for saved, group in zip(saved_groups, optimizer.param_groups, strict=True):
        own = [names[id(p)] for p in group["params"]]
        if saved["params"] != own:
            msg = f"{where}: the saved group's parameters {saved['params']} differ from the optimizer's {own}"
            raise CheckpointError(msg)
        ids = []
        for name, p in zip(own, group["params"], strict=True):
            prefix = f"{_OPTIMIZER}{name}/"
            keys = [k[len(prefix) :] for k in index.tensors if k.startswith(prefix)]
            if keys:
                state[position] = {
                    key: reader.like(prefix + key, _state_target(p, index, prefix + key)) for key in keys
                }
            ids.append(position)
            position += 1
        groups.append({**saved, "params": ids})
    return {"state": state, "param_groups": groups}


def _state_target(p: torch.Tensor, index: _Index, key: str) -> torch.Tensor:
    """What a state tensor is cut like: its parameter when shaped like it, else a whole tensor."""
    shape = list(index.tensors[key]["shape"])
    if shape == list(p.shape):
        return p.detach()
    return torch.empty(shape, dtype=getattr(torch, index.tensors[key]["dtype"]))


def read_full(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """The whole model state, the optimizer's ``state_dict()`` and the ``meta`` of a sharded checkpoint.

    One process reads every shard (no process group): what an ordinary checkpoint holds
    (``lamploop.checkpoint.save_checkpoint`` writes it), or what a run of one rank loads.
    """
    index = _checked(path)
    reader = _Reader(index)
    model = {
        key[len(_MODEL) :]: reader.rows(key, 0, entry["shape"][0] if entry["shape"] else 0)
        for key, entry in index.tensors.items()
        if key.startswith(_MODEL)
    }
    optimizer: dict[str, Any] = {}
    if index.param_groups is not None:
        where = f"{index.directory / SHARDED_INDEX}: param_groups"
        saved_groups = decode_tree(index.param_groups, {}, where, error=CheckpointError)
        state: dict[int, dict[str, torch.Tensor]] = {}
        groups = []
        position = 0
        for saved in saved_groups:
            ids = []
            for name in saved["params"]:
                prefix = f"{_OPTIMIZER}{name}/"
                entries = {k[len(prefix) :]: e for k, e in index.tensors.items() if k.startswith(prefix)}
                if entries:
                    state[position] = {
                        key: reader.rows(prefix + key, 0, e["shape"][0] if e["shape"] else 0)
                        for key, e in entries.items()
                    }
                ids.append(position)
                position += 1
            groups.append({**saved, "params": ids})
        optimizer = {"state": state, "param_groups": groups}
    return model, optimizer, index.meta


def read_best(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The whole best model a sharded checkpoint keeps (empty when none was kept), read by one process."""
    index = _checked(path)
    reader = _Reader(index)
    return {
        key[len(_BEST) :]: reader.rows(key, 0, entry["shape"][0] if entry["shape"] else 0)
        for key, entry in index.tensors.items()
        if key.startswith(_BEST)
    }


class ShardsOnDisk(dict[str, torch.Tensor]):
    """The ``model`` of a resumed sharded run's state: empty, naming the checkpoint ``directory``.

    :func:`~lamploop.checkpoint.load.load_checkpoint_leaving_shards` gives it; the drivers
    then load every rank's rows of the model, the optimizer state and the best model from
    ``directory`` once the model is sharded (:func:`load_sharded`, :func:`load_best_sharded`),
    instead of broadcasting the whole state from the root.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__()
        self.directory = pathlib.Path(directory)


def load_best_sharded(path: str | os.PathLike[str], module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's rows of the best model a sharded checkpoint keeps, cut as ``module``'s state is.

    Empty when the checkpoint keeps no best model.  ``module`` is sharded (or not, one rank).

    Raises:
        CheckpointError: a file is damaged, or the best model does not fit ``module``.
    """
    index = _checked(path)
    if not any(key.startswith(_BEST) for key in index.tensors):
        return {}
    reader = _Reader(index)
    with torch.no_grad():
        return {
            name: reader.like(_BEST + name, value.detach()).clone()
            for name, value in module.state_dict().items()
        }
