"""The data of the federated digits example: scikit-learn's digits, split non-IID across 3 nodes.

Each node is "home" to a few classes (node-0: 0-3, node-1: 4-6, node-2: 7-9) and holds 85%
of their examples; the other 15% of every class are spread over the other nodes.  A fifth
of the data is held out as the aggregator's test set (the researcher's own data, used only
to report the final accuracy).  Everything is a pure function of the seed, so a node
process, the aggregator and the benchmark derive the same split.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lamploop.federated import ModelDescription, OptimizerConfig, TrainingPlan, mlp
from lamploop.modelspec import model_spec

NODE_NAMES = ("node-0", "node-1", "node-2")
HOME_CLASSES = ((0, 1, 2, 3), (4, 5, 6), (7, 8, 9))
HOME_SHARE = 0.85
MODEL_OPTIONS: dict[str, Any] = {"sizes": [64, 64, 10], "seed": 0}


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits, read from the CSV it ships (importing sklearn.datasets takes a second)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        msg = 'the digits example needs scikit-learn: pip install "lamploop[demo]"'
        raise ModuleNotFoundError(msg)
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    data = np.loadtxt(path, delimiter=",")
    return data[:, :-1], data[:, -1].astype(np.int64)


def _digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    x, y = _load_digits()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    features = torch.tensor(x[order] / 16.0, dtype=torch.float32)
    return features, torch.tensor(y[order], dtype=torch.int64), rng.random(len(y))


def held_out_test_set(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out fifth: the aggregator's test set."""
    x, y, _ = _digits(seed)
    cut = len(y) // 5
    return x[:cut], y[:cut]


def node_data(index: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Node ``index``'s training and validation examples (features, labels, features, labels)."""
    x, y, draw = _digits(seed)
    cut = len(y) // 5
    x, y, draw = x[cut:], y[cut:], draw[cut:]
    home = np.array([next(i for i, group in enumerate(HOME_CLASSES) if int(c) in group) for c in y])
    # Away examples go to one of the two other nodes, chosen by the same draw.
    away = (home + 1 + (draw * 1000 % 2).astype(int)) % len(NODE_NAMES)
    owner = np.where(draw < HOME_SHARE, home, away)
    mine = torch.from_numpy(np.flatnonzero(owner == index))
    xs, ys = x[mine], y[mine]
    split = len(ys) * 85 // 100
    return xs[:split], ys[:split], xs[split:], ys[split:]


def make_plan(
    *, local_epochs: int = 1, learning_rate: float = 0.05, name: str = "digits-mlp"
) -> TrainingPlan:
    """The example's plan: an MLP, SGD with momentum reset every round, local epochs per round."""
    return TrainingPlan(
        name=name,
        model=ModelDescription("mlp", MODEL_OPTIONS, model_spec(mlp(MODEL_OPTIONS))),
        optimizer=OptimizerConfig("sgd", learning_rate=learning_rate, momentum=0.9),
        local_epochs=local_epochs,
        optimizer_state="reset",
    )


def class_counts(labels: torch.Tensor) -> list[int]:
    """How many examples of each class (0-9)."""
    return torch.bincount(labels, minlength=10).tolist()
