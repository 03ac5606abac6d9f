"""What a test's worker process and the test hand each other, without pickle.

A record (a nested value of dicts, lists, tuples, tensors, numbers, strings and None) is saved
as JSON beside a safetensors file of its tensors, by lamploop's own tree codec
(:func:`lamploop.checkpoint.codec.encode_tree`, which checkpoints use for optimizer state).
A :class:`lamploop.LoopState` goes through :data:`lamploop.state.converter` first.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lamploop.checkpoint.codec import decode_tree, encode_tree

__all__ = ["load_record", "save_record"]


def save_record(value: Any, path: str | Path) -> None:
    """Write ``value`` to ``path`` (JSON) and ``path.safetensors`` (its tensors)."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = encode_tree(value, tensors)
    alone = {name: tensor.detach().cpu().contiguous().clone() for name, tensor in tensors.items()}
    save_file(alone, f"{path}.safetensors")
    Path(path).write_text(json.dumps(skeleton))


def load_record(path: str | Path) -> Any:
    """The value :func:`save_record` wrote to ``path``."""
    return decode_tree(json.loads(Path(path).read_text()), load_file(f"{path}.safetensors"), str(path))
