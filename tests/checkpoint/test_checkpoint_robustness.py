"""Checkpoints that survive what goes wrong around them (issue: never hangs, loses nothing).

- a ``latest`` that names a missing or invalid checkpoint falls back to the newest valid
  one, and a warning names what was skipped;
- pruning and the fallback follow the order of saves (a sequence number in each
  descriptor), not the wall clock;
- re-saving a checkpoint of the same position swaps the new copy in at once;
- the sha256 in the descriptor is the written file's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib

import attrs
import pytest
from test_checkpoint import _state_at, entries, full_state

from lamploop.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from lamploop.errors import CheckpointError
from lamploop.schedules import PlateauState, reduce_lr_on_plateau


def _three(root: pathlib.Path) -> None:
    state, _, _ = full_state()
    for epoch in (1, 2, 3):
        save_checkpoint(root, _state_at(state, epoch), keep_last=None)


def test_a_corrupted_latest_falls_back_to_the_previous_checkpoint(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    _three(tmp_path)
    model = tmp_path / "epoch-000003" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        loaded = load_checkpoint(tmp_path)
    assert loaded.path == tmp_path / "epoch-000002"
    assert loaded.state.loop_state.epoch == 2
    assert any("epoch-000003" in r.getMessage() and "sha256" in r.getMessage() for r in caplog.records)
    # Named explicitly, the corrupt checkpoint is still refused: no silent substitution.
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        load_checkpoint(tmp_path / "epoch-000003")


def test_latest_naming_a_missing_checkpoint_falls_back_with_a_warning(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    _three(tmp_path)
    (tmp_path / "latest").write_text("epoch-000099\n")
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path) == tmp_path / "epoch-000003"
        assert load_checkpoint(tmp_path).state.loop_state.epoch == 3
    assert any("epoch-000099" in r.getMessage() for r in caplog.records)


def test_when_nothing_is_valid_the_first_error_is_raised(tmp_path: pathlib.Path) -> None:
    _three(tmp_path)
    for epoch in (1, 2, 3):
        (tmp_path / f"epoch-{epoch:06d}" / "optimizer.safetensors").write_bytes(b"broken")
    with pytest.raises(CheckpointError, match=r"epoch-000003.*optimizer\.safetensors"):
        load_checkpoint(tmp_path)


def test_pruning_follows_the_order_of_saves_not_the_wall_clock(tmp_path: pathlib.Path) -> None:
    state, _, _ = full_state()
    for epoch in (1, 2, 3):
        path = save_checkpoint(tmp_path, _state_at(state, epoch), keep_last=3)
        # A clock that jumps back: each new save claims to be older than the one before.
        descriptor = path / "checkpoint.json"
        raw = json.loads(descriptor.read_text())
        raw["saved_at_unix_ns"] = 10**18 - epoch
        text = json.dumps(raw)
        # Keep the descriptor consistent: only saved_at changes, files keep their sha256.
        descriptor.write_text(text)
        os.utime(path, ns=(10**18 - epoch, 10**18 - epoch))
    save_checkpoint(tmp_path, _state_at(state, 4), keep_last=3)
    assert entries(tmp_path) == ["epoch-000002", "epoch-000003", "epoch-000004", "latest"]
    sequences = [
        json.loads((tmp_path / n / "checkpoint.json").read_text())["sequence"] for n in entries(tmp_path)[:3]
    ]
    assert sequences == sorted(sequences)
    assert len(set(sequences)) == 3


def test_resaving_a_position_swaps_in_the_new_copy(tmp_path: pathlib.Path) -> None:
    state, _, _ = full_state()
    save_checkpoint(tmp_path, state, schedule_state=PlateauState(1.0))
    save_checkpoint(tmp_path, state, schedule_state=PlateauState(0.25))
    assert entries(tmp_path) == ["epoch-000003", "latest"]  # no leftover of the old copy
    assert load_checkpoint(tmp_path, schedule=reduce_lr_on_plateau()).schedule_state == PlateauState(0.25)


def test_the_recorded_sha256_is_that_of_the_written_file(tmp_path: pathlib.Path) -> None:
    state, _, _ = full_state()
    path = save_checkpoint(tmp_path, attrs.evolve(state))
    files = json.loads((path / "checkpoint.json").read_text())["files"]
    assert files
    for name, record in files.items():
        data = (path / name).read_bytes()
        assert record == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}, name
