"""Issue acceptance: a fresh process resumed from the epoch-3 checkpoint ends bitwise equal."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from support import WORKERS
from workers import warm_start

import lamploop

WORKER = WORKERS / "resume.py"


def _run(*args: str) -> None:
    result = warm_start.run(
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


_DATA = (torch.randn(64, 4, generator=torch.Generator().manual_seed(3)), torch.arange(64) % 2)


class _HalveEveryTwoEpochs:
    """A schedule written to DESIGN.md's bare protocol: only ``init`` and ``learning_rate_factor``."""

    def init(self) -> int:
        return 0

    def learning_rate_factor(
        self, state: int, epoch: int, last_validation_loss: float | None
    ) -> tuple[int, float]:
        return state + 1, 0.5 ** ((state + 1) // 2)


def test_a_schedule_with_only_the_protocols_two_methods_checkpoints_and_resumes(tmp_path: Path) -> None:
    def run(max_epochs: int, checkpoints: Path | None) -> tuple[lamploop.LoopState, list[float]]:
        torch.manual_seed(0)
        module = torch.nn.Linear(4, 2)
        state = lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1),
            train_batches=lamploop.tensor_batches(*_DATA, batch_size=8, seed=1),
            validation_batches=lamploop.tensor_batches(*_DATA, batch_size=16, shuffle=False),
            max_epochs=max_epochs,
            learning_rate_schedule=_HalveEveryTwoEpochs(),
            checkpoint_dir=checkpoints,
        )
        assert state is not None
        return state, module.weight.detach().flatten().tolist()

    straight, straight_weights = run(4, None)
    run(2, tmp_path)  # stops after 2 epochs with a checkpoint whose schedule state is an int
    resumed, resumed_weights = run(4, tmp_path)
    assert resumed.epoch == straight.epoch == 4
    assert resumed.learning_curve == straight.learning_curve
    assert resumed_weights == straight_weights
