"""What two ranks of ``fit`` (batches of 8 each) must match: ``fit`` on one process with batches of 16.

Shared by the launcher tests (torchrun and fit's own spawning on one machine, in
``test_launch.py``; torchrun across two network namespaces, in ``test_multinode.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from workers import rank as worker

import lamploop

Reference = tuple[lamploop.LoopState, dict[str, torch.Tensor]]


def single_process_fit() -> Reference:
    """``fit`` on one process, batches of 16, without any launcher's variables."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("RANK", "WORLD_SIZE", "LAMPLOOP_RANK", "SLURM_PROCID"):
            mp.delenv(name, raising=False)
        kwargs = worker.fit_kwargs(0, 2 * worker.FIT_BATCH)
        state = lamploop.fit(**kwargs)
    assert state is not None
    return state, kwargs["model"].module.state_dict()


def check_against_single_process(out: Path, single: Reference, launcher: str | None) -> None:
    """The 2-rank run whose outputs are in ``out`` trained exactly like ``single``."""
    result = json.loads((out / "result.json").read_text())
    assert (result["launcher"], result["rank"]) == (launcher, 0)
    state = lamploop.state.converter.structure(result["state"], lamploop.LoopState)
    expected, expected_params = single
    assert state.epoch == worker.FIT_EPOCHS
    assert state.min_validation_epoch == expected.min_validation_epoch
    for got, want in zip(state.learning_curve, expected.learning_curve, strict=True):
        assert got.training_loss == pytest.approx(want.training_loss, abs=1e-9, rel=0)
        assert got.validation_loss == pytest.approx(want.validation_loss, abs=1e-9, rel=0)
    params = worker.load_file(str(out / "params.safetensors"))
    assert sorted(params) == sorted(expected_params)
    for name, value in expected_params.items():
        torch.testing.assert_close(params[name], value, atol=1e-6, rtol=0)
    follower = json.loads((out / "follower-1.json").read_text())
    assert (follower["rank"], follower["world_size"]) == (1, 2)
