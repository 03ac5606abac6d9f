"""``verify_checkpoint``: every problem at once, with the very words ``load_checkpoint`` refuses with.

Loading and verifying share one check of a file against its record
(``lamploop.checkpoint.integrity.check_file``), so a damaged file is named the same way by
both, and ``lamploop inspect`` prints what ``verify_checkpoint`` found.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lamploop.checkpoint import (
    LATEST_NAME,
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from lamploop.errors import CheckpointError
from lamploop.inspection import inspect_checkpoint
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData


def _save(root: Path, epoch: int) -> Path:
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(module.parameters())
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = LoopStateWithModelAndOptimizerData(
        LoopState(epoch=epoch), model=module.state_dict(), optimizer=optimizer.state_dict()
    )
    return save_checkpoint(root, state)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _lengthen(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0")


DAMAGE: dict[str, Callable[[Path], None]] = {
    "missing": Path.unlink,
    "truncated": _truncate,
    "flipped": _flip,
    "longer": _lengthen,
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("file", [MODEL_FILE, OPTIMIZER_FILE, RNG_FILE])
def test_a_damaged_file_is_named_alike_by_load_and_verify(tmp_path: Path, damage: str, file: str) -> None:
    directory = _save(tmp_path, 1)
    DAMAGE[damage](directory / file)
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(directory)
    report = verify_checkpoint(directory)
    assert not report.ok
    assert str(refused.value).startswith(f"{directory / file}: ")
    assert str(refused.value) in report.problems
    (bad,) = [f for f in report.files if not f.ok]
    assert bad.name == file


def test_every_problem_of_a_run_is_found_at_once(tmp_path: Path) -> None:
    first, second = _save(tmp_path, 1), _save(tmp_path, 2)
    _truncate(first / MODEL_FILE)
    _flip(second / OPTIMIZER_FILE)
    (tmp_path / LATEST_NAME).write_text("not-a-checkpoint\n")
    report = verify_checkpoint(tmp_path)
    assert [p.split(": ")[0] for p in report.problems] == [
        str(tmp_path / LATEST_NAME),
        str(first / MODEL_FILE),
        str(second / OPTIMIZER_FILE),
    ]
    assert [c.ok for c in report.checkpoints] == [False, False]
    with pytest.raises(CheckpointError, match="not a checkpoint directory name"):
        load_checkpoint(tmp_path)


def test_verify_picks_the_checkpoint_load_would_load(tmp_path: Path) -> None:
    older, newer = _save(tmp_path, 1), _save(tmp_path, 2)
    _flip(newer / MODEL_FILE)
    report = verify_checkpoint(tmp_path)
    assert report.path == older == load_checkpoint(tmp_path).path
    assert report.epoch == 1
    assert inspect_checkpoint is verify_checkpoint
