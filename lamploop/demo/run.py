"""The demo job: a small MLP on scikit-learn's handwritten digits.

``lamploop demo`` trains it, shows its progress (live bars on a terminal, one line
per epoch in a pipe: :class:`~lamploop.reporting.progress.ProgressReporter`) and the
final validation accuracy, and leaves checkpoints in ``--out`` with its
settings beside them (``config.json``, a :class:`~lamploop.demo.config.DemoConfig`); run
it again, or ``lamploop demo --resume DIR``, and it resumes from the latest
checkpoint with those settings.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lamploop.batches import tensor_batches
from lamploop.demo.config import CONFIG_NAME, DemoConfig, has_checkpoints, resolve_config, save_config
from lamploop.errors import ConfigurationError
from lamploop.fit import fit
from lamploop.model import SupervisedModel
from lamploop.reporting.progress import ProgressReporter
from lamploop.state import LoopState

__all__ = ["demo_config", "digits_data", "digits_model", "run_demo", "train_demo"]


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


def digits_model(seed: int = 0, hidden_sizes: Sequence[int] = (128, 64)) -> torch.nn.Module:
    """An MLP 64 -> 128 -> 64 -> 10 (the hidden widths are ``hidden_sizes``) with seeded initial weights."""
    torch.manual_seed(seed)
    widths = [64, *hidden_sizes]
    layers: list[torch.nn.Module] = []
    for width_in, width_out in itertools.pairwise(widths):
        layers += [torch.nn.Linear(width_in, width_out), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(widths[-1], 10))
    return torch.nn.Sequential(*layers)


def accuracy(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The fraction of ``x`` that ``module`` classifies as ``y``."""
    module.eval()
    with torch.no_grad():
        return float((module(x).argmax(dim=1) == y).float().mean())


def run_demo(
    *,
    epochs: int = 30,
    out: Path = Path("runs/demo"),
    batch_size: int = 32,
    seed: int = 0,
    world_size: int = 2,
    learning_rate: float = 1e-3,
    hidden_sizes: Sequence[int] = (128, 64),
) -> float | None:
    """Train the digits MLP on ``world_size`` local ranks; print and return the validation accuracy.

    Rank 0 runs in this process and starts the others by running the same
    command again; it returns the accuracy, the other ranks ``None``.  When ``out``
    holds checkpoints, the run resumes from the latest one; every argument must then
    agree with the ``config.json`` saved there, except ``epochs``, which may be raised
    (see :func:`train_demo`).

    Raises:
        lamploop.errors.ConfigurationError: an argument disagrees with the saved configuration.
    """
    given = {
        "epochs": epochs,
        "batch_size": batch_size,
        "seed": seed,
        "world_size": world_size,
        "learning_rate": learning_rate,
        "hidden_sizes": tuple(hidden_sizes),
    }
    config = demo_config(out, given, given_by="run_demo's argument")
    return train_demo(config, out)


def demo_config(
    directory: Path,
    given: Mapping[str, Any] | None = None,
    *,
    resume: bool = False,
    given_by: str = "the command line",
) -> DemoConfig:
    """The :class:`DemoConfig` to train with in ``directory`` (:func:`~lamploop.demo.config.resolve_config`).

    ``given`` are the settings asked for (the rest are the saved ones, or the defaults in a
    fresh directory); with ``resume``, ``directory`` must hold a ``config.json``.

    Raises:
        lamploop.errors.ConfigurationError: ``config.json`` is unreadable or disagrees with
            ``given`` (the message names each field), or is missing while ``resume``.
    """
    return resolve_config(directory, DemoConfig, given or {}, resume=resume, given_by=given_by)


def _is_root() -> bool:
    """Whether this process is rank 0 (the one that writes), not a rank started by a launcher."""
    from lamploop.distributed.launch import launch_env

    try:
        env = launch_env()
    except ConfigurationError:
        return True  # fit reports the broken environment
    return env is None or env.rank == 0


def train_demo(config: DemoConfig, out: Path) -> float | None:
    """Save ``config`` to ``out/config.json`` (rank 0), then train as it says; see :func:`run_demo`.

    In a directory of checkpoints without a ``config.json`` (written before there was one),
    the config is saved only once the run resumed from them, never when they do not fit it.
    """
    pending = _is_root()
    if pending and ((out / CONFIG_NAME).exists() or not has_checkpoints(out)):
        save_config(config, out)
        pending = False

    def on_epoch(state: LoopState) -> None:
        nonlocal pending
        if pending:
            # Checkpoints from before config.json: saved once resuming from them worked, so that
            # a configuration that does not fit them is never recorded.
            save_config(config, out)
            pending = False

    x_train, y_train, x_valid, y_valid = digits_data(config.seed)
    module = digits_model(config.seed, config.hidden_sizes)
    learning_rate = config.learning_rate
    state = fit(
        model=SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.Adam(params, lr=learning_rate),
        train_batches=tensor_batches(x_train, y_train, batch_size=config.batch_size, seed=config.seed),
        validation_batches=tensor_batches(x_valid, y_valid, batch_size=256, shuffle=False),
        max_epochs=config.epochs,
        checkpoint_dir=out,
        on_epoch=on_epoch,
        world_size=config.world_size,
        # Live bars on a terminal, one line per epoch in a pipe; stops and failures are the
        # command's to say (one line).
        reporters=[ProgressReporter(sys.stdout)],
    )
    if state is None:
        return None
    if pending:  # resumed with nothing left to train: the checkpoint loaded, so the config fits
        save_config(config, out)
    result = accuracy(module, x_valid, y_valid)
    print(
        f"best epoch {state.min_validation_epoch} "
        f"(validation loss {state.min_validation_loss:.4f}); "
        f"validation accuracy {result:.4f}; checkpoints in {out}/",
        flush=True,
    )
    return result
