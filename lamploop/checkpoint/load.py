"""``load_checkpoint``: read and validate a checkpoint, falling back past an invalid ``latest``.

Which directory a path names is :mod:`~lamploop.checkpoint.locate`'s; each file's checked
read is :mod:`~lamploop.checkpoint.checked_reads`'; a sharded run's tensors are read by
:mod:`~lamploop.checkpoint.sharded`.  This module puts one checkpoint together from them.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from lamploop.checkpoint.checked_reads import (
    _check_fits,
    _DoesNotFit,
    _load_file,
    _read_tensors,
    _require_fit,
    _structure_schedule_state,
    check_records,
    read_descriptor,
)
from lamploop.checkpoint.codec import decode_tree
from lamploop.checkpoint.extras import ExtraState, extra_file
from lamploop.checkpoint.files import checkpoint_directories, saved_at
from lamploop.checkpoint.format import (
    AVERAGED_MODEL_FILE,
    BEST_MODEL_FILE,
    DESCRIPTOR_NAME,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    rank_rng_file,
)
from lamploop.checkpoint.locate import latest_checkpoint, resolve_checkpoint
from lamploop.checkpoint.rng import RngStates, _rng_from_disk, _rng_names
from lamploop.checkpoint.sharded import (
    SHARDED_INDEX,
    ShardsOnDisk,
    is_sharded_checkpoint,
    read_best,
    read_full,
    sharded_model_spec,
    verify_sharded,
)
from lamploop.checks import check_bool, check_path, check_schedule
from lamploop.errors import CheckpointError, ConfigurationError
from lamploop.loop.boundary import EpochPosition
from lamploop.modelspec import ModelSpec, model_spec
from lamploop.schedules import LearningRateSchedule
from lamploop.state import LoopStateWithModelAndOptimizerData

__all__ = [
    "Checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "load_checkpoint_leaving_shards",
    "read_descriptor",
    "resolve_checkpoint",
]

_log = logging.getLogger("lamploop.checkpoint")


@attrs.frozen(eq=False)
class Checkpoint:
    """A checkpoint read back by :func:`load_checkpoint`.

    Attributes:
        path: the checkpoint directory.
        state: the loop state, model, optimizer state and best model (CPU
            tensors; ``best_model`` is empty when none was saved).
        schedule_state: the learning-rate schedule state, structured with the
            ``schedule`` given to :func:`load_checkpoint`, else the raw JSON
            value (``None`` or a dict).
        rng: the RNG states at save time; :meth:`RngStates.restore` sets them.
        position: where inside its epoch the checkpoint was taken (``None``: at the start).
        rank_rngs: the RNG states of ranks 1, 2... at that position (empty before format 2).
        extras: each checkpoint extra's ``(tensors, meta)`` by name (see
            :mod:`lamploop.checkpoint.extras`); empty when it was saved without any.
    """

    path: pathlib.Path
    state: LoopStateWithModelAndOptimizerData
    schedule_state: Any
    rng: RngStates
    position: EpochPosition | None = None
    rank_rngs: tuple[RngStates, ...] = ()
    extras: Mapping[str, ExtraState] = attrs.field(factory=dict)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    schedule: LearningRateSchedule[Any] | None = None,
    model: torch.nn.Module | Mapping[str, torch.Tensor] | None = None,
    restore_rng: bool = False,
) -> Checkpoint:
    """Read and validate a checkpoint.

    Args:
        path: a checkpoint directory, or the root directory (then the one its
            ``latest`` pointer names is read).
        schedule: the learning-rate schedule the run resumes with; the stored
            schedule state is structured into ``schedule.state_type`` (the type of
            ``schedule.init()`` for a schedule without that attribute).  Without
            it, :attr:`Checkpoint.schedule_state` is the raw JSON value.
        model: a module or state dict the checkpoint must fit: same tensor
            names, order, shapes and dtypes (checked before any tensor is read).
        restore_rng: also set the torch, numpy and Python RNGs to the saved states.

    Returns:
        The checkpoint, with every tensor on the CPU.

    Raises:
        ConfigurationError: an argument of the wrong kind (``path`` not a path, ``schedule``
            without ``init`` and ``learning_rate_factor``, ``model`` neither a module nor a
            state dict, ``restore_rng`` not a bool), before any file is read.
        CheckpointError: the message starts with the file at fault and says
            what is wrong: a missing directory or file, unreadable JSON, a
            format version newer than :data:`FORMAT_VERSION`, a malformed
            descriptor, a size or sha256 mismatch (truncation, flipped bytes),
            a safetensors file that does not parse or lacks tensors the
            descriptor lists, a model that does not fit, or a schedule state
            that does not fit ``schedule``.
    """
    return _load(path, schedule, model, restore_rng, whole=True)


def load_checkpoint_leaving_shards(
    path: str | os.PathLike[str],
    *,
    schedule: LearningRateSchedule[Any] | None = None,
    model: torch.nn.Module | Mapping[str, torch.Tensor] | None = None,
) -> Checkpoint:
    """:func:`load_checkpoint`, but a sharded run's tensors stay on disk for every rank to read its own.

    For a sharded run's checkpoint (strategy ``fsdp``) the state's ``model`` is a
    :class:`~lamploop.checkpoint.sharded.ShardsOnDisk` naming the directory, its
    ``optimizer`` holds only what is kept beside the optimizer's own state (loss scale,
    scheduler) and its ``best_model`` is empty: each rank of the resumed run loads its rows
    (:func:`~lamploop.checkpoint.sharded.load_sharded`).  Every file is checked as by
    :func:`load_checkpoint`, and the index's model against ``model``.  Any other checkpoint
    loads whole.
    """
    return _load(path, schedule, model, False, whole=False)


def _check_load_arguments(path: object, schedule: object, model: object, restore_rng: object) -> None:
    """Arguments of the wrong kind, named before any file is read."""
    check_path("load_checkpoint: path", path)
    check_schedule("load_checkpoint: schedule", schedule, optional=True)
    if model is not None and not isinstance(model, torch.nn.Module | Mapping):
        kind = type(model).__name__
        msg = f"load_checkpoint: model must be None, a torch.nn.Module or a state dict, got {kind}"
        raise ConfigurationError(msg)
    check_bool("load_checkpoint: restore_rng", restore_rng)


def _load(
    path: str | os.PathLike[str],
    schedule: LearningRateSchedule[Any] | None,
    model: torch.nn.Module | Mapping[str, torch.Tensor] | None,
    restore_rng: bool,
    *,
    whole: bool,
) -> Checkpoint:
    """The checkpoint ``path`` names; from a run's root, the newest valid one if ``latest``'s is not."""
    _check_load_arguments(path, schedule, model, restore_rng)
    try:
        return _load_or_fall_back(path, schedule, model, restore_rng, whole=whole)
    except _DoesNotFit as e:
        raise CheckpointError(str(e)) from None


def _load_or_fall_back(
    path: str | os.PathLike[str],
    schedule: LearningRateSchedule[Any] | None,
    model: torch.nn.Module | Mapping[str, torch.Tensor] | None,
    restore_rng: bool,
    *,
    whole: bool,
) -> Checkpoint:
    """:func:`_load` past its argument checks; a model (or schedule) that does not fit is raised at once.

    A checkpoint that does not fit ``model`` or ``schedule`` is sound: they are not the run's,
    and the older checkpoints of the run are of the same model and schedule, so falling back
    would warn once for each and end in the same error (or load an older checkpoint of another
    model).
    """
    directory = resolve_checkpoint(path)
    if directory == pathlib.Path(path):  # a checkpoint named explicitly: no fallback
        return _load_directory(directory, schedule, model, restore_rng, whole=whole)
    # The root: its latest checkpoint, or else the newest valid one saved before it.
    first_error: CheckpointError | None = None
    tried: set[pathlib.Path] = set()
    candidate: pathlib.Path | None = directory
    while candidate is not None:
        try:
            return _load_directory(candidate, schedule, model, restore_rng, whole=whole)
        except _DoesNotFit:
            raise
        except CheckpointError as e:
            first_error = first_error or e
            tried.add(candidate)
            _log.warning("skipping the checkpoint %s: %s", candidate, e)
        remaining = [p for p in checkpoint_directories(directory.parent) if p not in tried]
        candidate = max((p for p in remaining if (p / DESCRIPTOR_NAME).is_file()), key=saved_at, default=None)
    raise first_error if first_error is not None else CheckpointError(f"{path}: no valid checkpoint")


def _read_sharded(
    directory: pathlib.Path,
    beside: dict[str, Any],
    model: torch.nn.Module | Mapping[str, torch.Tensor] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor]]:
    """The whole model, optimizer state and best model of a sharded run's checkpoint, read by one process.

    ``beside``: what the descriptor's optimizer state holds (the loss scale, the scheduler's
    state); kept beside the optimizer's own.  The model's tensors come in ``model``'s order.
    """
    full, optimizer, _ = read_full(directory)
    best = read_best(directory)
    if model is not None:
        expected = model_spec(model)
        order = [t.name for t in expected.tensors]
        if set(order) == set(full):
            full = {name: full[name] for name in order}
            best = {name: best[name] for name in order} if set(best) == set(order) else best
        _require_fit(directory / SHARDED_INDEX, model_spec(full), expected)
    return full, {**optimizer, **beside}, best


def _check_shards(
    directory: pathlib.Path, model: torch.nn.Module | Mapping[str, torch.Tensor] | None
) -> None:
    """Every shard file intact, and the index's model is ``model``'s (names, shapes, dtypes)."""
    problems = verify_sharded(directory)
    if problems:
        raise CheckpointError("; ".join(problems))
    if model is None:
        return
    # The index lists parameters, then buffers: compared by name, not in the state dict's order.
    saved = ModelSpec(tuple(sorted(sharded_model_spec(directory).tensors, key=lambda t: t.name)))
    expected = ModelSpec(tuple(sorted(model_spec(model).tensors, key=lambda t: t.name)))
    _require_fit(directory / SHARDED_INDEX, saved, expected)


def _load_directory(
    directory: pathlib.Path,
    schedule: LearningRateSchedule[Any] | None,
    model: torch.nn.Module | Mapping[str, torch.Tensor] | None,
    restore_rng: bool,
    *,
    whole: bool = True,
) -> Checkpoint:
    """Load and validate one checkpoint directory (see :func:`load_checkpoint`)."""
    descriptor_path = directory / DESCRIPTOR_NAME
    descriptor = read_descriptor(descriptor_path)
    check_records(directory, descriptor)
    sharded = is_sharded_checkpoint(directory)
    if model is not None and not sharded:
        _check_fits(directory, descriptor, model_spec(model))
    schedule_state = (
        descriptor.schedule_state
        if schedule is None
        else _structure_schedule_state(descriptor, schedule, descriptor_path)
    )
    rng_spec_names = _rng_names(descriptor.rng)
    model_tensors = _read_tensors(directory, descriptor, MODEL_FILE, descriptor.model_spec)
    best_tensors = _read_tensors(directory, descriptor, BEST_MODEL_FILE, descriptor.best_model_spec)
    optimizer_tensors = _read_tensors(directory, descriptor, OPTIMIZER_FILE, descriptor.optimizer_tensors)
    rng_tensors = _load_file(directory, descriptor, RNG_FILE)
    missing = [n for n in rng_spec_names if n not in rng_tensors]
    if missing:
        msg = f"{directory / RNG_FILE}: tensors missing that {DESCRIPTOR_NAME} implies: {missing}"
        raise CheckpointError(msg)
    optimizer = decode_tree(
        descriptor.optimizer, optimizer_tensors, f"{descriptor_path}: optimizer", error=CheckpointError
    )
    if not isinstance(optimizer, dict):
        msg = f"{descriptor_path}: the optimizer state is a {type(optimizer).__name__}, not a mapping"
        raise CheckpointError(msg)
    try:
        rng = _rng_from_disk(descriptor.rng, rng_tensors)
    except (ValueError, TypeError, RuntimeError) as e:
        msg = f"{directory / RNG_FILE}: malformed RNG state: {e}"
        raise CheckpointError(msg) from e
    if restore_rng:
        try:
            rng.restore()
        except (ValueError, TypeError, RuntimeError) as e:
            msg = f"{directory / RNG_FILE}: cannot restore the RNG states: {e}"
            raise CheckpointError(msg) from e
    if sharded and whole:  # a sharded run's: the model, optimizer and best model are in its shards
        model_tensors, optimizer, best_tensors = _read_sharded(directory, optimizer, model)
    elif sharded:  # left on disk: each rank reads its rows
        _check_shards(directory, model)
        model_tensors, best_tensors = ShardsOnDisk(directory), {}
    averaged: dict[str, torch.Tensor] = {}
    if descriptor.averaged_model_spec is not None:
        averaged = _read_tensors(directory, descriptor, AVERAGED_MODEL_FILE, descriptor.averaged_model_spec)
    state = LoopStateWithModelAndOptimizerData(
        loop_state=descriptor.loop_state,
        model=model_tensors,
        optimizer=optimizer,
        best_model=best_tensors,
        averaged_model=averaged,
        averaged_count=descriptor.averaged_count,
    )
    rank_rngs = tuple(
        _rng_from_disk(record, _load_file(directory, descriptor, rank_rng_file(rank)))
        for rank, record in enumerate(descriptor.rank_rngs, start=1)
    )
    extras = {
        name: (_load_file(directory, descriptor, extra_file(name)), meta)
        for name, meta in descriptor.extras.items()
    }
    return Checkpoint(
        path=directory,
        extras=extras,
        state=state,
        schedule_state=schedule_state,
        rng=rng,
        position=descriptor.position,
        rank_rngs=rank_rngs,
    )
