"""The common mistakes with ``fit``'s arguments get a ConfigurationError naming the argument and the fix,
before anything starts (no process spawned, no epoch begun)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import lamploop
from lamploop.errors import ConfigurationError

X, Y = torch.randn(32, 4, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 2
BATCHES = lamploop.tensor_batches(X, Y, batch_size=8)


def _fit(**changes: Any) -> None:
    arguments: dict[str, Any] = {
        "model": lamploop.SupervisedModel(torch.nn.Linear(4, 2)),
        "optimizer_factory": lambda params: torch.optim.SGD(params, lr=0.1),
        "train_batches": BATCHES,
        "validation_batches": BATCHES,
        "max_epochs": 1,
    }
    lamploop.fit(**{**arguments, **changes})


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        pytest.param(
            {"model": torch.nn.Linear(4, 2)},
            "fit: model is a torch.nn.Module (Linear); wrap it with its loss: "
            "lamploop.SupervisedModel(module)",
            id="module-as-model",
        ),
        pytest.param(
            {"model": "resnet"},
            "fit: model must be a lamploop.SupervisedModel, got str",
            id="string-as-model",
        ),
        pytest.param(
            {"optimizer_factory": torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)},
            "fit: optimizer_factory is an optimizer (SGD); "
            "pass a function that makes one from the parameters",
            id="optimizer-as-factory",
        ),
        pytest.param(
            {"optimizer_factory": 0.1},
            "fit: optimizer_factory must be a function of the parameters, got float",
            id="number-as-factory",
        ),
        pytest.param(
            {"train_batches": X},
            "fit: train_batches must be a batch factory (called once per epoch with the batch context), "
            "got Tensor; make one with lamploop.tensor_batches(features, targets, batch_size=...)",
            id="tensor-as-batches",
        ),
        pytest.param(
            {"validation_batches": [(X, Y)]},
            "fit: validation_batches must be a batch factory",
            id="list-as-batches",
        ),
        pytest.param(
            {"train_batches": torch.utils.data.DataLoader(list(zip(X, Y, strict=True)), batch_size=8)},
            "got DataLoader; make one with lamploop.dataloader_batches(train_batches_loader)",
            id="dataloader-as-batches",
        ),
        pytest.param(
            {"checkpoint_every_n_steps": 10},
            "fit: checkpoint_every_n_steps asks for checkpoints inside epochs, but checkpoint_dir is None",
            id="step-checkpoints-without-a-directory",
        ),
    ],
)
def test_a_common_mistake_is_named_before_training_starts(changes: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        _fit(**changes)
    assert expected in str(caught.value)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        pytest.param(
            {"world_size": 0}, "fit: world_size must be None or an int >= 1, got 0", id="world-size-0"
        ),
        pytest.param({"device": "gpu"}, "fit: device 'gpu' is not a device torch knows", id="unknown-device"),
        # torch's NotImplementedError("Cannot copy out of meta tensor") came from deep inside
        pytest.param(
            {"device": torch.device("meta")},
            "fit: device='meta' holds no data (shapes only): training needs a device that computes",
            id="meta",
        ),
        pytest.param(
            {"device": "cuda:64"},
            "fit: device='cuda:64', but "
            + ("this machine has" if torch.cuda.is_available() else "CUDA is not available here"),
            id="cuda-index-past-the-last",
        ),
    ],
)
def test_a_bad_place_is_named(changes: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        _fit(**changes)
    assert expected in str(caught.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here: device='cuda' is right")
def test_cuda_without_cuda_is_named() -> None:
    with pytest.raises(ConfigurationError, match="fit: device='cuda', but CUDA is not available here"):
        _fit(device="cuda")


def test_the_right_arguments_train() -> None:
    _fit()  # the baseline of the mistakes above: no error
    _fit(validation_batches=None)  # no validation is not a mistake


@pytest.mark.skipif(
    getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
    reason="MPS is available here: device='mps' is right",
)
def test_a_backend_this_torch_lacks_is_named() -> None:
    """torch's RuntimeError ("PyTorch is not linked with support for mps devices") came from
    deep inside, at the model's move (a hostile user's round 8)."""
    with pytest.raises(ConfigurationError, match=r"fit: device='mps' cannot be used here \(torch "):
        _fit(device="mps")
