"""One file of a checkpoint against its record: present, of the recorded size, of the recorded sha256.

:func:`check_file` is the one check of a file's bytes: :func:`~lamploop.checkpoint.load_checkpoint`
raises on what it finds, :func:`~lamploop.checkpoint.verify_checkpoint` collects it.
"""

from __future__ import annotations

import hashlib
import pathlib

import attrs

from lamploop.checkpoint.format import _CHUNK, DESCRIPTOR_NAME, _FileRecord

__all__ = ["FileCheck", "check_file", "file_size"]


@attrs.frozen
class FileCheck:
    """One file of a checkpoint directory, as found on disk.

    Attributes:
        name: the file's name in the checkpoint directory.
        size: its size in bytes (``None``: missing).
        recorded_size: the size ``checkpoint.json`` records (``None``: not recorded, as for
            ``checkpoint.json`` itself, or unknown because the descriptor is unreadable).
        sha256_ok: whether its sha256 is the one recorded (``None``: not checked).
        problem: what is wrong with it, ``None`` when nothing is.
        note: a remark that is no problem (e.g. a file ``checkpoint.json`` does not list).
    """

    name: str
    size: int | None
    recorded_size: int | None = None
    sha256_ok: bool | None = None
    problem: str | None = None
    note: str | None = None

    @property
    def ok(self) -> bool:
        """Whether nothing is wrong with this file."""
        return self.problem is None


def file_size(path: pathlib.Path) -> int | None:
    """The size of ``path`` in bytes, ``None`` when it does not exist."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_file(directory: pathlib.Path, name: str, record: _FileRecord) -> FileCheck:
    """``directory / name`` against ``record``: missing, truncated, longer, unreadable or changed."""
    path = directory / name
    size = file_size(path)
    if size is None:
        return FileCheck(name, None, record.size, None, f"missing (listed in {DESCRIPTOR_NAME})")
    if size != record.size:
        how = "truncated" if size < record.size else "longer than written"
        problem = f"size mismatch: {DESCRIPTOR_NAME} records {record.size} bytes, the file has {size} ({how})"
        return FileCheck(name, size, record.size, None, problem)
    try:
        digest = _sha256(path)
    except OSError as e:
        return FileCheck(name, size, record.size, None, f"cannot read: {e}")
    if digest != record.sha256:
        problem = (
            f"sha256 mismatch: {DESCRIPTOR_NAME} records {record.sha256}, the file has {digest} "
            "(the file is corrupt or was changed after saving)"
        )
        return FileCheck(name, size, record.size, False, problem)
    return FileCheck(name, size, record.size, True)
