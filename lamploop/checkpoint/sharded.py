"""Checkpoints of a sharded model (strategy ``fsdp``): per-rank safetensors shards and a JSON index.

No rank ever gathers the whole model.  A checkpoint directory (named like any other,
``epoch-000006`` or ``epoch-000005-step-000120``, beside the same ``latest`` pointer) holds::

    shard-rank00000-of-00002.safetensors    rank 0's shards: "model/<param>", "optimizer/<param>/<key>"
    shard-rank00001-of-00002.safetensors    rank 1's
    sharded.json                            the index (below)

``sharded.json``: ``format`` (``"lamploop-sharded"``), ``format_version``, ``world_size``,
``files`` (each shard file's ``sha256`` and ``size``), ``tensors`` (for each tensor name its
``dtype``, full ``shape`` and ``shards``: ``[{"rank", "file", "offset", "rows"}]``, the rows
``[offset, offset + rows)`` of dim 0 that file holds; a tensor that is not sharded, such as
a step count, has one shard with all its rows, rank 0's), ``param_groups`` (the optimizer's
options per group, JSON via :mod:`lamploop.checkpoint.codec`, with parameter *names*),
and ``meta`` (the caller's JSON: loop state, say).  Dim-0 rows are how FSDP2 cuts a
parameter (``torch.chunk`` over the ranks), so any world size reads any other's shards.

Writing is atomic: every rank writes its file into one temporary directory (its name chosen
by rank 0 and broadcast), fsynced; the ranks then exchange their files' hashes; rank 0
writes the index and renames the directory into place, then moves ``latest``.  A rank killed
at any point before the rename leaves the previous checkpoint and ``latest`` as they were
(the temporary directory is removed by the next save on that host, as for other
checkpoints).  Loading (:func:`load_sharded`) checks every file's size and sha256 first,
then reads only the rows of this rank's shards (safetensors slices), at any world size; on a
model that is not sharded (one rank) it loads full tensors: :func:`read_full` gives the whole
model and optimizer state for an ordinary checkpoint.

.. versionadded:: 0.4
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs
import safetensors
import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from lamploop.checkpoint.codec import decode_tree, encode_tree
from lamploop.checkpoint.files import (
    _prune,
    _remove_stale_temporaries,
    _temp_name,
    _write_latest,
    _write_tensors,
    read_json_object,
)
from lamploop.checkpoint.format import _CHECKPOINT_NAME, DESCRIPTOR_NAME, _FileRecord, checkpoint_name
from lamploop.checkpoint.integrity import FileCheck, check_file, file_size
from lamploop.errors import CheckpointError
from lamploop.modelspec import ModelSpec, TensorSpec
from lamploop.strict_json import fsync_dir
from lamploop.sync.collectives import Collectives

__all__ = [
    "SHARDED_FORMAT",
    "SHARDED_INDEX",
    "ShardWriter",
    "ShardedModelState",
    "ShardsOnDisk",
    "is_sharded_checkpoint",
    "load_best_sharded",
    "load_sharded",
    "read_best",
    "read_full",
    "save_sharded",
    "shard_file",
    "sharded_file_checks",
    "sharded_model_spec",
    "verify_sharded",
]

SHARDED_INDEX: Final = "sharded.json"
"""The index's file name inside a sharded checkpoint directory."""
SHARDED_FORMAT: Final = "lamploop-sharded"
_VERSION: Final = 1
_MODEL: Final = "model/"
_OPTIMIZER: Final = "optimizer/"
_BEST: Final = "best/"


def shard_file(rank: int, nranks: int) -> str:
    """Rank ``rank``'s shard file of a checkpoint written by ``nranks`` ranks."""
    return f"shard-rank{rank:05d}-of-{nranks:05d}.safetensors"


