"""Checkpoints: save and load a :class:`~lamploop.state.LoopStateWithModelAndOptimizerData`.

One directory per checkpoint, named after the epoch the run resumes at::

    <root>/
      latest                      one line: the name of the newest checkpoint directory
      epoch-000006/
        checkpoint.json           the descriptor: format version, loop state, schedule state,
                                  optimizer state without its tensors, RNG scalars, model
                                  specs, and the sha256 and size of every file below
        model.safetensors         the live model's state_dict
        best_model.safetensors    the best model's state_dict (no tensors when there is none yet)
        optimizer.safetensors     the tensors of optimizer.state_dict()
        rng.safetensors           the torch (CPU and CUDA), numpy and Python RNG states

Nothing is pickled and nothing is read with ``torch.load``: tensors live in
safetensors files, everything else in JSON.  A checkpoint is written into a
hidden temporary sibling directory, every file and the directory are fsynced,
and only then is it renamed into place; ``latest`` is replaced atomically after
that, and old checkpoints beyond ``keep_last`` are pruned last.  A crash at any
moment leaves either the old or the new checkpoint, never a half-written one
under a checkpoint name.

:func:`load_checkpoint` checks everything before it hands anything back: the
format version, the descriptor's shape, every file's size and sha256, that the
safetensors files parse and hold exactly the tensors the descriptor lists, and
(when given a model) that the checkpoint's tensors fit the model.  Every
refusal is a :class:`~lamploop.errors.CheckpointError` whose message starts
with the file at fault.

Resuming::

    checkpoint = load_checkpoint(root, schedule=schedule, model=model, restore_rng=True)
    model.load_state_dict(checkpoint.state.model)
    restore_optimizer_state(optimizer, checkpoint)
    await epochs(..., init_state=checkpoint.state.loop_state,
                 learning_rate_schedule=schedule,
                 learning_rate_schedule_init_state=checkpoint.schedule_state,
                 checkpoint_state=...)

Only one process may save into a root directory at a time (in a distributed
run, the root rank).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import random
import re
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import anyio
import anyio.to_thread
import attrs
import cattrs
import numpy as np
import safetensors
import safetensors.torch
import torch

from lamploop.errors import CheckpointError, ConfigurationError
from lamploop.loop.boundary import EpochPosition
from lamploop.modelspec import ModelSpec, describe_mismatch, model_spec
from lamploop.optimizer_state import decode_tree, encode_tree
from lamploop.schedules import LearningRateSchedule
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData, converter

__all__ = [
    "BEST_MODEL_FILE",
    "DESCRIPTOR_NAME",
    "FORMAT_VERSION",
    "LATEST_NAME",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "RNG_FILE",
    "Checkpoint",
    "Checkpointer",
    "RngStates",
    "checkpoint_name",
    "latest_checkpoint",
    "load_checkpoint",
    "restore_optimizer_state",
    "save_checkpoint",
]

FORMAT_VERSION: Final = 2
"""The version of the on-disk format this lamploop writes and the newest it reads."""

DESCRIPTOR_NAME: Final = "checkpoint.json"
"""The descriptor's file name inside a checkpoint directory."""

LATEST_NAME: Final = "latest"
"""The pointer file in the root directory; it holds the newest checkpoint's directory name."""

MODEL_FILE: Final = "model.safetensors"
BEST_MODEL_FILE: Final = "best_model.safetensors"
OPTIMIZER_FILE: Final = "optimizer.safetensors"
RNG_FILE: Final = "rng.safetensors"

_log = logging.getLogger(__name__)

_CHECKPOINT_NAME: Final = re.compile(r"epoch-(\d{6,})(?:-step-(\d{6,}))?")
_TMP_PREFIX: Final = ".lamploop-tmp-"
_TMP_NAME: Final = re.compile(re.escape(_TMP_PREFIX) + r"([0-9a-f]{8})-(\d+)-[0-9a-f]+-.*")
_CHUNK: Final = 1 << 20

# Tags of the optimizer-state JSON encoding: a JSON object with exactly one of these keys stands
# for a value that plain JSON would lose.  Plain objects never have keys starting with "$".


