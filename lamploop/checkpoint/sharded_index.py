"""The index of a sharded checkpoint (``sharded.json``): its names, its format, and whose rows are where.

``sharded.json``: ``format`` (``"lamploop-sharded"``), ``format_version``, ``world_size``,
``files`` (each shard file's ``sha256`` and ``size``), ``tensors`` (for each tensor name its
``dtype``, full ``shape`` and ``shards``: ``[{"rank", "file", "offset", "rows"}]``, the rows
``[offset, offset + rows)`` of dim 0 that file holds; a tensor that is not sharded, such as
a step count, has one shard with all its rows, rank 0's), ``param_groups`` (the optimizer's
options per group, JSON via :mod:`lamploop.checkpoint.codec`, with parameter *names*),
and ``meta`` (the caller's JSON: loop state, say).

Tensor names in the shard files: ``model/<name>`` (parameters and buffers),
``optimizer/<param>/<key>`` and ``best/<name>`` (the best model, in a driver's checkpoint).
Dim-0 rows are how FSDP2 cuts a parameter (``torch.chunk`` over the ranks, :func:`_rows_of`),
so any world size reads any other's shards.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any, Final

import attrs

from lamploop.checkpoint.files import read_json_object
from lamploop.checkpoint.format import _FileRecord
from lamploop.errors import CheckpointError
from lamploop.modelspec import ModelSpec, TensorSpec

__all__ = ["SHARDED_FORMAT", "SHARDED_INDEX", "is_sharded_checkpoint", "shard_file", "sharded_model_spec"]


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


def _index(
    everyone: list[Any], nranks: int, param_groups: Any, meta: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The index of every rank's shard file (``everyone``, in rank order: file, hash, size, entries)."""
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


def _write_index(directory: pathlib.Path, index: Mapping[str, Any]) -> None:
    """``index`` as ``directory``'s ``sharded.json``, fsynced (the directory's own fsync is the caller's)."""
    with open(directory / SHARDED_INDEX, "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=1))
        f.flush()
        os.fsync(f.fileno())


@attrs.frozen
class _Index:
    """``sharded.json`` read back, its directory beside it."""

    directory: pathlib.Path
    world_size: int
    files: dict[str, _FileRecord]
    tensors: dict[str, Any]
    param_groups: Any
    meta: dict[str, Any]


def _read_index(directory: pathlib.Path) -> _Index:
    """``directory``'s index, its format, version and shape checked (its files are ``sharded_verify``'s)."""
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
