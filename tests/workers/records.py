"""What a test's worker process and the test hand each other, without pickle.

A record (a nested value of dicts, lists, tuples, tensors, numbers, strings and None) is saved
as JSON beside a safetensors file of its tensors, by lamploop's own tree codec
(:func:`lamploop.checkpoint.codec.encode_tree`, which checkpoints use for optimizer state).
A :class:`lamploop.LoopState` goes through :data:`lamploop.state.converter` first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lamploop.checkpoint.codec import decode_tree, encode_tree

__all__ = ["load_record", "save_record", "write_whole"]


def save_record(value: Any, path: str | Path) -> None:
    """Write ``value`` to ``path`` (JSON) and ``path.safetensors`` (its tensors): the tensors
    first, then the JSON whole (:func:`write_whole`), so that a test that polls for ``path``
    finds both complete."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = encode_tree(value, tensors)
    alone = {name: tensor.detach().cpu().contiguous().clone() for name, tensor in tensors.items()}
    save_file(alone, f"{path}.safetensors")
    write_whole(Path(path), json.dumps(skeleton))


def load_record(path: str | Path) -> Any:
    """The value :func:`save_record` wrote to ``path``."""
    return decode_tree(json.loads(Path(path).read_text()), load_file(f"{path}.safetensors"), str(path))


def write_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a temporary name, then a rename): the test
    polls for the file, then reads it.  The temporary name holds the writer's pid: two processes
    may write the same record."""
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    part.write_text(text)
    os.replace(part, path)
