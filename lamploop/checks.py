"""Checks of single values, at the bottom of the package: they import lamploop.errors (and torch) only.

Every module that checks an argument imports its check from here, so that the checks of a
setting and the messages they give are written once; :mod:`lamploop.settings`, which
describes a whole run, sits above the loop and the strategies and imports them freely.

>>> from lamploop.checks import check_int
>>> check_int("max_epochs", 3, 0)
3
>>> check_int("max_epochs", -1, 0)
Traceback (most recent call last):
...
lamploop.errors.ConfigurationError: max_epochs must be an int >= 0, got -1
"""

from __future__ import annotations

import inspect
import math
import os
import pathlib
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from lamploop.errors import ConfigurationError

__all__ = [
    "check_bool",
    "check_callable",
    "check_device",
    "check_directory",
    "check_epochs_container",
    "check_host",
    "check_int",
    "check_mapping",
    "check_names",
    "check_parents",
    "check_positive",
    "check_schedule",
    "check_seconds",
    "check_sequence_of",
    "check_smoothing",
    "int_at_least",
    "optional_int_at_least",
    "optional_seconds",
    "seconds",
    "signature_of",
    "takes_one_argument",
]


def check_int(name: str, value: object, low: int) -> int:
    """``value`` if it is an int (not a bool) ``>= low``, else ConfigurationError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        msg = f"{name} must be an int >= {low}, got {value!r}"
        raise ConfigurationError(msg)
    return value


SEED_LIMIT = 2**64
"""Seeds are below this: torch's generators take 64 bits (``manual_seed`` of more overflows)."""


def check_seed(name: str, value: object) -> int:
    """``value`` if it is an int (not a bool) in ``0 .. 2**64 - 1``, a seed torch's generators
    take; else ConfigurationError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        msg = f"{name} must be an int in 0..2**64-1 (torch's generators take 64 bits), got {value!r}"
        raise ConfigurationError(msg)
    return value


def seed_in_range(owner: str | None) -> Validator:
    """An attrs validator: :func:`check_seed` of the field, named ``<owner>: <field>`` (or the field)."""

    def validate(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        check_seed(attribute.name if owner is None else f"{owner}: {attribute.name}", value)

    return validate


def check_names(name: str, value: object) -> list[object]:
    """The items of ``value``, a collection of names (a list, tuple or set), else ConfigurationError
    naming ``name``: one string is refused, not split into its characters."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable) or isinstance(value, Mapping):
        hint = f" (one name: [{value!r}])" if isinstance(value, str) else ""
        msg = f"{name} must be a list of names{hint}, got {type(value).__name__} {value!r:.40}"
        raise ConfigurationError(msg)
    return list(value)


def check_sequence_of(name: str, value: object, kind: type, hint: str = "") -> None:
    """ConfigurationError naming ``name`` unless ``value`` is a sequence (not a string) of ``kind``."""
    if (
        isinstance(value, str | bytes)
        or not isinstance(value, Sequence)
        or not all(isinstance(item, kind) for item in value)
    ):
        msg = f"{name} must be a sequence of {kind.__name__}{hint}, got {value!r:.60}"
        raise ConfigurationError(msg)


def check_host(name: str, value: object, *, optional: bool = False) -> None:
    """ConfigurationError naming ``name`` unless ``value`` is a non-empty str (``None`` too when
    ``optional``)."""
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        msg = f"{name} must be a host name or address (a non-empty str), got {value!r:.40}"
        raise ConfigurationError(msg)


def check_mapping(name: str, value: object) -> Mapping[Any, Any]:
    """``value`` if it is a mapping (a dict), else ConfigurationError naming ``name``."""
    if not isinstance(value, Mapping):
        msg = f"{name} must be a mapping (a dict), got {type(value).__name__} {value!r:.40}"
        raise ConfigurationError(msg)
    return value


def takes_one_argument(function: Any) -> bool:
    """Whether ``function(x)`` binds (``True`` too when the signature cannot be read)."""
    try:
        inspect.signature(function).bind(None)
    except TypeError:
        return False
    except ValueError:  # a builtin without a readable signature: it will say so when called
        return True
    return True


def signature_of(function: Any) -> str:
    """``function``'s name and signature, for a message."""
    try:
        return f"{getattr(function, '__qualname__', type(function).__name__)}{inspect.signature(function)}"
    except (TypeError, ValueError):
        return type(function).__name__


def check_bool(name: str, value: object) -> None:
    """ConfigurationError naming ``name`` unless ``value`` is ``True`` or ``False`` (not 0, 1 or "no")."""
    if not isinstance(value, bool):
        msg = f"{name} must be True or False, got {value!r:.40}"
        raise ConfigurationError(msg)


def check_callable(name: str, value: object, *, optional: bool = False) -> None:
    """ConfigurationError naming ``name`` unless ``value`` is callable (or ``None`` when ``optional``)."""
    if value is None and optional:
        return
    if not callable(value):
        kind = "None or a function" if optional else "a function"
        msg = f"{name} must be {kind}, got {type(value).__name__}"
        raise ConfigurationError(msg)


