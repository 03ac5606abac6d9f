"""A sharded checkpoint checked, not loaded: its index, each shard file's size and sha256, every row once."""

from __future__ import annotations

import os
import pathlib

import attrs

from lamploop.checkpoint.format import DESCRIPTOR_NAME
from lamploop.checkpoint.integrity import FileCheck, check_file, file_size
from lamploop.checkpoint.sharded_index import SHARDED_INDEX, _Index, _read_index
from lamploop.errors import CheckpointError

__all__ = ["sharded_file_checks", "verify_sharded"]


def _coverage_problems(index: _Index) -> list[str]:
    """Tensors whose shards do not cover their rows exactly once, or name a file not listed."""
    problems = []
    for key, entry in index.tensors.items():
        shape = entry.get("shape", [])
        want = shape[0] if shape else 0
        covered = 0
        for shard in sorted(entry.get("shards", []), key=lambda s: int(s["offset"])):
            if shard["file"] not in index.files:
                problems.append(f"{key}: its shard names {shard['file']!r}, which the index does not list")
            if int(shard["offset"]) != covered:
                problems.append(f"{key}: rows {covered}..{shard['offset']} are missing or overlap")
            covered = int(shard["offset"]) + int(shard["rows"])
        if covered != want:
            problems.append(f"{key}: its shards cover {covered} of {want} rows")
    return problems


def sharded_file_checks(path: str | os.PathLike[str]) -> tuple[FileCheck, ...]:
    """Each file of a sharded checkpoint checked, the index first (what ``verify_checkpoint`` lists).

    The index's check carries what is wrong with it: unreadable, or a tensor whose rows its
    shards do not cover exactly once; each shard file's check its size and sha256.  Files the
    index does not list are noted.
    """
    directory = pathlib.Path(path)
    index_size = file_size(directory / SHARDED_INDEX)
    try:
        index = _read_index(directory)
    except CheckpointError as e:
        return (
            FileCheck(
                SHARDED_INDEX, index_size, problem=str(e).removeprefix(f"{directory / SHARDED_INDEX}: ")
            ),
        )
    coverage = _coverage_problems(index)
    checks = [FileCheck(SHARDED_INDEX, index_size, problem="; ".join(coverage) if coverage else None)]
    checks += [_against_index(check_file(directory, name, record)) for name, record in index.files.items()]
    listed = {SHARDED_INDEX, *index.files}
    present = sorted(p.name for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []
    note = f"not listed in {SHARDED_INDEX} (not read when loading)"
    checks += [
        FileCheck(name, file_size(directory / name), note=note) for name in present if name not in listed
    ]
    return tuple(checks)


def _against_index(check: FileCheck) -> FileCheck:
    """``check_file``'s verdict, naming the index the record came from."""
    if check.problem is None:
        return check
    return attrs.evolve(check, problem=check.problem.replace(DESCRIPTOR_NAME, SHARDED_INDEX))


def verify_sharded(path: str | os.PathLike[str]) -> list[str]:
    """Every problem of a sharded checkpoint directory (empty: it is intact), each naming its file.

    Checks the index, each shard file's size and sha256, and that every tensor's rows are
    covered exactly once.
    """
    directory = pathlib.Path(path)
    return [
        f"{directory / c.name}: {c.problem}" for c in sharded_file_checks(directory) if c.problem is not None
    ]
