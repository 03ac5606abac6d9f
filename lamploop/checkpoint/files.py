"""Files and directories: atomic writes with fsync, the save order, leftovers of crashed saves, pruning."""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import pathlib
import secrets
import shutil
import socket
import sys
from collections.abc import Mapping
from typing import Any

import safetensors
import safetensors.torch
import torch

from lamploop.checkpoint.format import (
    _CHECKPOINT_NAME,
    _TMP_NAME,
    _TMP_PREFIX,
    DESCRIPTOR_NAME,
    LATEST_NAME,
    _FileRecord,
)
from lamploop.errors import CheckpointError, LamploopError
from lamploop.safetensors_layout import safetensors_parts
from lamploop.strict_json import fsync_dir

_log = logging.getLogger("lamploop.checkpoint")

# --------------------------------------------------------------------------------------------
# Files


def make_directory(path: pathlib.Path, where: str) -> None:
    """``path`` and its parents made (an existing directory is fine); CheckpointError naming it if not."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        msg = f"{where}: cannot make the directory {str(path)!r}: {exc.strerror or exc}"
        raise CheckpointError(msg) from exc


def read_json_object(
    path: pathlib.Path, error: type[LamploopError], *, missing: str = "missing"
) -> dict[str, Any]:
    """The JSON object in ``path``; ``error`` says what is wrong, starting with the path."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        msg = f"{path}: {missing}"
        raise error(msg) from e
    except (OSError, UnicodeDecodeError) as e:
        msg = f"{path}: cannot read: {e}"
        raise error(msg) from e
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        msg = f"{path}: not valid JSON: {e}"
        raise error(msg) from e
    if not isinstance(raw, dict):
        msg = f"{path}: expected a JSON object, got {type(raw).__name__}"
        raise error(msg)
    return raw


def _cpu_tensors(tensors: Mapping[Any, Any], what: str) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors; one that shares storage with an earlier one is cloned."""
    if not isinstance(tensors, Mapping):
        hint = " (pass module.state_dict())" if isinstance(tensors, torch.nn.Module) else ""
        msg = f"{what}: expected a mapping of names to tensors{hint}, got {type(tensors).__name__}"
        raise CheckpointError(msg)
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


def _write_tensors(path: pathlib.Path, tensors: dict[str, torch.Tensor], what: str) -> _FileRecord:
    """Write ``tensors`` (contiguous, on the CPU) as a safetensors file, hashing and fsyncing it.

    The header is made here and each tensor's bytes go to the file and the hash straight from
    its memory, which releases the GIL: the GIL is held for the header, never for a copy of
    gigabytes (``safetensors.torch.save`` holds it about 0.5 s per GiB, seconds on a loaded
    machine), so the event loop and its heartbeats keep running while a large checkpoint is
    written in a worker thread.  Tensors of other dtypes go through ``safetensors.torch.save``.
    """
    parts = safetensors_parts({name: tensors[name] for name in sorted(tensors)})
    if parts is None:
        return _write_serialized(path, tensors, what)
    digest, size = hashlib.sha256(), 0
    with open(path, "wb") as f:
        for part in parts:
            f.write(part)
            digest.update(part)
            size += len(part)
        f.flush()
        os.fsync(f.fileno())
    return _FileRecord(sha256=digest.hexdigest(), size=size)


def _write_serialized(path: pathlib.Path, tensors: dict[str, torch.Tensor], what: str) -> _FileRecord:
    """Serialize with safetensors, then write, hash and fsync (the bytes are hashed, not read back)."""
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


def checkpoint_directories(root: pathlib.Path) -> list[pathlib.Path]:
    """The directories under ``root`` named like checkpoints (``epoch-000006``, ``epoch-000006-step-...``)."""
    return [p for p in root.iterdir() if _CHECKPOINT_NAME.fullmatch(p.name) and p.is_dir()]


def is_one_checkpoint(path: pathlib.Path) -> bool:
    """Whether ``path`` is a checkpoint directory itself (``False``: a run directory holding some).

    Raises:
        CheckpointError: ``path`` does not exist or is not a directory.
    """
    if not path.exists():
        msg = f"{path}: no such checkpoint directory"
        raise CheckpointError(msg)
    if not path.is_dir():
        msg = f"{path}: not a directory (expected a checkpoint directory or a run directory holding them)"
        raise CheckpointError(msg)
    return (path / DESCRIPTOR_NAME).exists() or _CHECKPOINT_NAME.fullmatch(path.name) is not None


def no_checkpoint_here(root: pathlib.Path) -> CheckpointError:
    """The error for a run directory ``root`` in which no checkpoint is found."""
    return CheckpointError(
        f"{root}: no checkpoint here: no {DESCRIPTOR_NAME}, no '{LATEST_NAME}', no epoch-* directory"
    )


def read_latest(root: pathlib.Path) -> tuple[str | None, str | None]:
    """The checkpoint name ``<root>/latest`` holds, and what is wrong with the pointer.

    ``(name, None)``: a checkpoint directory name (whether it exists is not checked);
    ``(None, None)``: there is no pointer; ``(None, problem)``: it cannot be read, or holds
    something that is not a checkpoint directory name.
    """
    pointer = root / LATEST_NAME
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{pointer}: cannot read the latest-checkpoint pointer: {e}"
    if not _CHECKPOINT_NAME.fullmatch(name):
        return (
            None,
            f"{pointer}: holds {name!r}, which is not a checkpoint directory name like 'epoch-000006'",
        )
    return name, None


def saved_at(directory: pathlib.Path) -> tuple[int, int, str]:
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
    return 1 + max((saved_at(p)[0] for p in checkpoint_directories(root)), default=0)


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
    fsync_dir(root)


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
    others = [p for p in checkpoint_directories(root) if p.name != just_written.name]
    others.sort(key=saved_at, reverse=True)
    for directory in others[keep_last - 1 :]:
        # Renamed away first, so that a half-deleted directory never looks like a checkpoint.
        trash = root / _temp_name(f"trash-{directory.name}")
        try:
            os.rename(directory, trash)
        except OSError:
            _log.warning("could not prune the old checkpoint %s", directory, exc_info=True)
            continue
        _delete(trash, "the pruned checkpoint")


def newest_complete(root: pathlib.Path, *, but: pathlib.Path | None = None) -> pathlib.Path | None:
    """The most recently saved checkpoint directory with a descriptor (other than ``but``)."""
    complete = [p for p in checkpoint_directories(root) if (p / DESCRIPTOR_NAME).is_file() and p != but]
    return max(complete, key=saved_at, default=None)
