"""JSON through cattrs, strictly, and files written atomically: what run configurations, federated
plans and allow-lists share.

Strict means no ``"32"`` for 32, no ``3.0`` for 3, no ``true`` for 1, a list only where a list
or tuple belongs, and no unknown keys; :func:`field_errors` says what is wrong field by field.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import cattrs
import cattrs.cols
import cattrs.errors
import cattrs.gen
import cattrs.v

__all__ = ["field_errors", "fsync_dir", "strict_converter", "write_atomically"]


def _kind(value: object) -> str:
    return type(value).__name__


def _strict_int(value: object, _: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"expected an integer, got {value!r} ({_kind(value)})"
        raise TypeError(msg)
    return value


def _strict_float(value: object, _: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        msg = f"expected a number, got {value!r} ({_kind(value)})"
        raise TypeError(msg)
    return float(value)


def _strict_bool(value: object, _: object) -> bool:
    if not isinstance(value, bool):
        msg = f"expected true or false, got {value!r} ({_kind(value)})"
        raise TypeError(msg)
    return value


def _strict_str(value: object, _: object) -> str:
    if not isinstance(value, str):
        msg = f"expected a string, got {value!r} ({_kind(value)})"
        raise TypeError(msg)
    return value


def _is_sequence_type(t: Any) -> bool:
    return getattr(t, "__origin__", None) in (tuple, list)


def _strict_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _strict_int)
    converter.register_structure_hook(float, _strict_float)
    converter.register_structure_hook(bool, _strict_bool)
    converter.register_structure_hook(str, _strict_str)
    return converter


def strict_converter() -> cattrs.Converter:
    """Strict scalars; a list only where a tuple or list is expected, at every depth (not a string
    or an object); an object only where an attrs class is expected."""
    converter = _strict_converter()
    elements = _strict_converter()

    def sequence_hook(t: Any) -> Callable[[Any, Any], Any]:
        args: tuple[Any, ...] = getattr(t, "__args__", ())
        if t.__origin__ is list:
            structure_items = cattrs.cols.list_structure_factory(t, converter)
        elif len(args) == 2 and args[1] is Ellipsis:
            structure_items = cattrs.cols.homogenous_tuple_structure_factory(t, converter)
        else:  # A fixed-shape tuple: its items are scalars in every format here.
            structure_items = elements.get_structure_hook(t)

        def structure(value: Any, target: Any) -> Any:
            if not isinstance(value, list):
                msg = f"expected a list, got {value!r} ({_kind(value)})"
                raise TypeError(msg)
            return structure_items(value, target)

        return structure

    def object_hook(t: Any) -> Callable[[Any, Any], Any]:
        structure_fields = cattrs.gen.make_dict_structure_fn(t, converter)

        def structure(value: Any, target: Any) -> Any:
            if not isinstance(value, dict):
                msg = f"expected an object, got {value!r} ({_kind(value)})"
                raise TypeError(msg)
            return structure_fields(value, target)

        return structure

    converter.register_structure_hook_factory(_is_sequence_type, sequence_hook)
    converter.register_structure_hook_factory(attrs.has, object_hook)
    return converter


def _describe(exc: BaseException, target: type | None) -> str:
    if isinstance(exc, cattrs.errors.ForbiddenExtraKeysError):
        names = ", ".join(sorted(exc.extra_fields))
        return f"unknown field {names}" if len(exc.extra_fields) == 1 else f"unknown fields {names}"
    if isinstance(exc, KeyError):
        return "missing"
    if isinstance(exc, (TypeError, ValueError)) and str(exc).startswith("expected "):
        return str(exc)
    return cattrs.v.format_exception(exc, target)


def field_errors(exc: Exception) -> list[str]:
    """``"field: what is wrong"`` for each error cattrs found (the field first, no ``$``)."""
    out = []
    for line in cattrs.transform_error(exc, path="$", format_exception=_describe):
        what, _, where = line.rpartition(" @ ")
        field = where.removeprefix("$").removeprefix(".")
        out.append(f"{field}: {what}" if field else what)
    return out


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in directory ``path`` durable (nothing to do on Windows)."""
    if os.name == "nt":  # Windows cannot open a directory to fsync it.
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a hidden temporary sibling, fsync it, and rename it over ``path``."""
    temp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
