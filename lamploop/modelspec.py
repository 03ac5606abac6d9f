"""What a model's tensors look like: names, shapes and dtypes, without the values.

Two processes that train one model must agree on this; so must a checkpoint and
the model it is loaded into.  :func:`describe_mismatch` says exactly where two
specs differ, so refusals can name the first parameter that does not fit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import attrs
import cattrs
import torch

from lamploop.errors import ConfigurationError
from lamploop.model import unwrapped

__all__ = [
    "ModelSpec",
    "TensorSpec",
    "describe_mismatch",
    "model_spec",
    "model_spec_from_json",
    "model_spec_to_json",
    "register_model_spec_json",
]


@attrs.frozen
class TensorSpec:
    """One named tensor: its name in the state dict, its shape and its dtype (``"float32"``...)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@attrs.frozen
class ModelSpec:
    """The ordered tensor specs of a model's ``state_dict`` (or any name -> tensor mapping)."""

    tensors: tuple[TensorSpec, ...]

    def fingerprint(self) -> str:
        """A sha256 hex digest of the names, shapes and dtypes, in order."""
        digest = hashlib.sha256()
        for t in self.tensors:
            digest.update(f"{t.name}|{','.join(map(str, t.shape))}|{t.dtype}\n".encode())
        return digest.hexdigest()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_spec(tensors: torch.nn.Module | Mapping[str, torch.Tensor]) -> ModelSpec:
    """The spec of a module's ``state_dict()`` or of a name -> tensor mapping.

    Raises:
        ConfigurationError: ``tensors`` is neither, or a value of the mapping is no tensor.
    """
    state = unwrapped(tensors).state_dict() if isinstance(tensors, torch.nn.Module) else tensors
    if not isinstance(state, Mapping):
        what = type(state).__name__
        msg = f"model_spec: tensors must be a torch.nn.Module or a mapping of names to tensors, got {what}"
        raise ConfigurationError(msg)
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            msg = f"model_spec: tensor {name!r} is a {type(value).__name__}, not a torch.Tensor"
            raise ConfigurationError(msg)
    return ModelSpec(
        tuple(
            TensorSpec(name, tuple(int(d) for d in t.shape), _dtype_name(t.dtype))
            for name, t in state.items()
        )
    )


def describe_mismatch(
    expected: ModelSpec, actual: ModelSpec, *, expected_label: str = "expected", actual_label: str = "actual"
) -> str | None:
    """Say where two specs differ, or return ``None`` when they are equal.

    The message names the first missing, extra or different tensor, for example
    ``"tensor 'fc.weight': expected shape (10, 4), actual shape (10, 5)"``.
    """
    if expected == actual:
        return None
    exp = {t.name: t for t in expected.tensors}
    act = {t.name: t for t in actual.tensors}
    missing = [n for n in exp if n not in act]
    extra = [n for n in act if n not in exp]
    parts: list[str] = []
    if missing:
        parts.append(f"{actual_label} lacks tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        parts.append(f"{actual_label} has unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    for name, e in exp.items():
        a = act.get(name)
        if a is None:
            continue
        if a.shape != e.shape:
            parts.append(f"tensor {name!r}: {expected_label} shape {e.shape}, {actual_label} shape {a.shape}")
            break
        if a.dtype != e.dtype:
            parts.append(f"tensor {name!r}: {expected_label} dtype {e.dtype}, {actual_label} dtype {a.dtype}")
            break
    if not parts:
        parts.append(f"the tensors are in another order ({expected_label} vs {actual_label})")
    return "; ".join(parts)


def model_spec_to_json(spec: ModelSpec) -> list[list[Any]]:
    """``spec`` as JSON: ``[[name, [dims...], dtype], ...]`` in order."""
    return [[t.name, list(t.shape), t.dtype] for t in spec.tensors]


def model_spec_from_json(value: Any, _type: Any = None) -> ModelSpec:
    """The inverse of :func:`model_spec_to_json`, strict (a cattrs structure hook).

    Raises:
        TypeError: not a list of ``[name, [non-negative ints], dtype]``.
    """
    if not isinstance(value, list):
        msg = f"a model spec is a list of [name, shape, dtype], got {type(value).__name__}"
        raise TypeError(msg)
    tensors = []
    for item in value:
        ok = (
            isinstance(item, list)
            and len(item) == 3
            and isinstance(item[0], str)
            and isinstance(item[1], list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in item[1])
            and isinstance(item[2], str)
        )
        if not ok:
            msg = f"a model spec entry is [name, [non-negative ints], dtype], got {item!r:.80}"
            raise TypeError(msg)
        tensors.append(TensorSpec(item[0], tuple(item[1]), item[2]))
    return ModelSpec(tuple(tensors))


def register_model_spec_json(converter: cattrs.Converter) -> None:
    """Teach ``converter`` the JSON form of :class:`ModelSpec` (both ways)."""
    converter.register_unstructure_hook(ModelSpec, model_spec_to_json)
    converter.register_structure_hook(ModelSpec, model_spec_from_json)