def check_device(where: str, device: torch.device | str | int) -> torch.device:
    """``device`` as a ``torch.device``, else a ConfigurationError saying torch does not know it."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        msg = f"{where}: device {device!r} is not a device torch knows ({exc})"
        raise ConfigurationError(msg) from None


def check_path(name: str, value: object) -> pathlib.Path:
    """``value`` as a path, if it is a str or an ``os.PathLike``; else ConfigurationError naming ``name``."""
    if not isinstance(value, str | os.PathLike):
        msg = f"{name} must be a str or a pathlib.Path, got {type(value).__name__}"
        raise ConfigurationError(msg)
    if os.fspath(value) in ("", b""):  # pathlib would take it for the current directory
        msg = f"{name} is an empty path; say where, e.g. 'runs/first' ('.' for the current directory)"
        raise ConfigurationError(msg)
    return pathlib.Path(value)


def check_directory(name: str, value: object) -> pathlib.Path:
    """``value`` as a path (a str or an ``os.PathLike``) that is not an existing file."""
    path = check_path(name, value)
    if path.exists() and not path.is_dir():
        msg = f"{name} {str(path)!r} is a file, not a directory"
        raise ConfigurationError(msg)
    check_parents(name, path)
    return path


def check_parents(name: str, path: pathlib.Path) -> None:
    """ConfigurationError naming ``name`` when a parent of ``path`` is a file: nothing can be made there."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                msg = f"{name} {path}: {parent} is a file, not a directory; nothing can be made under it"
                raise ConfigurationError(msg)
            return


def check_epochs_container(name: str, value: object) -> None:
    """``value`` holds epochs (``epoch in value``): a tuple, a set, ``range(...)``, ``ALL_EPOCHS``.

    A string is a container too, but ``0 in "all"`` raises a TypeError at the first validation.
    """
    if isinstance(value, str | bytes) or not isinstance(value, Container):
        msg = (
            f"{name} must be a container of epochs "
            f"(a tuple, a set, range(...) or lamploop.ALL_EPOCHS), got {type(value).__name__}"
        )
        if isinstance(value, str | bytes):
            msg += f" {value!r:.40}"
        raise ConfigurationError(msg)


def check_schedule(name: str, value: object, *, optional: bool = False) -> None:
    """ConfigurationError naming ``name`` unless ``value`` is a learning-rate schedule.

    ``None`` passes when ``optional``.  A schedule has ``init()`` and
    ``learning_rate_factor(state, epoch, last_validation_loss)``.
    """
    if value is None and optional:
        return
    init, factor = getattr(value, "init", None), getattr(value, "learning_rate_factor", None)
    if not (callable(init) and callable(factor)):
        kind = "None or a learning-rate schedule" if optional else "a learning-rate schedule"
        msg = (
            f"{name} must be {kind} (init() and learning_rate_factor(state, epoch, "
            f"last_validation_loss), see lamploop.schedules), got {type(value).__name__}"
        )
        raise ConfigurationError(msg)


def check_seconds(name: str, value: object) -> float:
    """``value`` if it is a positive finite number, else ConfigurationError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        msg = f"{name} must be a positive number of seconds, got {value!r}"
        raise ConfigurationError(msg)
    return float(value)


def check_positive(name: str, value: object) -> float:
    """``value`` if it is a positive finite number, else ConfigurationError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        msg = f"{name} must be a positive finite number, got {value!r}"
        raise ConfigurationError(msg)
    return float(value)


def check_finite(name: str, value: object) -> float:
    """``value`` as a float if it is a finite real number (not a bool), else ConfigurationError
    naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        msg = f"{name} must be a finite number, got {value!r:.60}"
        raise ConfigurationError(msg)
    return float(value)


def check_smoothing(value: object) -> float:
    """The exponential smoothing factor of the validation loss, in ``(0, 1]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        msg = f"validation_loss_exponential_smoothing_factor must be in (0, 1], got {value!r}"
        raise ConfigurationError(msg)
    return float(value)


Validator = Callable[[object, "attrs.Attribute[Any]", Any], None]
"""An attrs validator."""


def int_at_least(owner: str | None, low: int) -> Validator:
    """An attrs validator: :func:`check_int` of the field, named ``<owner>: <field>`` (or the field alone)."""

    def validate(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        check_int(attribute.name if owner is None else f"{owner}: {attribute.name}", value, low)

    return validate


def optional_int_at_least(low: int) -> Validator:
    """An attrs validator: ``None``, or :func:`check_int` of the field."""

    def validate(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is not None:
            check_int(attribute.name, value, low)

    return validate


def seconds(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An attrs validator: :func:`check_seconds` of the field."""
    check_seconds(attribute.name, value)


def optional_seconds(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An attrs validator: ``None``, or :func:`check_seconds` of the field."""
    if value is not None:
        check_seconds(attribute.name, value)
