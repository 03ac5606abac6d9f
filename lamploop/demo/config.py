"""Run configurations: a frozen attrs class saved as ``config.json`` beside the checkpoints.

A run that resumes must train with the settings it started with: a different batch size
or seed would resume the checkpoint into another run.  :func:`save_config` writes the
configuration next to the checkpoints (atomically), :func:`load_config` reads it back
strictly (the kind, the version, every field's type; unknown keys are refused), and
:func:`resolve_config` merges what a command line gives with what was saved, refusing any
value that disagrees (except fields that may change, such as the number of epochs).

The file::

    {
      "kind": "DemoConfig",          the class's name: a config of another kind is refused
      "version": 1,                  the class's config_version: another version is refused
      "lamploop_version": "0.2.0",   the version that wrote it (informational)
      "config": {"epochs": 30, ...}  the fields, through cattrs
    }

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as run:
...     path = save_config(DemoConfig(epochs=5, batch_size=64), run)
...     load_config(run, DemoConfig).batch_size
64
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, ClassVar, Final, TypeVar

import attrs

from lamploop.checkpoint.files import read_json_object
from lamploop.checks import check_int, check_positive, int_at_least, seed_in_range
from lamploop.errors import ConfigurationError
from lamploop.strict_json import field_errors, strict_converter, write_atomically

__all__ = ["CONFIG_NAME", "DemoConfig", "load_config", "resolve_config", "save_config"]

CONFIG_NAME: Final = "config.json"
"""The configuration's file name in a run directory (beside ``latest`` and the ``epoch-*`` directories)."""

C = TypeVar("C", bound=attrs.AttrsInstance)

_ENVELOPE_KEYS: Final = ("kind", "version", "lamploop_version", "config")


