"""A model that does not fit a run's checkpoints: one clear error, no warning per checkpoint.

docs/checkpoints.md: ``load_checkpoint(root)`` falls back past a ``latest`` checkpoint that
is missing or invalid (damaged), with a warning naming it; ``model=`` is checked against
the checkpoint, which "raises CheckpointError ... does not fit the given model".  A
checkpoint that does not fit the given model is not damaged: the older checkpoints of the
run are of the same model, and falling back warned once for each of them before raising
the same error (or loaded an older checkpoint of another model).  Now it raises at once.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

import lamploop
from lamploop.checkpoint import load_checkpoint, save_checkpoint
from lamploop.checkpoint.format import MODEL_FILE
from lamploop.errors import CheckpointError
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData

pytestmark = pytest.mark.timeout(120)


def _module(hidden: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))


def _fit(module: torch.nn.Module, root: Path, epochs: int) -> None:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 3, generator=generator), torch.randint(0, 2, (32,), generator=generator)
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=8),
        max_epochs=epochs,
        checkpoint_dir=root,
        keep_last=None,
        device="cpu",
        reporters=[],
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run's root with the checkpoints of its three epochs, of a model with 8 hidden units."""
    root = tmp_path_factory.mktemp("mismatch") / "checkpoints"
    _fit(_module(8), root, 3)
    assert sorted(p.name for p in root.glob("epoch-*")) == ["epoch-000001", "epoch-000002", "epoch-000003"]
    return root


def _checkpoint_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("lamploop") and r.levelno >= logging.WARNING
    ]


def test_a_model_that_does_not_fit_raises_once_without_a_warning_per_checkpoint(
    run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="lamploop")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(run, model=_module(16))
    assert type(info.value) is CheckpointError
    message = str(info.value)
    assert message.startswith(str(run / "epoch-000003" / MODEL_FILE)), message
    assert (
        "does not fit the given model: tensor '0.weight': checkpoint shape (8, 3), model shape (16, 3)"
        in message
    )
    assert _checkpoint_warnings(caplog) == []


def test_fit_resuming_with_another_model_fails_at_once_naming_the_latest(
    run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(run, root)
    caplog.set_level(logging.DEBUG, logger="lamploop")
    with pytest.raises(CheckpointError, match="does not fit the given model") as info:
        _fit(_module(16), root, 5)
    assert str(info.value).startswith(str(root / "epoch-000003" / MODEL_FILE)), str(info.value)
    assert _checkpoint_warnings(caplog) == []


def test_an_older_checkpoint_of_the_given_model_is_not_loaded_in_place_of_the_latest(
    run: Path, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(run, root)
    other = _module(16)  # the run went on with another model: its checkpoint is the latest
    state = LoopStateWithModelAndOptimizerData(
        loop_state=LoopState(epoch=4),
        model=other.state_dict(),
        optimizer=torch.optim.SGD(other.parameters(), lr=0.1).state_dict(),
        best_model={},
    )
    save_checkpoint(root, state, keep_last=None)
    with pytest.raises(CheckpointError, match=r"epoch-000004.*does not fit the given model"):
        load_checkpoint(root, model=_module(8))
    assert load_checkpoint(root, model=other).path == root / "epoch-000004"


def test_a_damaged_latest_still_falls_back_with_one_warning(
    run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "checkpoints"
    shutil.copytree(run, root)
    model_file = root / "epoch-000003" / MODEL_FILE
    model_file.write_bytes(model_file.read_bytes()[:-7])  # truncated
    caplog.set_level(logging.DEBUG, logger="lamploop")
    assert load_checkpoint(root, model=_module(8)).path == root / "epoch-000002"
    warnings = _checkpoint_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "epoch-000003" in warnings[0]
    # With a model that does not fit either: the fit is checked before any tensor is read,
    # so the latest is refused for that, at once.
    caplog.clear()
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(root, model=_module(16))
    assert str(info.value).startswith(f"{root / 'epoch-000003' / MODEL_FILE}: does not fit"), str(info.value)
    assert _checkpoint_warnings(caplog) == []


def test_a_schedule_that_does_not_fit_the_saved_state_raises_once_without_falling_back(
    run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The run's checkpoints hold noop's state; a plateau schedule's state is another type: the
    schedule is the caller's mismatch, as a model that does not fit is."""
    caplog.set_level(logging.DEBUG, logger="lamploop")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(run, schedule=lamploop.reduce_lr_on_plateau(patience=2))
    assert type(info.value) is CheckpointError
    message = str(info.value)
    assert message.startswith(f"{run / 'epoch-000003' / 'checkpoint.json'}: the schedule state"), message
    assert "does not fit ReduceLrOnPlateau" in message, message
    assert _checkpoint_warnings(caplog) == []
    assert load_checkpoint(run, schedule=lamploop.noop()).path == run / "epoch-000003"
