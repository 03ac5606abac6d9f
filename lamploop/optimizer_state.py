"""An optimizer's ``state_dict`` as JSON plus a list of tensors, and back.

Neither a checkpoint nor the tensor channel may pickle, so the state dict is
split: every tensor leaf is replaced by ``{"__tensor__": i}`` in a JSON-ready
skeleton and listed separately.  Integer keys (torch keys per-parameter state
by index) survive the trip as ``{"__int_keys__": {...}}`` mappings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["join_state", "split_state"]

_TENSOR = "__tensor__"
_INT_KEYS = "__int_keys__"


def split_state(state: Mapping[str, Any]) -> tuple[Any, list[torch.Tensor]]:
    """``(skeleton, tensors)``: the JSON-ready structure and the tensor leaves in order."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return {_TENSOR: len(tensors) - 1}
        if isinstance(value, Mapping):
            if value and all(isinstance(k, int) for k in value):
                return {_INT_KEYS: {str(k): walk(v) for k, v in value.items()}}
            return {str(k): walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        msg = f"optimizer state holds a {type(value).__name__}, which cannot be stored without pickle"
        raise TypeError(msg)

    return walk(state), tensors


def join_state(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """Rebuild the structure :func:`split_state` took apart."""

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) == {_TENSOR}:
                return tensors[value[_TENSOR]]
            if set(value) == {_INT_KEYS}:
                return {int(k): walk(v) for k, v in value[_INT_KEYS].items()}
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(skeleton)


def tensor_specs(tensors: Sequence[torch.Tensor]) -> list[tuple[list[int], str]]:
    """Shapes and dtype names of ``tensors``, JSON-ready."""
    return [(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]


def empty_like_specs(specs: Sequence[tuple[Sequence[int], str]], device: torch.device) -> list[torch.Tensor]:
    """Uninitialised tensors matching :func:`tensor_specs`."""
    return [torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device) for shape, dtype in specs]
