"""The reads a checkpoint's load is made of, each checked before it is used.

The descriptor (format version and shape), its file records (one for every file the
checkpoint needs, none outside its directory), a file against the size and sha256 the
descriptor records, a safetensors file's tensors against the descriptor's list, a model's
fit to the saved one, and the schedule state structured as the schedule's type.  Each
failure is a :class:`~lamploop.errors.CheckpointError` that starts with the file at fault.
"""

from __future__ import annotations

import pathlib
from typing import Any

import cattrs
import safetensors
import safetensors.torch
import torch

from lamploop.checkpoint.extras import extra_file
from lamploop.checkpoint.files import read_json_object
from lamploop.checkpoint.format import (
    AVERAGED_MODEL_FILE,
    BEST_MODEL_FILE,
    DESCRIPTOR_NAME,
    FORMAT_VERSION,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    _Descriptor,
    _type_name,
    rank_rng_file,
)
from lamploop.checkpoint.integrity import check_file
from lamploop.errors import CheckpointError
from lamploop.modelspec import ModelSpec, describe_mismatch, model_spec
from lamploop.schedules import LearningRateSchedule
from lamploop.state import converter

__all__ = ["check_records", "read_descriptor", "record_problems", "required_files"]


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


def required_files(descriptor: _Descriptor) -> list[str]:
    """The files a checkpoint of this descriptor is made of (each needs a record in ``files``)."""
    names = [MODEL_FILE, BEST_MODEL_FILE, OPTIMIZER_FILE, RNG_FILE]
    names += [rank_rng_file(rank) for rank in range(1, len(descriptor.rank_rngs) + 1)]
    if descriptor.averaged_model_spec is not None:
        names.append(AVERAGED_MODEL_FILE)
    names += [extra_file(name) for name in descriptor.extras]
    return names


def record_problems(descriptor: _Descriptor) -> list[str]:
    """What is wrong with the descriptor's file records (each the descriptor's problem, without its
    path): a file the checkpoint needs that has no record, a record of a name outside the directory.

    :func:`check_records` (loading) raises the first; ``verify_checkpoint`` reports them all.
    """
    problems = [
        f"lists no sha256 and size for {name}"
        for name in required_files(descriptor)
        if name not in descriptor.files
    ]
    for name in descriptor.files:
        if pathlib.PurePath(name).name != name or name in (".", ".."):  # never read outside the checkpoint
            problems.append(f"lists {name!r}, which is not a file name inside the checkpoint directory")
    return problems


def check_records(directory: pathlib.Path, descriptor: _Descriptor) -> None:
    """Refuse a checkpoint whose descriptor's file records are wrong, or whose listed files beyond
    those it needs are not as recorded (the files it needs are checked as they are read).

    Raises:
        CheckpointError: the first problem, starting with the file at fault.
    """
    problems = record_problems(descriptor)
    if problems:
        msg = f"{directory / DESCRIPTOR_NAME}: {problems[0]}"
        raise CheckpointError(msg)
    needed = set(required_files(descriptor))
    for name, record in descriptor.files.items():
        if name not in needed:
            problem = check_file(directory, name, record).problem
            if problem is not None:
                msg = f"{directory / name}: {problem}"
                raise CheckpointError(msg)


def _load_file(directory: pathlib.Path, descriptor: _Descriptor, file: str) -> dict[str, torch.Tensor]:
    """Check a file's size and sha256 against the descriptor, then parse it."""
    path = directory / file
    record = descriptor.files.get(file)
    if record is None:  # not after check_records, which refuses a needed file without a record
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


class _DoesNotFit(CheckpointError):
    """The checkpoint is sound but the given model (or schedule) is not its own: the caller's
    mismatch, which a fallback to older checkpoints of the same run would only repeat (raised
    as a plain :class:`CheckpointError` by :func:`~lamploop.checkpoint.load.load_checkpoint`)."""


def _structure_schedule_state(
    descriptor: _Descriptor, schedule: LearningRateSchedule[Any], where: pathlib.Path
) -> Any:
    """The descriptor's schedule state as ``schedule``'s state type, else a CheckpointError at ``where``."""
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
    raise _DoesNotFit(msg)


def _require_fit(file: pathlib.Path, saved: ModelSpec, model: ModelSpec) -> None:
    """``file``'s tensors (``saved``) are the given model's, else a CheckpointError naming the difference."""
    problem = describe_mismatch(saved, model, expected_label="checkpoint", actual_label="model")
    if problem is not None:
        msg = f"{file}: does not fit the given model: {problem}"
        raise _DoesNotFit(msg)


def _check_fits(directory: pathlib.Path, descriptor: _Descriptor, actual: ModelSpec) -> None:
    """The checkpoint's model (and best model, if any) have the given model's tensors."""
    for file, spec in ((MODEL_FILE, descriptor.model_spec), (BEST_MODEL_FILE, descriptor.best_model_spec)):
        if file == BEST_MODEL_FILE and not spec.tensors:
            continue
        _require_fit(directory / file, spec, actual)
