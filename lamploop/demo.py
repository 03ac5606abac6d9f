"""The demo job: a small MLP on scikit-learn's handwritten digits.

``lamploop demo`` trains it, prints each epoch's training and validation loss
and the final validation accuracy, and leaves checkpoints in ``--out``; run it
again and it resumes from the latest checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lamploop.batches import tensor_batches
from lamploop.fit import fit
from lamploop.model import SupervisedModel
from lamploop.state import LoopState

__all__ = ["digits_data", "digits_model", "run_demo"]


def digits_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_valid, y_valid)``: 80/20 split of the 1797 digits, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits  # an optional dependency: only the demo needs it

    x, y = load_digits(return_X_y=True)
    features = torch.tensor(x / 16.0, dtype=torch.float32)
    target = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(target), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(target))
    train, valid = order[:cut], order[cut:]
    return features[train], target[train], features[valid], target[valid]


def digits_model(seed: int = 0) -> torch.nn.Module:
    """An MLP 64 -> 128 -> 64 -> 10 with seeded initial weights."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def accuracy(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The fraction of ``x`` that ``module`` classifies as ``y``."""
    module.eval()
    with torch.no_grad():
        return float((module(x).argmax(dim=1) == y).float().mean())


def _print_epoch(state: LoopState) -> None:
    entry = state.learning_curve[-1]
    valid = "" if entry.validation_loss is None else f"  valid loss {entry.validation_loss[1]:.4f}"
    print(f"epoch {entry.epoch:3d}  train loss {entry.training_loss:.4f}{valid}", flush=True)


def run_demo(
    *,
    epochs: int = 30,
    out: Path = Path("runs/demo"),
    batch_size: int = 32,
    seed: int = 0,
    world_size: int = 2,
) -> float | None:
    """Train the digits MLP on ``world_size`` local ranks; print and return the validation accuracy.

    Rank 0 runs in this process and starts the others by running the same
    command again; it returns the accuracy, the other ranks ``None``.
    """
    x_train, y_train, x_valid, y_valid = digits_data(seed)
    module = digits_model(seed)
    state = fit(
        model=SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-3),
        train_batches=tensor_batches(x_train, y_train, batch_size=batch_size, seed=seed),
        validation_batches=tensor_batches(x_valid, y_valid, batch_size=256, shuffle=False),
        max_epochs=epochs,
        checkpoint_dir=out,
        on_epoch=_print_epoch,
        world_size=world_size,
    )
    if state is None:
        return None
    result = accuracy(module, x_valid, y_valid)
    print(
        f"best epoch {state.min_validation_epoch} "
        f"(smoothed validation loss {state.min_validation_loss:.4f}); "
        f"validation accuracy {result:.4f}; checkpoints in {out}/",
        flush=True,
    )
    return result
