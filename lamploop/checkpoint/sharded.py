"""Checkpoints of a sharded model (strategy ``fsdp``): per-rank safetensors shards and a JSON index.

No rank ever gathers the whole model.  A checkpoint directory (named like any other,
``epoch-000006`` or ``epoch-000005-step-000120``, beside the same ``latest`` pointer) holds::

    shard-rank00000-of-00002.safetensors    rank 0's shards: "model/<param>", "optimizer/<param>/<key>"
    shard-rank00001-of-00002.safetensors    rank 1's
    sharded.json                            the index (below)

``sharded.json`` lists each shard file's size and sha256 and, for every tensor, its dtype,
full shape and the rows of dim 0 each file holds (its fields:
:mod:`~lamploop.checkpoint.sharded_index`).  Dim-0 rows are how FSDP2 cuts a parameter
(``torch.chunk`` over the ranks), so any world size reads any other's shards.

Writing (:mod:`~lamploop.checkpoint.sharded_save`: :func:`save_sharded`, or
:class:`ShardWriter` inside an ordinary checkpoint) is atomic: a rank killed at any point
before rank 0 renames the directory into place leaves the previous checkpoint and
``latest`` as they were.  Loading (:mod:`~lamploop.checkpoint.sharded_load`:
:func:`load_sharded`) checks every file's size and sha256 first
(:mod:`~lamploop.checkpoint.sharded_verify`: :func:`verify_sharded`), then reads only the
rows of this rank's shards (safetensors slices), at any world size; on a model that is not
sharded (one rank) it loads full tensors: :func:`read_full` gives the whole model and
optimizer state for an ordinary checkpoint.  This module gathers those modules' names.

.. versionadded:: 0.3
"""

from __future__ import annotations

from lamploop.checkpoint.sharded_index import (
    SHARDED_FORMAT,
    SHARDED_INDEX,
    is_sharded_checkpoint,
    shard_file,
    sharded_model_spec,
)
from lamploop.checkpoint.sharded_load import (
    ShardsOnDisk,
    load_best_sharded,
    load_sharded,
    read_best,
    read_full,
)
from lamploop.checkpoint.sharded_save import ShardedModelState, ShardWriter, save_sharded
from lamploop.checkpoint.sharded_verify import sharded_file_checks, verify_sharded

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