def is_sharded_checkpoint(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` holds a sharded checkpoint's index."""
    return (pathlib.Path(directory) / SHARDED_INDEX).is_file()


def _rows_of(full_rows: int, rank: int, nranks: int) -> tuple[int, int]:
    """The dim-0 rows FSDP2 gives ``rank`` (``torch.chunk``): (offset, count)."""
    chunk = math.ceil(full_rows / nranks) if full_rows else 0
    start = min(rank * chunk, full_rows)
    return start, max(0, min(chunk, full_rows - start))


def _local(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], bool]:
    """(this rank's rows, the full shape, sharded?) of a parameter or state tensor."""
    if isinstance(tensor, DTensor):
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
        root_path.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(root_path)
        taken = f"{final}: a checkpoint of that name exists already" if final.exists() else ""
        chosen = [_temp_name(name), taken]
    temp_name, taken = collectives.broadcast_json(chosen, "sharded checkpoint's name")
    if taken:  # every rank refuses alike, before anything is written
        raise CheckpointError(taken)
    temp = root_path / temp_name
    temp.mkdir(parents=True, exist_ok=True)
    tensors, entries = _own_tensors(module, optimizer, rank, nranks)
    file = shard_file(rank, nranks)
    record = _write_tensors(temp / file, tensors, f"{temp / file}")
    mine = {"file": file, "sha256": record.sha256, "size": record.size, "entries": entries}
    everyone = collectives.gather_json(mine, "sharded checkpoint's files")
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
    with open(temp / SHARDED_INDEX, "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=1))
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(temp)
    os.rename(temp, final)  # the step that makes it a checkpoint: before it, nothing changed
    fsync_dir(root)
    _write_latest(root, final.name)


def _index(
    everyone: list[Any], nranks: int, param_groups: Any, meta: Mapping[str, Any] | None
) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for rank, contribution in enumerate(everyone):
        for key, entry in contribution["entries"].items():
            slot = tensors.setdefault(key, {"dtype": entry["dtype"], "shape": entry["shape"], "shards": []})
            slot["shards"].append(
                {"rank": rank, "file": contribution["file"], "offset": entry["offset"], "rows": entry["rows"]}
            )
    return {
        "format": SHARDED_FORMAT,
        "format_version": _VERSION,
        "world_size": nranks,
        "files": {c["file"]: {"sha256": c["sha256"], "size": c["size"]} for c in everyone},
        "tensors": tensors,
        "param_groups": param_groups,
        "meta": dict(meta) if meta is not None else {},
    }


@attrs.frozen
class _Index:
    directory: pathlib.Path
    world_size: int
    files: dict[str, _FileRecord]
    tensors: dict[str, Any]
    param_groups: Any
    meta: dict[str, Any]


def _read_index(directory: pathlib.Path) -> _Index:
    raw = read_json_object(directory / SHARDED_INDEX, CheckpointError)
    where = directory / SHARDED_INDEX
    if raw.get("format") != SHARDED_FORMAT or raw.get("format_version") != _VERSION:
        found = f"format {raw.get('format')!r}, version {raw.get('format_version')!r}"
        msg = f"{where}: not a {SHARDED_FORMAT} index of version {_VERSION} ({found})"
        raise CheckpointError(msg)
    try:
        files = {
            name: _FileRecord(sha256=str(r["sha256"]), size=int(r["size"]))
            for name, r in raw["files"].items()
        }
        return _Index(
            directory,
            int(raw["world_size"]),
            files,
            dict(raw["tensors"]),
            raw["param_groups"],
            dict(raw["meta"]),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        msg = f"{where}: malformed index: {e!r}"
        raise CheckpointError(msg) from e


def _coverage_problems(index: _Index) -> list[str]:
    """Tensors whose shards do not cover their rows exactly once, or name a file not listed."""
    problems = []
    for key, entry in index.tensors.items():
        shape = entry.get("shape", [])
        want = shape[0] if shape else 0
        covered = 0
        for shard in sorted(entry.get("shards", []), key=lambda s: int(s["offset"])):
            if shard["file"] not in index.files:
                problems.append(f"{key}: its shard names {shard['file']!r}, which the index does not list")
            if int(shard["offset"]) != covered:
                problems.append(f"{key}: rows {covered}..{shard['offset']} are missing or overlap")
            covered = int(shard["offset"]) + int(shard["rows"])
        if covered != want:
            problems.append(f"{key}: its shards cover {covered} of {want} rows")
    return problems


def sharded_file_checks(path: str | os.PathLike[str]) -> tuple[FileCheck, ...]:
    """Each file of a sharded checkpoint checked, the index first (what ``verify_checkpoint`` lists).

    The index's check carries what is wrong with it: unreadable, or a tensor whose rows its
    shards do not cover exactly once; each shard file's check its size and sha256.  Files the
    index does not list are noted.
    """
    directory = pathlib.Path(path)
    index_size = file_size(directory / SHARDED_INDEX)
    try:
        index = _read_index(directory)
    except CheckpointError as e:
        return (
            FileCheck(
                SHARDED_INDEX, index_size, problem=str(e).removeprefix(f"{directory / SHARDED_INDEX}: ")
            ),
        )
    coverage = _coverage_problems(index)
    checks = [FileCheck(SHARDED_INDEX, index_size, problem="; ".join(coverage) if coverage else None)]
    checks += [_against_index(check_file(directory, name, record)) for name, record in index.files.items()]
    listed = {SHARDED_INDEX, *index.files}
    present = sorted(p.name for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []
    note = f"not listed in {SHARDED_INDEX} (not read when loading)"
    checks += [
        FileCheck(name, file_size(directory / name), note=note) for name in present if name not in listed
    ]
    return tuple(checks)


def _against_index(check: FileCheck) -> FileCheck:
    """``check_file``'s verdict, naming the index the record came from."""
    if check.problem is None:
        return check
    return attrs.evolve(check, problem=check.problem.replace(DESCRIPTOR_NAME, SHARDED_INDEX))


def verify_sharded(path: str | os.PathLike[str]) -> list[str]:
    """Every problem of a sharded checkpoint directory (empty: it is intact), each naming its file.

    Checks the index, each shard file's size and sha256, and that every tensor's rows are
    covered exactly once.
    """
    directory = pathlib.Path(path)
    return [
        f"{directory / c.name}: {c.problem}" for c in sharded_file_checks(directory) if c.problem is not None
    ]


def _checked(path: str | os.PathLike[str]) -> _Index:
    directory = pathlib.Path(path)
    if not _CHECKPOINT_NAME.fullmatch(directory.name) and (directory / "latest").is_file():
        directory = directory / (directory / "latest").read_text(encoding="utf-8").strip()
    index = _read_index(directory)
    problems = verify_sharded(directory)
    if problems:
        msg = f"{directory}: " + "; ".join(problems)
        raise CheckpointError(msg)
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
        if isinstance(target, DTensor):
            mesh = target.device_mesh
            full_rows = target.shape[0]
            coordinate = mesh.get_coordinate()  # from the mesh itself: no default group asked
            if coordinate is None:
                msg = f"{key}: this rank is not in the parameter's device mesh"
                raise CheckpointError(msg)
            start, count = _rows_of(full_rows, coordinate[0], mesh.size())
            local = self.rows(key, start, count).to(target.device)
            return DTensor.from_local(
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
            target = p.to_local() if isinstance(p, DTensor) else p
            source = value.to_local() if isinstance(value, DTensor) else value
            target.copy_(source)
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state(index, reader, module, optimizer))
    return index.meta


def _optimizer_state(
    index: _Index, reader: _Reader, module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
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


class ShardWriter:
    """Every rank's part of a checkpoint of a sharded run: its shards, into the root's directory.

    The drivers' checkpoints of a sharded model (strategy ``fsdp``) are ordinary checkpoint
    directories (descriptor, RNG states, extras: written by the root alone, see
    :func:`~lamploop.checkpoint.save_checkpoint`) that also hold the shard files and
    ``sharded.json`` of this module, in place of ``model.safetensors``'s and
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
        rank, nranks = self.collectives.rank, self.collectives.nranks
        tensors, entries = _own_tensors(self.module, self.optimizer, rank, nranks, self.best())
        file = shard_file(rank, nranks)
        record = _write_tensors(directory / file, tensors, f"{directory / file}")
        mine = {"file": file, "sha256": record.sha256, "size": record.size, "entries": entries}
        return self.collectives.gather_json(mine, "sharded checkpoint's files")

    def write_into(self, directory: pathlib.Path) -> None:
        """The root, inside ``save_checkpoint``: every rank's shards and the index into ``directory``."""
        self._wrote = True
        self.collectives.broadcast_json({"directory": str(directory)}, "sharded checkpoint's directory")
        everyone = self._write_own(directory)
        index = _index(everyone, self.collectives.nranks, _param_groups(self.module, self.optimizer), None)
        with open(directory / SHARDED_INDEX, "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=1))
            f.flush()
            os.fsync(f.fileno())

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


def sharded_model_spec(path: str | os.PathLike[str]) -> ModelSpec:
    """The whole model's tensor specs (names, full shapes, dtypes) a sharded checkpoint's index lists.

    Read from ``sharded.json`` alone (no shard file is read), e.g. for ``lamploop inspect``'s
    model summary.

    Raises:
        CheckpointError: the index is missing, unreadable or malformed.
    """
    index = _read_index(pathlib.Path(path))
    return ModelSpec(
        tuple(
            TensorSpec(key[len(_MODEL) :], tuple(int(d) for d in entry["shape"]), str(entry["dtype"]))
            for key, entry in index.tensors.items()
            if key.startswith(_MODEL)
        )
    )


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
