"""Which checkpoint directory a path names: itself, or in a run's root the one ``latest`` names.

Without a usable ``latest`` (missing, or naming a directory that is gone) the newest
complete checkpoint stands in; nothing here reads a checkpoint's files
(:mod:`~lamploop.checkpoint.load` does).
"""

from __future__ import annotations

import logging
import os
import pathlib

from lamploop.checkpoint.files import is_one_checkpoint, newest_complete, no_checkpoint_here, read_latest
from lamploop.checkpoint.format import LATEST_NAME
from lamploop.checks import check_directory
from lamploop.errors import CheckpointError

__all__ = ["latest_checkpoint", "resolve_checkpoint"]

_log = logging.getLogger("lamploop.checkpoint")


def latest_checkpoint(directory: str | os.PathLike[str]) -> pathlib.Path | None:
    """The checkpoint directory that ``<directory>/latest`` names, or ``None`` if there is none yet.

    Without a ``latest`` file (a crash right after the first checkpoint was
    renamed into place), the most recently saved complete checkpoint
    directory is returned.  Nothing is validated beyond existence:
    :func:`load_checkpoint` does that.

    Raises:
        ConfigurationError: ``directory`` is not a path, or is a file.
        CheckpointError: ``latest`` cannot be read, does not hold a checkpoint
            directory name, or names a directory that does not exist while no complete
            checkpoint is left (with one, the most recently saved is returned, and a warning
            is logged).
    """
    root = check_directory("latest_checkpoint: directory", directory)
    name, problem = read_latest(root)
    if problem is not None:
        raise CheckpointError(problem)
    if name is None:
        return newest_complete(root) if root.is_dir() else None
    pointer = root / LATEST_NAME
    target = root / name
    if not target.is_dir():
        fallback = newest_complete(root)
        if fallback is None:
            msg = f"{pointer}: names {name}, but {target} does not exist"
            raise CheckpointError(msg)
        _log.warning(
            "%s names %s, which does not exist; using %s, the newest saved", pointer, name, fallback.name
        )
        return fallback
    return target


def resolve_checkpoint(path: str | os.PathLike[str]) -> pathlib.Path:
    """The checkpoint directory ``path`` names: itself, or in a run directory the latest one.

    Raises:
        CheckpointError: ``path`` does not exist, is not a directory, or holds no checkpoint.
    """
    p = pathlib.Path(path)
    if is_one_checkpoint(p):
        return p
    found = latest_checkpoint(p)
    if found is None:
        raise no_checkpoint_here(p)
    return found
