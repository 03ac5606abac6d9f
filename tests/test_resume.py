"""Issue acceptance: a fresh process resumed from the epoch-3 checkpoint ends bitwise equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

WORKER = Path(__file__).parent / "workers" / "resume.py"


def _run(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, str(WORKER), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_fresh_process_resumed_at_epoch_3_ends_bitwise_equal(tmp_path: Path) -> None:
    _run(str(tmp_path), "full")
    checkpoint = tmp_path / "checkpoints" / "epoch-000003"
    assert checkpoint.is_dir(), sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    _run(str(tmp_path), "resume", str(checkpoint))

    full = safetensors.torch.load_file(tmp_path / "full.safetensors")
    resumed = safetensors.torch.load_file(tmp_path / "resume.safetensors")
    assert full.keys() == resumed.keys()
    for name in full:
        assert torch.equal(full[name], resumed[name]), f"{name} differs after resuming"

    full_run = json.loads((tmp_path / "full.json").read_text())
    resumed_run = json.loads((tmp_path / "resume.json").read_text())
    assert resumed_run["state"] == full_run["state"]  # the same learning curve, to the last bit
    assert resumed_run["best_epoch"] == full_run["best_epoch"]
    assert len(full_run["state"]["learning_curve"]) == 6
