"""Common mistakes that used to end in a raw error from deep inside: each gets a lamploop error
that says what was wrong and where (type and message checked)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import lamploop
from lamploop.batches import BatchContext
from lamploop.checkpoint import load_checkpoint
from lamploop.errors import BatchError, CheckpointError, ConfigurationError

torch.manual_seed(0)
X, Y = torch.randn(24, 4), torch.randint(0, 3, (24,))


def _module() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _fit(**changes: Any) -> lamploop.LoopState | None:
    kwargs: dict[str, Any] = {
        "model": lamploop.SupervisedModel(_module()),
        "optimizer_factory": lambda params: torch.optim.SGD(params, lr=0.1),
        "train_batches": lamploop.tensor_batches(X, Y, batch_size=8),
        "max_epochs": 2,
        "reporters": [],
    }
    kwargs.update(changes)
    return lamploop.fit(**kwargs)


def test_a_loss_that_returns_a_mean() -> None:
    model = lamploop.SupervisedModel(_module(), loss=F.cross_entropy)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError) as info:
        _fit(model=model)
    assert str(info.value).startswith(
        "SupervisedModel: the loss cross_entropy returned a tensor of shape (), not (loss sum, example count)"
    )
    assert "lamploop.summed(F.mse_loss)" in str(info.value)


def test_a_factory_of_plain_iterables() -> None:
    def plain(context: BatchContext) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield X[:8], Y[:8]

    with pytest.raises(ConfigurationError) as info:
        _fit(train_batches=plain)
    assert str(info.value).startswith(
        "the batch stream that train_batches(epoch 0, rank 0 of 1) returned is a generator, "
        "not an async iterable of batches"
    )
    assert "lamploop.iterable_batches(" in str(info.value)
    state = _fit(train_batches=lamploop.iterable_batches(plain))  # what the message says to do
    assert state is not None


def test_a_validation_factory_that_returns_a_list_is_named() -> None:
    with pytest.raises(ConfigurationError) as info:
        _fit(validation_batches=lambda context: [(X[:8], Y[:8])])
    assert str(info.value).startswith(
        "the batch stream that validation_batches(epoch 0, rank 0 of 1) returned is a list"
    )


def test_a_target_of_the_wrong_dtype_names_epoch_and_batch() -> None:
    with pytest.raises(BatchError) as info:
        _fit(train_batches=lamploop.tensor_batches(X, Y.float(), batch_size=8))
    text = str(info.value)
    assert text.startswith("epoch 0, batch 0: the model or its loss failed: RuntimeError: ")
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("factor", [float("nan"), float("inf"), None])
def test_a_schedule_giving_a_non_finite_factor(factor: Any) -> None:
    class Broken:
        def init(self) -> None:
            return None

        def learning_rate_factor(self, state: None, epoch: int, last_validation_loss: float | None) -> Any:
            return None, (1.0 if epoch == 0 else factor)

    with pytest.raises(ConfigurationError) as info:
        _fit(learning_rate_schedule=Broken())
    assert f"the learning-rate schedule Broken gave the factor {factor!r} for epoch 1" in str(info.value)


def test_resuming_with_another_optimizer_class(tmp_path: Path) -> None:
    adam = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731
    _fit(optimizer_factory=adam, max_epochs=1, checkpoint_dir=tmp_path)
    with pytest.raises(CheckpointError) as info:
        _fit(
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            checkpoint_dir=tmp_path,
        )
    text = str(info.value)
    assert (
        "the saved optimizer state is not a SGD's: its parameter group 0 lacks ['dampening', 'momentum']"
        in text
    )
    assert "'betas'" in text
    assert "resume=False" in text
    assert _fit(optimizer_factory=adam, checkpoint_dir=tmp_path) is not None  # the right one resumes


def test_a_compiled_module_checkpoints_with_plain_keys(tmp_path: Path) -> None:
    compiled = torch.compile(_module(), backend="eager")
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())  # what torch.compile does
    _fit(model=lamploop.SupervisedModel(compiled), max_epochs=1, checkpoint_dir=tmp_path)
    checkpoint = load_checkpoint(tmp_path, model=_module())  # fits the uncompiled module
    assert sorted(checkpoint.state.model) == sorted(_module().state_dict())
    # and the run resumes into a compiled module again, or an uncompiled one
    again = torch.compile(_module(), backend="eager")
    state = _fit(model=lamploop.SupervisedModel(again), max_epochs=2, checkpoint_dir=tmp_path)
    assert state is not None
    assert state.epoch == 2


def test_a_metric_that_returns_a_mean() -> None:
    def mean_accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (output.argmax(dim=1) == target).float().mean()

    model = lamploop.SupervisedModel(_module(), metrics={"accuracy": mean_accuracy})  # type: ignore[dict-item]
    with pytest.raises(ConfigurationError) as info:
        _fit(model=model)
    assert str(info.value).startswith(
        "SupervisedModel: the metric 'accuracy' returned a tensor of shape (), not (sum, count)"
    )
    assert "lamploop.metrics.accuracy" in str(info.value)


def test_a_regression_output_of_shape_n_1_against_targets_of_shape_n() -> None:
    torch.manual_seed(2)
    module = torch.nn.Linear(4, 1)
    model = lamploop.SupervisedModel(module, loss=lamploop.mse_loss)
    targets = torch.randn(24)
    with pytest.raises(ConfigurationError) as info:
        _fit(model=model, train_batches=lamploop.tensor_batches(X, targets, batch_size=8))
    message = str(info.value)
    assert message.startswith(
        "SupervisedModel: the loss mse_loss got an output of shape (8, 1) and a target of shape (8,)"
    )
    assert "module(x).squeeze(-1)" in message
    # The same model with targets of the output's shape trains.
    state = _fit(model=model, train_batches=lamploop.tensor_batches(X, targets[:, None], batch_size=8))
    assert state is not None
    assert state.epoch == 2


@pytest.mark.parametrize(
    ("factory", "problem"),
    [
        (lambda params: None, "optimizer_factory returned None (a forgotten return?)"),
        (lambda params: list(params), "optimizer_factory returned a list, not a torch.optim.Optimizer"),
    ],
    ids=["returns-none", "returns-the-parameters"],
)
def test_an_optimizer_factory_that_returns_no_optimizer(factory: Any, problem: str) -> None:
    module = _module()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ConfigurationError) as info:
        _fit(model=lamploop.SupervisedModel(module), optimizer_factory=factory)
    assert str(info.value).startswith(f"rank 0: {problem}; return the optimizer it makes")
    assert "lambda params: torch.optim.SGD(params, lr=0.1)" in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))  # nothing trained


def test_an_optimizer_factory_without_an_argument_is_refused_before_anything_starts() -> None:
    def factory() -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

    with pytest.raises(ConfigurationError) as info:
        _fit(optimizer_factory=factory, world_size=2)
    assert str(info.value).startswith("fit: optimizer_factory must take the parameters as its one argument")


def test_a_function_as_a_reporter_is_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigurationError) as info:
        _fit(reporters=[print])
    assert str(info.value).startswith(
        "fit: reporters[0] (<built-in function print>) has no report(event) method"
    )
    assert "lamploop.reporting.LoggingReporter()" in str(info.value)


def test_early_stopping_without_validation_batches_is_refused() -> None:
    with pytest.raises(ConfigurationError) as info:
        _fit(early_stopping_patience=2)
    assert str(info.value) == (
        "fit: early_stopping_patience=2 needs validation_batches: it counts validations without a new "
        "best model, and there would be none"
    )


def test_the_default_device_is_auto_and_trains_where_torch_can() -> None:
    """``device="auto"`` is the default: CUDA where there is some (tests/test_cuda.py), else here the CPU."""
    import inspect

    assert inspect.signature(lamploop.fit).parameters["device"].default == "auto"
    module = _module()
    seen: list[torch.device] = []
    state = _fit(
        model=lamploop.SupervisedModel(module),
        on_epoch=lambda _: seen.append(next(module.parameters()).device),
    )
    assert state is not None
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert [d.type for d in seen] == [expected, expected]
