"""Nested state (an optimizer's ``state_dict``) as JSON plus named tensors, and back.

Neither checkpoints nor the tensor channel may pickle, so such state is split:
every tensor leaf is replaced by ``{"$tensor": name}`` in a JSON-ready skeleton
and collected under that name.  Values JSON would change are tagged so they come
back as they were: ``$tuple`` (Adam's betas), ``$int_keys`` (torch keys state by
parameter index), ``$pairs`` (other keys), ``$float`` (nan and inf).  Anything
that is not plain data is refused rather than pickled.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import torch

__all__ = ["decode_tree", "encode_tree"]

_TENSOR_TAG: Final = "$tensor"
_TUPLE_TAG: Final = "$tuple"
_FLOAT_TAG: Final = "$float"
_INT_KEYS_TAG: Final = "$int_keys"
_PAIRS_TAG: Final = "$pairs"


def encode_tree(value: Any, tensors: dict[str, torch.Tensor], *, error: type[Exception] = ValueError) -> Any:
    """JSON for ``value``; every tensor goes into ``tensors`` under a name derived from its path.

    Raises:
        error: ``value`` holds something other than tensors, None, bool, int,
            float, str and lists, tuples and dicts of them.
    """
    return _encode(value, (), tensors, error)


def _path_text(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) or "<root>"


def _encode(
    value: Any, path: tuple[Any, ...], tensors: dict[str, torch.Tensor], error: type[Exception]
) -> Any:
    if isinstance(value, torch.Tensor):
        name = _path_text(path)
        unique, n = name, 1
        while unique in tensors:
            unique, n = f"{name}~{n}", n + 1
        tensors[unique] = value
        return {_TENSOR_TAG: unique}
    if isinstance(value, np.generic) and isinstance(value, (np.bool_, np.integer, np.floating)):
        value = value.item()  # numpy scalars come back as the equal Python scalar
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_FLOAT_TAG: repr(value)}
    if isinstance(value, list):
        return [_encode(v, (*path, i), tensors, error) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {_TUPLE_TAG: [_encode(v, (*path, i), tensors, error) for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        keys = list(value)
        if all(isinstance(k, str) and not k.startswith("$") for k in keys):
            return {k: _encode(v, (*path, k), tensors, error) for k, v in value.items()}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in keys):
            return {_INT_KEYS_TAG: {str(k): _encode(v, (*path, k), tensors, error) for k, v in value.items()}}
        pairs = []
        for k, v in value.items():
            if isinstance(k, torch.Tensor):
                msg = f"state: {_path_text(path)} has a tensor as a key, which cannot be stored"
                raise error(msg)
            pairs.append(
                [_encode(k, (*path, "<key>"), tensors, error), _encode(v, (*path, k), tensors, error)]
            )
        return {_PAIRS_TAG: pairs}
    msg = (
        f"state: {_path_text(path)} is a {type(value).__qualname__}; lamploop stores "
        "tensors, None, bool, int, float, str and lists, tuples and dicts of them (no pickle)"
    )
    raise error(msg)


def decode_tree(
    value: Any, tensors: Mapping[str, torch.Tensor], where: str, *, error: type[Exception] = ValueError
) -> Any:
    """The inverse of :func:`encode_tree`; ``where`` prefixes error messages."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [decode_tree(v, tensors, where, error=error) for v in value]
    if not isinstance(value, dict):
        msg = f"{where}: unexpected JSON value {value!r}"
        raise error(msg)
    tags = [k for k in value if k.startswith("$")]
    if not tags:
        return {k: decode_tree(v, tensors, where, error=error) for k, v in value.items()}
    if len(value) != 1:
        msg = f"{where}: malformed tagged value {value!r}"
        raise error(msg)
    tag, body = next(iter(value.items()))
    try:
        if tag == _TENSOR_TAG:
            return tensors[body]
        if tag == _TUPLE_TAG:
            return tuple(decode_tree(v, tensors, where, error=error) for v in body)
        if tag == _FLOAT_TAG:
            if body not in ("nan", "inf", "-inf"):
                raise ValueError(body)
            return float(body)
        if tag == _INT_KEYS_TAG:
            return {int(k): decode_tree(v, tensors, where, error=error) for k, v in body.items()}
        if tag == _PAIRS_TAG:
            return {
                decode_tree(k, tensors, where, error=error): decode_tree(v, tensors, where, error=error)
                for k, v in body
            }
    except error:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        msg = f"{where}: malformed {tag} value {body!r} ({type(e).__name__}: {e})"
        raise error(msg) from e
    msg = f"{where}: unknown tag {tag!r}"
    raise error(msg)
