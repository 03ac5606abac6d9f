"""``load_checkpoint``: read and validate a checkpoint, falling back past an invalid ``latest``."""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import attrs
import cattrs
import safetensors
import safetensors.torch
import torch

from lamploop.checkpoint.codec import decode_tree
from lamploop.checkpoint.extras import ExtraState, extra_file
from lamploop.checkpoint.files import (
    checkpoint_directories,
    is_one_checkpoint,
    newest_complete,
    no_checkpoint_here,
    read_json_object,
    read_latest,
    saved_at,
)
from lamploop.checkpoint.format import (
    AVERAGED_MODEL_FILE,
    BEST_MODEL_FILE,
    DESCRIPTOR_NAME,
    FORMAT_VERSION,
    LATEST_NAME,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    _Descriptor,
    _type_name,
    rank_rng_file,
)
from lamploop.checkpoint.integrity import check_file
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
from lamploop.errors import CheckpointError
from lamploop.loop.boundary import EpochPosition
from lamploop.modelspec import ModelSpec, describe_mismatch, model_spec
from lamploop.schedules import LearningRateSchedule
from lamploop.state import LoopStateWithModelAndOptimizerData, converter

_log = logging.getLogger("lamploop.checkpoint")

# --------------------------------------------------------------------------------------------
# Loading


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


def latest_checkpoint(directory: str | os.PathLike[str]) -> pathlib.Path | None:
    """The checkpoint directory that ``<directory>/latest`` names, or ``None`` if there is none yet.

    Without a ``latest`` file (a crash right after the first checkpoint was
    renamed into place), the most recently saved complete checkpoint
    directory is returned.  Nothing is validated beyond existence:
    :func:`load_checkpoint` does that.

    Raises:
        CheckpointError: ``latest`` cannot be read, does not hold a checkpoint
            directory name, or names a directory that does not exist.
    """
    root = pathlib.Path(directory)
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


def read_descriptor(path: pathlib.Path) -> _Descriptor:
    """The descriptor (``checkpoint.json``) at ``path``, checked: format version and shape.

    Raises:
        CheckpointError: missing, unreadable, not JSON, another format, or malformed.
    """
    raw = read_json_object(path, CheckpointError, missing="missing; this is not a complete checkpoint")
    version = raw.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        msg = f"{path}: no valid format_version (got {version!r}); not a lamploop checkpoint descriptor"
        raise CheckpointError(msg)
    if version > FORMAT_VERSION:
        msg = (
            f"{path}: written by a newer lamploop: format version {version}, "
            f"this version reads {FORMAT_VERSION}; upgrade lamploop to load it"
        )
        raise CheckpointError(msg)
    try:
        return converter.structure(raw, _Descriptor)
    except Exception as e:  # cattrs raises ClassValidationError (an ExceptionGroup) and friends
        details = "; ".join(cattrs.transform_error(e, path="$"))
        msg = f"{path}: malformed descriptor: {details}"
        raise CheckpointError(msg) from e


def _load_file(directory: pathlib.Path, descriptor: _Descriptor, file: str) -> dict[str, torch.Tensor]:
    """Check a file's size and sha256 against the descriptor, then parse it."""
    path = directory / file
    record = descriptor.files.get(file)
    if record is None:
        msg = f"{directory / DESCRIPTOR_NAME}: lists no sha256 and size for {file}"
        raise CheckpointError(msg)
    problem = check_file(directory, file, record).problem
    if problem is not None:
        msg = f"{path}: {problem}"
        raise CheckpointError(msg)
    try:
        return safetensors.torch.load_file(str(path), device="cpu")
    except (safetensors.SafetensorError, OSError, ValueError, RuntimeError) as e:
        msg = f"{path}: cannot be parsed as safetensors: {e}"
        raise CheckpointError(msg) from e


def _read_tensors(
    directory: pathlib.Path, descriptor: _Descriptor, file: str, expected: ModelSpec
) -> dict[str, torch.Tensor]:
    """The tensors of ``file``, in the descriptor's order; exactly those ``expected`` lists."""
    loaded = _load_file(directory, descriptor, file)
    path = directory / file
    wanted = [t.name for t in expected.tensors]
    missing = [n for n in wanted if n not in loaded]
    if missing:
        more = " ..." if len(missing) > 5 else ""
        msg = f"{path}: tensors missing that {DESCRIPTOR_NAME} lists: {missing[:5]}{more}"
        raise CheckpointError(msg)
    ordered = {n: loaded[n] for n in wanted}
    problem = describe_mismatch(
        expected, model_spec(ordered), expected_label=DESCRIPTOR_NAME, actual_label=file
    )
    extra = [n for n in loaded if n not in ordered]
    if problem is None and extra:
        problem = f"{file} has tensors {DESCRIPTOR_NAME} does not list: {extra[:5]}"
    if problem is not None:
        msg = f"{path}: does not match {DESCRIPTOR_NAME}: {problem}"
        raise CheckpointError(msg)
    return ordered


def _structure_schedule_state(
    descriptor: _Descriptor, schedule: LearningRateSchedule[Any], where: pathlib.Path
) -> Any:
    # A schedule written to the bare protocol (init and learning_rate_factor) need not say
    # its state type: its initial state's type stands in.
    target = getattr(schedule, "state_type", None) or type(schedule.init())
    raw = descriptor.schedule_state
    try:
        return converter.structure(raw, target)
    except Exception as e:  # cattrs reports through many exception types
        problem = "; ".join(cattrs.transform_error(e, path="$.schedule_state"))
    msg = (
        f"{where}: the schedule state (saved as a {descriptor.schedule_state_type}) does not fit "
        f"{type(schedule).__qualname__}, whose state type is {_type_name(target)}: {problem}"
    )
    raise CheckpointError(msg)


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


def _load(
    path: str | os.PathLike[str],
    schedule: LearningRateSchedule[Any] | None,
    model: torch.nn.Module | Mapping[str, torch.Tensor] | None,
    restore_rng: bool,
    *,
    whole: bool,
) -> Checkpoint:
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
        except CheckpointError as e:
            first_error = first_error or e
            tried.add(candidate)
            _log.warning("skipping the checkpoint %s: %s", candidate, e)
        remaining = [p for p in checkpoint_directories(directory.parent) if p not in tried]
        candidate = max((p for p in remaining if (p / DESCRIPTOR_NAME).is_file()), key=saved_at, default=None)
    raise first_error if first_error is not None else CheckpointError(f"{path}: no valid checkpoint")


def _require_fit(file: pathlib.Path, saved: ModelSpec, model: ModelSpec) -> None:
    """``file``'s tensors (``saved``) are the given model's, else a CheckpointError naming the difference."""
    problem = describe_mismatch(saved, model, expected_label="checkpoint", actual_label="model")
    if problem is not None:
        msg = f"{file}: does not fit the given model: {problem}"
        raise CheckpointError(msg)


def _check_fits(directory: pathlib.Path, descriptor: _Descriptor, actual: ModelSpec) -> None:
    """The checkpoint's model (and best model, if any) have the given model's tensors."""
    for file, spec in ((MODEL_FILE, descriptor.model_spec), (BEST_MODEL_FILE, descriptor.best_model_spec)):
        if file == BEST_MODEL_FILE and not spec.tensors:
            continue
        _require_fit(directory / file, spec, actual)


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