def checkpoint_name(epoch: int, step: int | None = None) -> str:
    """The directory name of the checkpoint a run resumes at: ``epoch-000006`` (the start of
    epoch 6), or ``epoch-000005-step-000120`` (epoch 5 after its 120th step)."""
    return f"epoch-{epoch:06d}" if step is None else f"epoch-{epoch:06d}-step-{step:06d}"


def rank_rng_file(rank: int) -> str:
    """The file of rank ``rank``'s RNG states (ranks 1 and up; rank 0's are :data:`RNG_FILE`)."""
    return f"rng-rank{rank}.safetensors"


# --------------------------------------------------------------------------------------------
# RNG states


@attrs.frozen(eq=False)
class RngStates:
    """The random-number generator states of one process, as plain values and tensors.

    Attributes:
        torch_cpu: ``torch.get_rng_state()``, a uint8 tensor.
        torch_cuda: ``torch.cuda.get_rng_state_all()``; empty without CUDA.
        numpy: numpy's legacy global state, ``np.random.get_state()``:
            ``(algorithm, keys, pos, has_gauss, cached_gaussian)``.
        python: ``random.getstate()``: ``(version, internal state, gauss_next)``.
    """

    torch_cpu: torch.Tensor
    torch_cuda: tuple[torch.Tensor, ...]
    numpy: tuple[str, np.ndarray[Any, Any], int, int, float]
    python: tuple[Any, ...]

    @classmethod
    def capture(cls) -> RngStates:
        """The current states of every generator this class knows."""
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else ()
        algorithm, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        return cls(
            torch_cpu=torch.get_rng_state(),
            torch_cuda=cuda,
            numpy=(str(algorithm), np.array(keys, copy=True), int(pos), int(has_gauss), float(cached)),
            python=random.getstate(),
        )

    def restore(self) -> None:
        """Set every generator to these states.

        CUDA states are restored on the devices that exist here, in order: a
        state saved on a machine with more GPUs than this one is ignored beyond
        ``torch.cuda.device_count()``.
        """
        torch.set_rng_state(self.torch_cpu)
        if self.torch_cuda and torch.cuda.is_available():
            for device, state in enumerate(self.torch_cuda[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(state, device)
        np.random.set_state(self.numpy)
        random.setstate(self.python)


@attrs.frozen
class _PythonRngRecord:
    version: int
    gauss_next: float | None


@attrs.frozen
class _NumpyRngRecord:
    algorithm: str
    pos: int
    has_gauss: int
    cached_gaussian: float


@attrs.frozen
class _RngRecord:
    python: _PythonRngRecord
    numpy: _NumpyRngRecord
    cuda_devices: int


def _rng_to_disk(rng: RngStates) -> tuple[_RngRecord, dict[str, torch.Tensor]]:
    version, internal, gauss_next = rng.python
    algorithm, keys, pos, has_gauss, cached = rng.numpy
    tensors = {
        "torch.cpu": rng.torch_cpu.detach().cpu().contiguous(),
        "numpy.keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
        "python.state": torch.tensor(list(internal), dtype=torch.int64),
    }
    for device, state in enumerate(rng.torch_cuda):
        tensors[f"torch.cuda.{device}"] = state.detach().cpu().contiguous()
    record = _RngRecord(
        python=_PythonRngRecord(version=int(version), gauss_next=gauss_next),
        numpy=_NumpyRngRecord(algorithm=algorithm, pos=pos, has_gauss=has_gauss, cached_gaussian=cached),
        cuda_devices=len(rng.torch_cuda),
    )
    return record, tensors


def _rng_names(record: _RngRecord) -> list[str]:
    return ["torch.cpu", "numpy.keys", "python.state"] + [
        f"torch.cuda.{d}" for d in range(record.cuda_devices)
    ]


def _rng_from_disk(record: _RngRecord, tensors: Mapping[str, torch.Tensor]) -> RngStates:
    keys = tensors["numpy.keys"].numpy().astype(np.uint32)
    return RngStates(
        torch_cpu=tensors["torch.cpu"],
        torch_cuda=tuple(tensors[f"torch.cuda.{d}"] for d in range(record.cuda_devices)),
        numpy=(
            record.numpy.algorithm,
            keys,
            record.numpy.pos,
            record.numpy.has_gauss,
            record.numpy.cached_gaussian,
        ),
        python=(
            record.python.version,
            tuple(int(v) for v in tensors["python.state"].tolist()),
            record.python.gauss_next,
        ),
    )


# --------------------------------------------------------------------------------------------
# The descriptor


@attrs.frozen
class _FileRecord:
    sha256: str
    size: int


@attrs.frozen
class _Descriptor:
    format_version: int
    lamploop_version: str
    saved_at_unix_ns: int
    loop_state: LoopState
    schedule_state_type: str
    schedule_state: Any
    model_spec: ModelSpec
    best_model_spec: ModelSpec
    optimizer_tensors: ModelSpec
    optimizer: Any
    rng: _RngRecord
    files: dict[str, _FileRecord]
    # Format 2: a checkpoint at a step boundary inside an epoch, with every rank's RNG states.
    position: EpochPosition | None = None
    rank_rngs: list[_RngRecord] = attrs.Factory(list)
    sequence: int = 0


def _to_json(value: Any, level: int = 0) -> str:
    """JSON text with one item per line, except containers short enough for one line."""
    compact = json.dumps(value, separators=(", ", ": "))
    if not isinstance(value, (dict, list)) or not value or len(compact) + 2 * level <= 100:
        return compact
    pad, end = "  " * (level + 1), "  " * level
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: {_to_json(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    items = [pad + _to_json(v, level + 1) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + end + "]"


def _type_name(t: Any) -> str:
    return f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', repr(t))}"


def _lamploop_version() -> str:
    try:
        return importlib.metadata.version("lamploop")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# --------------------------------------------------------------------------------------------
# Files


def _cpu_tensors(tensors: Mapping[Any, Any], what: str) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors; one that shares storage with an earlier one is cloned."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in tensors.items():
        if not isinstance(name, str):
            msg = f"{what}: tensor names must be str, got {name!r}"
            raise CheckpointError(msg)
        if not isinstance(tensor, torch.Tensor):
            msg = f"{what}: {name!r} is a {type(tensor).__qualname__}, not a tensor"
            raise CheckpointError(msg)
        if tensor.layout != torch.strided:
            msg = f"{what}: {name!r} has layout {tensor.layout}; only dense tensors can be stored"
            raise CheckpointError(msg)
        t = tensor.detach().cpu().contiguous()
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key[0] != 0 and key[1] != 0:
            if key in seen:
                # safetensors refuses tensors that share memory (tied weights, views of one buffer).
                t = t.clone()
                key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            seen.add(key)
        out[name] = t
    return out


def _fsync_dir(path: pathlib.Path) -> None:
    if os.name == "nt":  # Windows cannot open a directory to fsync it.
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tensors(path: pathlib.Path, tensors: dict[str, torch.Tensor], what: str) -> _FileRecord:
    """Serialize, then write, hash and fsync in one pass (the bytes are hashed, not read back)."""
    try:
        data = safetensors.torch.save(tensors, metadata={"format": "pt"})
    except (safetensors.SafetensorError, ValueError, TypeError, RuntimeError) as e:
        msg = f"{what}: safetensors cannot store these tensors: {e}"
        raise CheckpointError(msg) from e
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return _FileRecord(sha256=hashlib.sha256(data).hexdigest(), size=len(data))


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _temp_name(label: str) -> str:
    return f"{_TMP_PREFIX}{_host_tag()}-{os.getpid()}-{secrets.token_hex(4)}-{label}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: an existence check, nothing is sent
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _remove_stale_temporaries(root: pathlib.Path) -> None:
    """Remove what saves that crashed on this host left behind (their process is gone)."""
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there.
        return
    host = _host_tag()
    for entry in root.iterdir():
        match = _TMP_NAME.fullmatch(entry.name)
        if match is None or match.group(1) != host:
            continue
        pid = int(match.group(2))
        if pid != os.getpid() and not _pid_alive(pid):
            try:
                _remove(entry)
            except OSError:
                # Leftovers are never read; failing to delete one must not fail the save.
                _log.warning("could not remove the leftover %s of a crashed save", entry, exc_info=True)


def _checkpoint_dirs(root: pathlib.Path) -> list[pathlib.Path]:
    return [p for p in root.iterdir() if _CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir()]


def _saved_at(directory: pathlib.Path) -> tuple[int, int, str]:
    """The order checkpoints were saved in: the descriptor's save sequence, then its clock, then the name.

    The sequence (format 2) counts saves into the root, so a clock that jumps back cannot
    make an older checkpoint look newer; format 1 descriptors (sequence 0) fall back on
    their clock, and a directory without a readable descriptor on its mtime.
    """
    try:
        with open(directory / DESCRIPTOR_NAME, encoding="utf-8") as f:
            raw = json.load(f)
        return int(raw.get("sequence", 0)), int(raw["saved_at_unix_ns"]), directory.name
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0, directory.stat().st_mtime_ns, directory.name


def _next_sequence(root: pathlib.Path) -> int:
    return 1 + max((_saved_at(p)[0] for p in _checkpoint_dirs(root)), default=0)


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Swap two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where unsupported."""
    if sys.platform != "linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return bool(result == 0)


def _write_latest(root: pathlib.Path, name: str) -> None:
    temp = root / _temp_name(LATEST_NAME)
    try:
        with open(temp, "w", encoding="utf-8") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, root / LATEST_NAME)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(root)


def _delete(path: pathlib.Path, what: str) -> None:
    """Delete a directory that is no longer needed; a failure is logged, not raised.

    The new checkpoint is already in place and ``latest`` names it, so a
    directory that cannot be deleted (permissions, a busy network file system)
    must not fail the save and with it the training run.
    """
    try:
        shutil.rmtree(path)
    except OSError:
        _log.warning("could not delete %s %s", what, path, exc_info=True)


def _prune(root: pathlib.Path, keep_last: int, just_written: pathlib.Path) -> None:
    """Delete all but the ``keep_last`` most recently saved checkpoints, never ``just_written``."""
    others = [p for p in _checkpoint_dirs(root) if p.name != just_written.name]
    others.sort(key=_saved_at, reverse=True)
    for directory in others[keep_last - 1 :]:
        # Renamed away first, so that a half-deleted directory never looks like a checkpoint.
        trash = root / _temp_name(f"trash-{directory.name}")
        try:
            os.rename(directory, trash)
        except OSError:
            _log.warning("could not prune the old checkpoint %s", directory, exc_info=True)
            continue
        _delete(trash, "the pruned checkpoint")


# --------------------------------------------------------------------------------------------
# Saving


def _check_keep_last(keep_last: int | None, where: str) -> None:
    if keep_last is not None and (
        not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1
    ):
        msg = f"{where}: keep_last must be None or an int >= 1, got {keep_last!r}"
        raise ConfigurationError(msg)


def save_checkpoint(
    directory: str | os.PathLike[str],
    state: LoopStateWithModelAndOptimizerData,
    *,
    schedule_state: Any = None,
    keep_last: int | None = 3,
    rng: RngStates | None = None,
    position: EpochPosition | None = None,
    rank_rngs: Sequence[RngStates] = (),
) -> pathlib.Path:
    """Save ``state`` as ``<directory>/epoch-NNNNNN`` and point ``<directory>/latest`` at it.

    The RNG states of this process are captured at call time (unless ``rng``
    is given).  The tensors of
    ``state`` must not change until this returns (the epoch loop awaits its
    ``checkpoint_state`` callback, so they do not).  A checkpoint of the same
    epoch that already exists is replaced.

    Args:
        directory: the root directory of the run's checkpoints; created if missing.
        state: what to save; ``state.loop_state.epoch`` names the directory.
        schedule_state: the learning-rate schedule state the next epoch will
            use (``None`` or plain data such as :class:`~lamploop.schedules.PlateauState`);
            stored as JSON through :data:`lamploop.state.converter`.
        keep_last: how many checkpoint directories to keep, counting the new
            one and ordered by when they were saved; ``None`` keeps all.
        rng: the RNG states to store (default: :meth:`RngStates.capture` now).
        position: where inside epoch ``state.loop_state.epoch`` this checkpoint is taken
            (a step boundary; ``None``: at the start of that epoch); names the directory
            ``epoch-NNNNNN-step-SSSSSS``.
        rank_rngs: the RNG states of ranks 1, 2... at that position (rank 0's are ``rng``).

    Returns:
        The new checkpoint directory.

    Raises:
        ConfigurationError: ``state`` is not a ``LoopStateWithModelAndOptimizerData``,
            its epoch is negative, or ``keep_last`` is out of range.
        CheckpointError: something in ``state`` or ``schedule_state`` cannot be
            stored without pickle (a non-tensor in a state dict, an object in
            the optimizer state, a schedule state that is not plain data).
        OSError: writing, fsyncing or renaming failed (the previous checkpoint
            and ``latest`` are then left as they were).
    """
    if not isinstance(state, LoopStateWithModelAndOptimizerData):
        msg = (
            "save_checkpoint: state must be a LoopStateWithModelAndOptimizerData, "
            f"got {type(state).__qualname__}"
        )
        raise ConfigurationError(msg)
    _check_keep_last(keep_last, "save_checkpoint")
    epoch = state.loop_state.epoch
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        msg = f"save_checkpoint: state.loop_state.epoch must be an int >= 0, got {epoch!r}"
        raise ConfigurationError(msg)
    root = pathlib.Path(directory)
    if position is not None and position.epoch != epoch:
        msg = f"save_checkpoint: position.epoch={position.epoch} but state.loop_state.epoch={epoch}"
        raise ConfigurationError(msg)
    name = checkpoint_name(epoch, position.steps_done if position is not None else None)
    rng_record, rng_tensors = _rng_to_disk(RngStates.capture() if rng is None else rng)

    model = _cpu_tensors(state.model, "model state dict")
    best_model = _cpu_tensors(state.best_model, "best model state dict")
    if not isinstance(state.optimizer, Mapping):
        msg = (
            "optimizer state: expected a mapping (optimizer.state_dict()), "
            f"got {type(state.optimizer).__qualname__}"
        )
        raise CheckpointError(msg)
    raw_optimizer_tensors: dict[str, torch.Tensor] = {}
    optimizer_json = encode_tree(state.optimizer, raw_optimizer_tensors, error=CheckpointError)
    optimizer_tensors = _cpu_tensors(raw_optimizer_tensors, "optimizer state")

    schedule_json = converter.unstructure(schedule_state)
    try:
        json.dumps(schedule_json)
    except (TypeError, ValueError) as e:
        msg = (
            f"schedule state: a {type(schedule_state).__qualname__} cannot be stored as JSON ({e}); "
            "schedule states must be None or attrs classes of plain values"
        )
        raise CheckpointError(msg) from e

    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(root)
    temp = root / _temp_name(name)
    temp.mkdir()
    try:
        files = {
            MODEL_FILE: _write_tensors(temp / MODEL_FILE, model, "model state dict"),
            BEST_MODEL_FILE: _write_tensors(temp / BEST_MODEL_FILE, best_model, "best model state dict"),
            OPTIMIZER_FILE: _write_tensors(temp / OPTIMIZER_FILE, optimizer_tensors, "optimizer state"),
            RNG_FILE: _write_tensors(temp / RNG_FILE, rng_tensors, "RNG states"),
        }
        rank_records = []
        for rank, rank_rng in enumerate(rank_rngs, start=1):
            record, tensors = _rng_to_disk(rank_rng)
            rank_records.append(record)
            files[rank_rng_file(rank)] = _write_tensors(
                temp / rank_rng_file(rank), tensors, f"rank {rank}'s RNG states"
            )
        descriptor = _Descriptor(
            format_version=FORMAT_VERSION,
            lamploop_version=_lamploop_version(),
            saved_at_unix_ns=time.time_ns(),
            loop_state=state.loop_state,
            schedule_state_type=_type_name(type(schedule_state)),
            schedule_state=schedule_json,
            model_spec=model_spec(model),
            best_model_spec=model_spec(best_model),
            optimizer_tensors=model_spec(optimizer_tensors),
            optimizer=optimizer_json,
            rng=rng_record,
            files=files,
            position=position,
            rank_rngs=rank_records,
            sequence=_next_sequence(root),
        )
        with open(temp / DESCRIPTOR_NAME, "w", encoding="utf-8") as f:
            f.write(_to_json(converter.unstructure(descriptor)) + "\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(temp)
        final = root / name
        replaced: pathlib.Path | None = None
        if final.exists() and _exchange(temp, final):
            # The new copy took the old one's place in one step; the old one is now at temp.
            replaced = root / _temp_name(f"trash-{name}")
            os.rename(temp, replaced)
        elif final.exists():
            # Without an atomic exchange: move the old one aside first (latest names it
            # meanwhile; a load then falls back to the newest valid checkpoint).
            replaced = root / _temp_name(f"trash-{name}")
            os.rename(final, replaced)
            try:
                os.rename(temp, final)
            except BaseException:
                os.rename(replaced, final)
                raise
        else:
            os.rename(temp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    _write_latest(root, name)
    if replaced is not None:
        _delete(replaced, "the replaced checkpoint")
    if keep_last is not None:
        _prune(root, keep_last, final)
    return final


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
    """

    path: pathlib.Path
    state: LoopStateWithModelAndOptimizerData
    schedule_state: Any
    rng: RngStates
    position: EpochPosition | None = None
    rank_rngs: tuple[RngStates, ...] = ()


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
    pointer = root / LATEST_NAME
    try:
        text = pointer.read_text(encoding="utf-8")
    except FileNotFoundError:
        if not root.is_dir():
            return None
        return _newest_complete(root)
    except (OSError, UnicodeDecodeError) as e:
        msg = f"{pointer}: cannot read the latest-checkpoint pointer: {e}"
        raise CheckpointError(msg) from e
    name = text.strip()
    if not _CHECKPOINT_NAME.fullmatch(name):
        msg = f"{pointer}: holds {name!r}, which is not a checkpoint directory name like 'epoch-000006'"
        raise CheckpointError(msg)
    target = root / name
    if not target.is_dir():
        fallback = _newest_complete(root)
        if fallback is None:
            msg = f"{pointer}: names {name}, but {target} does not exist"
            raise CheckpointError(msg)
        _log.warning(
            "%s names %s, which does not exist; using %s, the newest saved", pointer, name, fallback.name
        )
        return fallback
    return target


def _newest_complete(root: pathlib.Path, *, but: pathlib.Path | None = None) -> pathlib.Path | None:
    """The most recently saved checkpoint directory with a descriptor (other than ``but``)."""
    complete = [p for p in _checkpoint_dirs(root) if (p / DESCRIPTOR_NAME).is_file() and p != but]
    return max(complete, key=_saved_at, default=None)


def _resolve(path: str | os.PathLike[str]) -> pathlib.Path:
    p = pathlib.Path(path)
    if not p.exists():
        msg = f"{p}: no such checkpoint directory"
        raise CheckpointError(msg)
    if not p.is_dir():
        msg = f"{p}: not a directory (expected a checkpoint directory or the root holding '{LATEST_NAME}')"
        raise CheckpointError(msg)
    if (p / DESCRIPTOR_NAME).exists() or _CHECKPOINT_NAME.fullmatch(p.name):
        return p
    found = latest_checkpoint(p)
    if found is None:
        msg = f"{p}: no checkpoint here: no {DESCRIPTOR_NAME}, no '{LATEST_NAME}', no epoch-* directory"
        raise CheckpointError(msg)
    return found


def _read_descriptor(path: pathlib.Path) -> _Descriptor:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        msg = f"{path}: missing; this is not a complete checkpoint"
        raise CheckpointError(msg) from e
    except (OSError, UnicodeDecodeError) as e:
        msg = f"{path}: cannot read: {e}"
        raise CheckpointError(msg) from e
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        msg = f"{path}: not valid JSON: {e}"
        raise CheckpointError(msg) from e
    if not isinstance(raw, dict):
        msg = f"{path}: expected a JSON object, got {type(raw).__name__}"
        raise CheckpointError(msg)
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


def _check_file(path: pathlib.Path, record: _FileRecord) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError as e:
        msg = f"{path}: missing (listed in {DESCRIPTOR_NAME})"
        raise CheckpointError(msg) from e
    if size != record.size:
        msg = (
            f"{path}: size mismatch: {DESCRIPTOR_NAME} records {record.size} bytes, the file has {size} "
            f"({'truncated' if size < record.size else 'longer than written'})"
        )
        raise CheckpointError(msg)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    if digest.hexdigest() != record.sha256:
        msg = (
            f"{path}: sha256 mismatch: {DESCRIPTOR_NAME} records {record.sha256}, the file has "
            f"{digest.hexdigest()} (the file is corrupt or was changed after saving)"
        )
        raise CheckpointError(msg)


def _load_file(directory: pathlib.Path, descriptor: _Descriptor, file: str) -> dict[str, torch.Tensor]:
    """Check a file's size and sha256 against the descriptor, then parse it."""
    path = directory / file
    record = descriptor.files.get(file)
    if record is None:
        msg = f"{directory / DESCRIPTOR_NAME}: lists no sha256 and size for {file}"
        raise CheckpointError(msg)
    _check_file(path, record)
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
    target = schedule.state_type
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
            schedule state is structured into ``schedule.state_type``.  Without
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
    directory = _resolve(path)
    if directory == pathlib.Path(path):  # a checkpoint named explicitly: no fallback
        return _load_directory(directory, schedule, model, restore_rng)
    # The root: its latest checkpoint, or else the newest valid one saved before it.
    first_error: CheckpointError | None = None
    tried: set[pathlib.Path] = set()
    candidate: pathlib.Path | None = directory
    while candidate is not None:
        try:
            return _load_directory(candidate, schedule, model, restore_rng)
        except CheckpointError as e:
            first_error = first_error or e
            tried.add(candidate)
            _log.warning("skipping the checkpoint %s: %s", candidate, e)
        remaining = [p for p in _checkpoint_dirs(directory.parent) if p not in tried]
        candidate = max(
            (p for p in remaining if (p / DESCRIPTOR_NAME).is_file()), key=_saved_at, default=None
        )
    raise first_error if first_error is not None else CheckpointError(f"{path}: no valid checkpoint")


def _load_directory(
    directory: pathlib.Path,
    schedule: LearningRateSchedule[Any] | None,
    model: torch.nn.Module | Mapping[str, torch.Tensor] | None,
    restore_rng: bool,
) -> Checkpoint:
    """Load and validate one checkpoint directory (see :func:`load_checkpoint`)."""
    descriptor_path = directory / DESCRIPTOR_NAME
    descriptor = _read_descriptor(descriptor_path)
    if model is not None:
        actual = model_spec(model)
        for file, spec in (
            (MODEL_FILE, descriptor.model_spec),
            (BEST_MODEL_FILE, descriptor.best_model_spec),
        ):
            if file == BEST_MODEL_FILE and not spec.tensors:
                continue
            problem = describe_mismatch(spec, actual, expected_label="checkpoint", actual_label="model")
            if problem is not None:
                msg = f"{directory / file}: does not fit the given model: {problem}"
                raise CheckpointError(msg)
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
    state = LoopStateWithModelAndOptimizerData(
        loop_state=descriptor.loop_state, model=model_tensors, optimizer=optimizer, best_model=best_tensors
    )
    rank_rngs = tuple(
        _rng_from_disk(record, _load_file(directory, descriptor, rank_rng_file(rank)))
        for rank, record in enumerate(descriptor.rank_rngs, start=1)
    )
    return Checkpoint(
        path=directory,
        state=state,
        schedule_state=schedule_state,
        rng=rng,
        position=descriptor.position,
        rank_rngs=rank_rngs,
    )


def restore_optimizer_state(
    optimizer: torch.optim.Optimizer,
    state: Checkpoint | LoopStateWithModelAndOptimizerData | Mapping[str, Any],
) -> None:
    """``optimizer.load_state_dict`` with the optimizer state of a checkpoint, refusing misfits clearly.

    Tensors are moved to each parameter's device (and floating-point state to
    its dtype) by ``load_state_dict`` itself.

    Args:
        optimizer: the freshly built optimizer of the resumed run, over the
            same parameters (in the same groups and order) as the saved one.
        state: a :class:`Checkpoint`, a ``LoopStateWithModelAndOptimizerData``
            or an ``optimizer.state_dict()``.

    Raises:
        CheckpointError: the saved state has another number of parameter
            groups or of parameters in a group, or ``load_state_dict`` refuses it.
    """
    where = ""
    saved: Any = state
    if isinstance(state, Checkpoint):
        where = f"{state.path / OPTIMIZER_FILE}: "
        saved = state.state.optimizer
    elif isinstance(state, LoopStateWithModelAndOptimizerData):
        saved = state.optimizer
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, list):
        msg = f"{where}the optimizer state has no list of param_groups"
        raise CheckpointError(msg)
    if len(groups) != len(optimizer.param_groups):
        msg = (
            f"{where}the saved optimizer has {len(groups)} parameter groups, "
            f"this {type(optimizer).__name__} has {len(optimizer.param_groups)}"
        )
        raise CheckpointError(msg)
    for i, (s, g) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        if len(s.get("params", ())) != len(g["params"]):
            msg = (
                f"{where}parameter group {i}: the saved optimizer has {len(s.get('params', ()))} parameters, "
                f"this {type(optimizer).__name__} has {len(g['params'])}"
            )
            raise CheckpointError(msg)
    try:
        optimizer.load_state_dict(dict(saved))
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        msg = f"{where}{type(optimizer).__name__}.load_state_dict refused the saved state: {e}"
        raise CheckpointError(msg) from e


# --------------------------------------------------------------------------------------------
# The epoch-loop callback


class Checkpointer:
    """A ``checkpoint_state`` callback for the training drivers: saves after every epoch.

    ``await checkpointer(state, schedule_state)`` runs :func:`save_checkpoint`
    in a worker thread, so the event loop (heartbeats, the control channel)
    stays responsive while files are written and fsynced.  Saves through one
    ``Checkpointer`` never overlap.  If the awaiting task is cancelled, the save
    in progress still finishes (a checkpoint is never abandoned half-written).

    Attributes:
        directory: the root directory.
        keep_last: passed to :func:`save_checkpoint`.
        last_path: the directory of the last checkpoint saved, ``None`` before the first.
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep_last: int | None = 3) -> None:
        """Save into ``directory``, keeping the last ``keep_last`` checkpoints.

        Raises:
            ConfigurationError: ``keep_last`` is not ``None`` or an int >= 1.
        """
        _check_keep_last(keep_last, "Checkpointer")
        self.directory = pathlib.Path(directory)
        self.keep_last = keep_last
        self.last_path: pathlib.Path | None = None
        self._lock = anyio.Lock()

    async def __call__(self, state: LoopStateWithModelAndOptimizerData, schedule_state: Any) -> None:
        """Save ``state`` and ``schedule_state``; see :func:`save_checkpoint` for what it raises."""
        save = functools.partial(
            save_checkpoint,
            self.directory,
            state,
            schedule_state=schedule_state,
            keep_last=self.keep_last,
            # Captured here, in the caller's thread and at the moment of the call: other tasks
            # may draw random numbers while the worker thread writes.
            rng=RngStates.capture(),
        )
        async with self._lock:
            self.last_path = await anyio.to_thread.run_sync(save)

    async def save_position(
        self,
        state: LoopStateWithModelAndOptimizerData,
        schedule_state: Any,
        position: EpochPosition,
        rank_rngs: Sequence[RngStates],
    ) -> None:
        """Save a checkpoint at a step boundary (see ``drive_distributed_training``).

        ``rank_rngs`` are every rank's RNG states there, rank 0's first.  Step 0 is the
        start of ``position.epoch``: saved as an epoch-boundary checkpoint, with the RNG states.
        """
        save = functools.partial(
            save_checkpoint,
            self.directory,
            state,
            schedule_state=schedule_state,
            keep_last=self.keep_last,
            rng=rank_rngs[0] if rank_rngs else RngStates.capture(),
            position=position if position.steps_done > 0 else None,
            rank_rngs=tuple(rank_rngs[1:]),
        )
        async with self._lock:
            self.last_path = await anyio.to_thread.run_sync(save)

    def __repr__(self) -> str:
        return f"Checkpointer({str(self.directory)!r}, keep_last={self.keep_last!r})"
