"""A strategy's state (PowerSGD's error feedback and Q, DiLoCo's outer momentum) survives a resume.

Real processes: ``fit(world_size=2)`` with a stateful strategy (tests/workers/
stateful_strategy.py) writes every rank's sync state into the root's checkpoints (``sync``,
``sync.rank1``); a run stopped after one epoch and resumed ends bitwise equal to an
uninterrupted one, because the root hands each rank its own saved state when the ranks meet.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support import ROOT, WORKERS
from workers import warm_start

from lamploop.checkpoint import load_checkpoint

ROOT = ROOT
WORKER = WORKERS / "stateful_strategy.py"


def _start(strategy: str, directory: Path, max_epochs: int) -> Any:
    return warm_start.popen(
        [sys.executable, str(WORKER), strategy, str(directory), str(max_epochs)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(run: Any, strategy: str, max_epochs: int) -> None:
    try:
        out, _ = run.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        run.kill()
        pytest.fail(f"{strategy}: the run did not end within 90 s:\n{run.communicate()[0]}")
    assert run.returncode == 0, out
    assert f"finished at epoch {max_epochs}" in out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["powersgd1", "diloco8"])
def test_a_resumed_run_with_a_stateful_strategy_equals_an_uninterrupted_one(
    strategy: str, tmp_path: Path
) -> None:
    whole, first = _start(strategy, tmp_path / "whole", 3), _start(strategy, tmp_path / "resumed", 1)
    _finish(whole, strategy, 3)  # side by side: independent runs of 2 ranks each
    _finish(first, strategy, 1)
    _finish(_start(strategy, tmp_path / "resumed", 3), strategy, 3)
    whole_run, resumed = load_checkpoint(tmp_path / "whole"), load_checkpoint(tmp_path / "resumed")
    assert {"sync", "sync.rank1"} <= set(whole_run.extras)
    rank0, _ = whole_run.extras["sync"]
    rank1, _ = whole_run.extras["sync.rank1"]
    assert rank0, "the strategy saved no state"
    if strategy.startswith("powersgd"):  # each rank keeps its own error feedback
        assert any(not torch.equal(rank0[k], rank1[k]) for k in rank0 if k.startswith("error."))
    for name, tensor in whole_run.state.model.items():
        assert torch.equal(tensor, resumed.state.model[name]), f"{strategy}: {name} differs after the resume"
    for name, tensor in rank1.items():
        assert torch.equal(tensor, resumed.extras["sync.rank1"][0][name]), f"{strategy}: rank 1's {name}"


class _Extra:
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        return {}, {}

    def load_state_dict(self, tensors: object, meta: object) -> None:
        """Nothing to restore."""


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (
            {"checkpoint_every_n_steps": 5},
            "checkpoint_every_n_steps cannot be combined with strategy 'powersgd4'",
        ),
        ({"checkpoint_every_seconds": 60.0}, "checkpoint_every_seconds cannot be combined with strategy"),
        ({"checkpoint_extras": {"sync": _Extra()}}, "name 'sync' is taken by strategy 'powersgd4'"),
    ],
)
def test_a_stateful_strategy_refuses_what_would_lose_its_state_before_any_rank_starts(
    tmp_path: Path, options: dict[str, object], expected: str
) -> None:
    import lamploop
    from lamploop.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=expected):
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=lamploop.tensor_batches(
                torch.randn(8, 2), torch.zeros(8, dtype=torch.long), batch_size=4
            ),
            max_epochs=1,
            checkpoint_dir=tmp_path,
            strategy="powersgd4",
            world_size=2,
            launch_command=["false"],  # never run: the refusal comes first
            **options,  # type: ignore[arg-type]
        )
