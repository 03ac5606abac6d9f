"""``verify_checkpoint``: every problem of a checkpoint, or of every checkpoint of a run, found at once.

Unlike :func:`~lamploop.checkpoint.load_checkpoint`, which stops at the first problem, it
checks each file's size and sha256 (:func:`~lamploop.checkpoint.integrity.check_file`, the
check loading makes too), the ``latest`` pointer, and then loads what is intact as a
resuming run would; each problem is named by its file.  ``lamploop inspect`` formats its
result (:mod:`lamploop.inspection`).

>>> import tempfile, torch
>>> from lamploop.checkpoint import save_checkpoint
>>> from lamploop.state import LearningCurveEntry, LoopState, LoopStateWithModelAndOptimizerData
>>> curve = (LearningCurveEntry(epoch=0, training_loss=0.9, validation_loss=(0.8, 0.8)),)
>>> state = LoopStateWithModelAndOptimizerData(
...     LoopState(epoch=1, min_validation_loss=0.8, min_validation_epoch=0, learning_curve=curve),
...     model={"w": torch.zeros(2)},
...     optimizer={"state": {}, "param_groups": []},
... )
>>> with tempfile.TemporaryDirectory() as run:
...     _ = save_checkpoint(run, state)
...     report = verify_checkpoint(run)
>>> report.ok, report.path.name, report.best_epoch
(True, 'epoch-000001', 0)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

import attrs

from lamploop.checkpoint.checked_reads import record_problems, required_files
from lamploop.checkpoint.files import (
    checkpoint_directories,
    is_one_checkpoint,
    no_checkpoint_here,
    read_latest,
    saved_at,
)
from lamploop.checkpoint.format import (
    _CHECKPOINT_NAME,
    DESCRIPTOR_NAME,
    LATEST_NAME,
    _Descriptor,
)
from lamploop.checkpoint.integrity import FileCheck, check_file, file_size
from lamploop.checkpoint.load import load_checkpoint, read_descriptor, resolve_checkpoint
from lamploop.checkpoint.sharded import is_sharded_checkpoint, sharded_file_checks
from lamploop.checks import check_path
from lamploop.errors import CheckpointError
from lamploop.loop.boundary import EpochPosition
from lamploop.state import LearningCurveEntry, LoopState

__all__ = ["CheckpointReport", "CheckpointSummary", "FileCheck", "read_loop_state", "verify_checkpoint"]

_NOT_CHECKED: Final = "not checked"


@attrs.frozen
class CheckpointSummary:
    """One checkpoint directory and what checking it found.

    Attributes:
        path: the checkpoint directory.
        epoch: the epoch it resumes at (from its name).
        steps_done: the steps done in that epoch for a step-boundary checkpoint, else ``None``.
        is_latest: whether the run directory's ``latest`` pointer names it.
        files: every file checked, the descriptor first.
        problems: every problem found, each starting with the path of the file at fault.
    """

    path: Path
    epoch: int
    steps_done: int | None
    is_latest: bool
    files: tuple[FileCheck, ...]
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Whether the checkpoint loads: every file is intact and consistent."""
        return not self.problems