def _positive(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    check_positive(attribute.name, value)


def _widths(_instance: object, attribute: attrs.Attribute[Any], value: tuple[object, ...]) -> None:
    for index, width in enumerate(value):
        check_int(f"{attribute.name}[{index}]", width, 1)


@attrs.frozen(kw_only=True)
class DemoConfig:
    """What ``lamploop demo`` trains with (see :func:`lamploop.demo.run_demo`).

    Attributes:
        epochs: epochs in all, at least 1 (a resumed run may change it: more to train longer,
            fewer to end sooner than planned).
        batch_size: training examples per batch (per rank).
        world_size: local ranks, one process each.
        seed: seed of the train/validation split, the initial weights and the shuffling.
        learning_rate: Adam's learning rate.
        hidden_sizes: the widths of the MLP's hidden layers.
    """

    config_version: ClassVar[int] = 1

    epochs: int = attrs.field(default=30, validator=int_at_least(None, 1))
    batch_size: int = attrs.field(default=32, validator=int_at_least(None, 1))
    world_size: int = attrs.field(default=2, validator=int_at_least(None, 1))
    seed: int = attrs.field(default=0, validator=seed_in_range(None))
    learning_rate: float = attrs.field(default=1e-3, validator=_positive)
    hidden_sizes: tuple[int, ...] = attrs.field(default=(128, 64), converter=tuple, validator=_widths)


_CONVERTER: Final = strict_converter()


def _kind_of(cls: type) -> str:
    return cls.__qualname__


def _version_of(cls: type) -> int:
    version = getattr(cls, "config_version", 1)
    return version if isinstance(version, int) else 1


def save_config(config: attrs.AttrsInstance, directory: str | os.PathLike[str]) -> Path:
    """Write ``config`` to ``<directory>/config.json`` atomically (creating ``directory``); its path.

    Raises:
        ConfigurationError: ``config`` is not an attrs instance.
    """
    if not attrs.has(type(config)):
        msg = f"save_config: expected an attrs class instance, got a {type(config).__qualname__}"
        raise ConfigurationError(msg)
    from lamploop.checkpoint.format import lamploop_version

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    document = {
        "kind": _kind_of(type(config)),
        "version": _version_of(type(config)),
        "lamploop_version": lamploop_version(),
        "config": _CONVERTER.unstructure(config),
    }
    path = root / CONFIG_NAME
    write_atomically(path, (json.dumps(document, indent=2) + "\n").encode("utf-8"))
    return path


def load_config(directory: str | os.PathLike[str], cls: type[C]) -> C:
    """Read ``<directory>/config.json`` as a ``cls``.

    Raises:
        ConfigurationError: the message starts with the file and names what is wrong: the
            file is missing or not JSON, holds another kind of configuration or another
            version of this one, has a field ``cls`` does not have or lacks one it has, or a
            value of the wrong type (``batch_size: expected an integer, got '64' (str)``).
    """
    path = Path(directory) / CONFIG_NAME
    raw = read_json_object(path, ConfigurationError)
    unknown = sorted(k for k in raw if k not in _ENVELOPE_KEYS)
    if unknown:
        msg = f"{path}: unknown key {', '.join(unknown)} (expected {', '.join(_ENVELOPE_KEYS)})"
        raise ConfigurationError(msg)
    kind, expected_kind = raw.get("kind"), _kind_of(cls)
    if kind != expected_kind:
        msg = f"{path}: kind: holds a {kind!r} configuration, expected {expected_kind!r}"
        raise ConfigurationError(msg)
    version, expected_version = raw.get("version"), _version_of(cls)
    if isinstance(version, bool) or not isinstance(version, int):
        msg = f"{path}: version: expected an integer, got {version!r}"
        raise ConfigurationError(msg)
    if version != expected_version:
        newer = "a newer" if version > expected_version else "an older"
        msg = (
            f"{path}: version: {expected_kind} version {version} was written by {newer} lamploop "
            f"({raw.get('lamploop_version', 'unknown')}); this one reads version {expected_version}"
        )
        raise ConfigurationError(msg)
    body = raw.get("config")
    if not isinstance(body, dict):
        msg = f"{path}: config: expected a JSON object, got {body!r}"
        raise ConfigurationError(msg)
    # Every field is written; one missing was lost or edited out, and a default in its place
    # could resume the run with another setting than it started with.
    missing = [field.name for field in attrs.fields(cls) if field.init and field.name not in body]
    if missing:
        msg = f"{path}: config: missing key {', '.join(missing)} (every field of {expected_kind} is written)"
        raise ConfigurationError(msg)
    try:
        return _CONVERTER.structure(body, cls)
    except Exception as e:  # cattrs raises ClassValidationError (an ExceptionGroup) and friends
        msg = f"{path}: {'; '.join(field_errors(e))}"
        raise ConfigurationError(msg) from e


# --------------------------------------------------------------------------------------------
# Resuming


def has_checkpoints(directory: Path) -> bool:
    """Whether ``directory`` holds a checkpoint directory (complete or not)."""
    from lamploop.checkpoint.files import checkpoint_directories

    return directory.is_dir() and bool(checkpoint_directories(directory))


def resolve_config(
    directory: str | os.PathLike[str],
    cls: type[C],
    given: Mapping[str, Any],
    *,
    resume: bool = False,
    may_change: Collection[str] = ("epochs",),
    given_by: str = "the command line",
) -> C:
    """The configuration to train with in ``directory``: ``given`` checked against the saved one.

    - ``directory`` holds a ``config.json`` and checkpoints (or ``resume`` is true): the saved
      configuration, with the fields of ``given`` (each must agree with the saved value, but
      for the fields in ``may_change``: the number of epochs, to train longer or to end a
      run sooner than planned);
    - otherwise nothing was trained there yet: ``cls(**given)`` (defaults for the rest).

    Args:
        directory: the run directory (checkpoints and ``config.json``).
        cls: the configuration class.
        given: the fields set explicitly (e.g. the flags given on a command line).
        resume: the caller asks to resume: ``config.json`` must exist.
        may_change: fields whose value may differ from the saved one.
        given_by: who gave ``given``, for the messages.

    Raises:
        ConfigurationError: ``config.json`` is unreadable (see :func:`load_config`) or
            missing when ``resume`` is true, or ``given`` disagrees with it; the message
            names every field, e.g. ``batch_size: the checkpoint in runs/demo was trained
            with 32, the command line says 64``.
    """
    root = Path(directory)
    names = {f.name for f in attrs.fields(cls)}
    unknown = sorted(set(given) - names)
    if unknown:
        msg = f"resolve_config: {cls.__qualname__} has no field {', '.join(unknown)}"
        raise ConfigurationError(msg)
    if not (root / CONFIG_NAME).exists():
        if resume:
            msg = (
                f"{root / CONFIG_NAME}: missing: nothing to resume in {root} "
                f"(a run writes {CONFIG_NAME} beside its checkpoints)"
            )
            raise ConfigurationError(msg)
        return cls(**given)
    if not resume and not has_checkpoints(root):
        return cls(**given)  # a config whose run never checkpointed: nothing trained to agree with
    saved = load_config(root, cls)
    problems = []
    for name, value in given.items():
        before = getattr(saved, name)
        if _same(before, value) or name in may_change:
            continue
        problems.append(
            f"{name}: the checkpoint in {root} was trained with {_show(before)}, "
            f"{given_by} says {_show(value)}"
        )
    if problems:
        raise ConfigurationError("; ".join(problems))
    return cls(**{**attrs.asdict(saved, recurse=False), **given})


def _same(saved: Any, given: Any) -> bool:
    if isinstance(saved, tuple) and isinstance(given, (list, tuple)):
        return saved == tuple(given)
    return bool(saved == given)


def _show(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)