@attrs.frozen
class CheckpointReport:
    """What :func:`verify_checkpoint` found.

    Attributes:
        path: the checkpoint directory reported on: the one given, or in a run directory
            the latest valid one (the latest one when none is valid).
        run_directory: the run directory given, or ``None`` for a checkpoint directory.
        checkpoints: every checkpoint checked, in the order of their positions (epoch, step);
            just ``path`` when a checkpoint directory was given.
        lamploop_version: the lamploop version that wrote ``path`` (``None``: unreadable).
        format_version: its format version (``None``: unreadable).
        saved_at_unix_ns: when it was saved (``None``: unreadable).
        loop_state: its loop state (``None``: the descriptor is unreadable).
        position: the step position of a step-boundary checkpoint, else ``None``.
        files: the files of ``path``, each with its size and check.
        problems: every problem found, in ``path`` and in the other checkpoints, and with the
            ``latest`` pointer; each starts with the path of the file at fault.
        notes: remarks that are no problem (unlisted files, a missing ``latest`` pointer...).
    """

    path: Path
    run_directory: Path | None
    checkpoints: tuple[CheckpointSummary, ...]
    lamploop_version: str | None
    format_version: int | None
    saved_at_unix_ns: int | None
    loop_state: LoopState | None
    position: EpochPosition | None
    files: tuple[FileCheck, ...]
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Whether nothing is wrong (with any checkpoint checked)."""
        return not self.problems

    @property
    def learning_curve(self) -> tuple[LearningCurveEntry, ...]:
        """The learning curve of ``path`` (empty when its descriptor is unreadable)."""
        return () if self.loop_state is None else self.loop_state.learning_curve

    @property
    def epoch(self) -> int | None:
        """The epoch the checkpoint resumes at."""
        return None if self.loop_state is None else self.loop_state.epoch

    @property
    def best_epoch(self) -> int | None:
        """The epoch of the best model (lowest smoothed validation loss), ``None`` before any."""
        return None if self.loop_state is None else self.loop_state.min_validation_epoch


# --------------------------------------------------------------------------------------------
# Checking


def _name_position(name: str) -> tuple[int, int | None]:
    match = _CHECKPOINT_NAME.fullmatch(name)
    if match is None:
        return -1, None
    return int(match.group(1)), None if match.group(2) is None else int(match.group(2))


def _position_key(directory: Path) -> tuple[int, int]:
    """The order of positions: the start of an epoch (step 0) before its step boundaries."""
    epoch, steps = _name_position(directory.name)
    return epoch, steps or 0


@attrs.frozen
class _Checked:
    summary: CheckpointSummary
    descriptor: _Descriptor | None
    notes: tuple[str, ...]


def _check_directory(directory: Path, *, is_latest: bool) -> _Checked:
    """Check every file of one checkpoint directory; never raises for what it finds on disk."""

    descriptor_path = directory / DESCRIPTOR_NAME
    present = sorted(p.name for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []
    sharded: tuple[FileCheck, ...] = ()
    if is_sharded_checkpoint(directory):
        sharded = sharded_file_checks(directory)
        if not descriptor_path.exists():  # save_sharded's own checkpoint: the index is its descriptor
            return _sharded_only(directory, sharded, is_latest=is_latest)
        in_index = {check.name for check in sharded if check.note is None}
        present = [name for name in present if name not in in_index]
    descriptor: _Descriptor | None = None
    try:
        descriptor = read_descriptor(descriptor_path)
        # Its own problems, in load_checkpoint's words (one check for both).
        descriptor_problems = record_problems(descriptor)
    except CheckpointError as e:
        descriptor_problems = [str(e).removeprefix(f"{descriptor_path}: ")]
    files = [
        FileCheck(DESCRIPTOR_NAME, file_size(descriptor_path), problem="; ".join(descriptor_problems) or None)
    ]
    notes: list[str] = []
    if descriptor is None:
        reason = f"{_NOT_CHECKED}: {DESCRIPTOR_NAME} is unreadable"
        files += [
            FileCheck(name, file_size(directory / name), note=reason)
            for name in present
            if name != DESCRIPTOR_NAME
        ]
    else:
        unrecorded = f"not checked: {DESCRIPTOR_NAME} lists no sha256 and size for it"
        files += [
            FileCheck(name, file_size(directory / name), note=unrecorded)
            for name in required_files(descriptor)
            if name not in descriptor.files
        ]
        for name, record in descriptor.files.items():
            if Path(name).name == name and name not in (".", ".."):  # never read outside the checkpoint
                files.append(check_file(directory, name, record))
        listed = {f.name for f in files}
        for name in present:
            if name not in listed:
                note = f"not listed in {DESCRIPTOR_NAME} (not read when loading)"
                files.append(FileCheck(name, file_size(directory / name), note=note))
                notes.append(f"{directory / name}: {note}")
    files += [check for check in sharded if check.note is None]
    problems = [f"{descriptor_path}: {problem}" for problem in descriptor_problems]
    problems += [f"{directory / f.name}: {f.problem}" for f in files[1:] if f.problem is not None]
    if descriptor is not None and not problems:
        # Every file is intact: load it as a resuming run would, which also checks that the
        # safetensors files parse and hold the tensors the descriptor lists.
        try:
            load_checkpoint(directory)
        except CheckpointError as e:
            message = str(e)
            for i, f in enumerate(files):
                prefix = f"{directory / f.name}: "
                if message.startswith(prefix):
                    files[i] = attrs.evolve(f, problem=message.removeprefix(prefix))
                    break
            problems.append(message)
    epoch, steps = _name_position(directory.name)
    summary = CheckpointSummary(directory, epoch, steps, is_latest, tuple(files), tuple(problems))
    return _Checked(summary, descriptor, tuple(notes))


def _sharded_only(directory: Path, checks: tuple[FileCheck, ...], *, is_latest: bool) -> _Checked:
    """A checkpoint of :func:`~lamploop.checkpoint.sharded.save_sharded`: its index and shards."""
    problems = tuple(f"{directory / c.name}: {c.problem}" for c in checks if c.problem is not None)
    notes = tuple(f"{directory / c.name}: {c.note}" for c in checks if c.note is not None)
    epoch, steps = _name_position(directory.name)
    summary = CheckpointSummary(directory, epoch, steps, is_latest, checks, problems)
    return _Checked(summary, None, notes)


def _read_latest(root: Path) -> tuple[str | None, list[str], list[str]]:
    """The name ``latest`` holds (``None``: none usable), and the problems and notes about it."""
    name, problem = read_latest(root)
    if problem is not None:
        return None, [problem], []
    pointer = root / LATEST_NAME
    if name is None:
        return None, [], [f"{pointer}: missing; the most recently saved checkpoint counts as the latest"]
    if not (root / name).is_dir():
        return None, [f"{pointer}: names {name}, but {root / name} does not exist"], []
    return name, [], []


def verify_checkpoint(path: str | os.PathLike[str]) -> CheckpointReport:
    """Check a checkpoint directory, or every checkpoint of a run directory, file by file.

    Args:
        path: a checkpoint directory (``.../epoch-000006``), or a run directory holding
            ``latest`` and ``epoch-*`` directories; then every checkpoint in it is checked,
            and the report is on the one :func:`~lamploop.checkpoint.load_checkpoint` would
            load: the one ``latest`` names if valid, else the most recently saved valid one.

    Returns:
        The report; ``report.ok`` is false when anything is wrong, and ``report.problems``
        names each bad file (a size or sha256 mismatch, a missing file, an unreadable
        descriptor, a ``latest`` pointer naming nothing...).

    Raises:
        CheckpointError: ``path`` does not exist, is not a directory, or holds no checkpoint.
        ConfigurationError: ``path`` is not a str or an ``os.PathLike``.
    """
    p = check_path("verify_checkpoint: path", path)
    if is_one_checkpoint(p):
        checked = _check_directory(p, is_latest=False)
        return _report(checked, None, (checked,), [], [])
    directories = checkpoint_directories(p)
    if not directories:
        raise no_checkpoint_here(p)
    latest, problems, notes = _read_latest(p)
    directories.sort(key=_position_key)
    all_checked = [_check_directory(d, is_latest=d.name == latest) for d in directories]
    # The order load_checkpoint tries: the latest, then the others, most recently saved first.
    order = sorted(all_checked, key=lambda c: (c.summary.is_latest, saved_at(c.summary.path)), reverse=True)
    if latest is None:
        order = sorted(
            all_checked, key=lambda c: (c.descriptor is not None, saved_at(c.summary.path)), reverse=True
        )
    chosen = next((c for c in order if c.summary.ok), order[0])
    return _report(chosen, p, tuple(all_checked), problems, notes)


def _report(
    chosen: _Checked,
    run_directory: Path | None,
    all_checked: tuple[_Checked, ...],
    problems: list[str],
    notes: list[str],
) -> CheckpointReport:
    descriptor = chosen.descriptor
    for checked in all_checked:
        problems += checked.summary.problems
        notes += checked.notes
    return CheckpointReport(
        path=chosen.summary.path,
        run_directory=run_directory,
        checkpoints=tuple(c.summary for c in all_checked),
        lamploop_version=None if descriptor is None else descriptor.lamploop_version,
        format_version=None if descriptor is None else descriptor.format_version,
        saved_at_unix_ns=None if descriptor is None else descriptor.saved_at_unix_ns,
        loop_state=None if descriptor is None else descriptor.loop_state,
        position=None if descriptor is None else descriptor.position,
        files=chosen.summary.files,
        problems=tuple(problems),
        notes=tuple(notes),
    )


def read_loop_state(path: str | os.PathLike[str]) -> LoopState:
    """The loop state of a checkpoint, read from its descriptor alone (no tensor file is read).

    ``path`` is a checkpoint directory, or a run directory: then the latest checkpoint with a
    readable descriptor (``latest``, else the most recently saved).

    Raises:
        CheckpointError: no checkpoint there, or its descriptor is unreadable (in a run
            directory: every descriptor is).
    """
    directory = resolve_checkpoint(path)
    if directory == Path(path):
        return read_descriptor(directory / DESCRIPTOR_NAME).loop_state
    others = (d for d in checkpoint_directories(directory.parent) if d != directory)
    candidates = [directory, *sorted(others, key=saved_at, reverse=True)]
    first_error: CheckpointError | None = None
    for candidate in candidates:
        try:
            return read_descriptor(candidate / DESCRIPTOR_NAME).loop_state
        except CheckpointError as e:
            first_error = first_error or e
    assert first_error is not None
    raise first_error
