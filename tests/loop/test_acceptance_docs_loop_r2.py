"""Acceptance tests of the single-process loop API, written from the docs alone.

Sources: DESIGN.md §2-3, docs/loop.md, docs/concepts/loop-state.md, docs/concepts/batch-streams.md,
docs/how-to/custom-batch-streams.md, docs/training.md and the public docstrings. Every reference
(training loop, smoothing, best epoch) is written here by hand, in float64.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import attrs
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lamploop
from lamploop import BatchContext
from lamploop.errors import (
    BatchError,
    ConfigurationError,
    LamploopError,
    NonFiniteLossError,
)
from lamploop.state import converter

Batch = tuple[torch.Tensor, torch.Tensor]

# ---------------------------------------------------------------------------------------------
# helpers: data, streams and a plain-torch float64 reference
# ---------------------------------------------------------------------------------------------


def classification_data(n: int = 40, d: int = 3, classes: int = 3, seed: int = 0) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=generator, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=generator)
    return x, y


def linear64(d: int = 3, out: int = 3, seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(d, out).double()


def stream_of(batches: Sequence[Batch]) -> Any:
    async def stream():
        for batch in batches:
            yield batch

    return stream()


def factory_of(per_epoch: Callable[[int], Sequence[Batch]]) -> lamploop.BatchStreamFactory:
    def factory(context: BatchContext) -> lamploop.BatchStream:
        return stream_of(per_epoch(context.epoch))

    return factory


def collect(stream: Any) -> list[Batch]:
    async def run() -> list[Batch]:
        return [batch async for batch in stream]

    return anyio.run(run)


def split(x: torch.Tensor, y: torch.Tensor, sizes: Sequence[int]) -> list[Batch]:
    out, start = [], 0
    for size in sizes:
        out.append((x[start : start + size], y[start : start + size]))
        start += size
    assert start == len(y)
    return out


def ce_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output, target, reduction="sum")


def reference_epoch(
    module: torch.nn.Module,
    batches: Sequence[Batch],
    lr: float,
    accumulate: int = 1,
    loss_sum: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = ce_sum,
) -> float:
    """Plain SGD, documented semantics: a step's gradient is (sum of its examples' losses) /
    (number of its examples); an epoch ending mid-group still steps; the epoch's loss is the
    sum of every example's loss (at the parameters it was computed with) / the example count."""
    total, count = 0.0, 0
    for start in range(0, len(batches), accumulate):
        group = batches[start : start + accumulate]
        module.zero_grad()
        sums = [loss_sum(module(x), y) for x, y in group]
        n = sum(len(y) for _, y in group)
        (sum(sums) / n).backward()
        with torch.no_grad():
            for p in module.parameters():
                p -= lr * p.grad
        total += float(sum(s.detach() for s in sums))
        count += n
    return total / count


def reference_eval(module: torch.nn.Module, batches: Sequence[Batch], loss_sum=ce_sum) -> float:
    with torch.no_grad():
        return float(sum(loss_sum(module(x), y) for x, y in batches)) / sum(len(y) for _, y in batches)


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def assert_params_close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-12) -> None:
    assert len(a) == len(b)
    for pa, pb in zip(a, b, strict=True):
        assert torch.allclose(pa, pb, rtol=0, atol=tol), (pa - pb).abs().max()


def sgd(lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda parameters: torch.optim.SGD(parameters, lr=lr)


def train_one_epoch(module: torch.nn.Module, batches: Sequence[Batch], lr: float, **kwargs: Any) -> float:
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    model = kwargs.pop("model", None) or lamploop.SupervisedModel(module, lamploop.cross_entropy_loss)
    return anyio.run(
        lambda: lamploop.one_epoch(
            model=model, batches=stream_of(batches), step_optimizer=optimizer.step, **kwargs
        )
    )


# ---------------------------------------------------------------------------------------------
# LoopState and friends
# ---------------------------------------------------------------------------------------------


def test_loop_state_defaults_frozen_and_json_round_trip() -> None:
    fresh = lamploop.LoopState()
    assert (
        fresh.epoch,
        fresh.last_validation_loss,
        fresh.min_validation_loss,
        fresh.min_validation_epoch,
    ) == (
        0,
        None,
        None,
        None,
    )
    assert tuple(fresh.learning_curve) == ()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        fresh.epoch = 3  # type: ignore[misc]
    state = lamploop.LoopState(
        epoch=3,
        last_validation_loss=0.25,
        min_validation_loss=0.2,
        min_validation_epoch=1,
        learning_curve=[
            lamploop.LearningCurveEntry(0, 0.9, (0.5, 0.5)),
            lamploop.LearningCurveEntry(1, 0.7, (0.2, 0.1)),
            lamploop.LearningCurveEntry(2, 0.6, None),
        ],
    )
    text = json.dumps(converter.unstructure(state))
    back = converter.structure(json.loads(text), lamploop.LoopState)
    assert back == state
    assert back.learning_curve[2].validation_loss is None
    assert back.learning_curve[1].validation_loss == (0.2, 0.1)


def test_learning_rate_factor_is_left_out_of_equality() -> None:
    a = lamploop.LearningCurveEntry(0, 0.5, None, learning_rate_factor=1.0)
    b = lamploop.LearningCurveEntry(0, 0.5, None, learning_rate_factor=0.25)
    assert a == b
    assert a != lamploop.LearningCurveEntry(0, 0.5, (0.1, 0.1))


def test_loop_state_with_model_best_model_defaults_empty() -> None:
    module = torch.nn.Linear(2, 2)
    data = lamploop.LoopStateWithModelAndOptimizerData(
        loop_state=lamploop.LoopState(),
        model=module.state_dict(),
        optimizer=torch.optim.SGD(module.parameters(), lr=0.1).state_dict(),
    )
    assert len(data.best_model) == 0
    assert data.loop_state == lamploop.LoopState()
    assert set(data.model) == {"weight", "bias"}


# ---------------------------------------------------------------------------------------------
# epochs: the driver between epochs, with effects of our own
# ---------------------------------------------------------------------------------------------


class TableEffects:
    def __init__(self, training: Sequence[float], validation: Sequence[float], epoch: int = 0) -> None:
        self.training, self.validation = training, validation
        self.epoch = epoch
        self.trained: list[int] = []
        self.validated: list[int] = []
        self.lr_factors: list[float] = []
        self.saved_at: list[int] = []
        self.checkpoints: list[tuple[lamploop.LoopState, Any]] = []

    async def train_epoch(self, factor: float) -> float:
        self.trained.append(self.epoch)
        self.lr_factors.append(factor)
        return self.training[self.epoch]

    async def validation_epoch(self) -> float:
        self.validated.append(self.epoch)
        return self.validation[self.epoch]

    async def save_best(self) -> None:
        self.saved_at.append(self.epoch)

    async def checkpoint_state(self, state: lamploop.LoopState, schedule_state: Any) -> None:
        self.checkpoints.append((state, schedule_state))
        self.epoch = state.epoch


def run_epochs(effects: TableEffects, **kwargs: Any) -> lamploop.LoopState:
    kwargs.setdefault("max_epochs", len(effects.training))
    kwargs.setdefault("validation_epoch", effects.validation_epoch)
    return anyio.run(
        lambda: lamploop.epochs(
            train_epoch=effects.train_epoch,
            save_min_validation_loss_model=effects.save_best,
            checkpoint_state=effects.checkpoint_state,
            **kwargs,
        )
    )


def hand_smoothing(raw: Sequence[float | None], a: float) -> list[tuple[float, float] | None]:
    out: list[tuple[float, float] | None] = []
    previous = None
    for value in raw:
        if value is None:
            out.append(None)
            continue
        smoothed = value if previous is None else value * a + previous * (1 - a)
        out.append((smoothed, value))
        previous = smoothed
    return out


def test_epochs_smoothing_frequency_eligibility_and_carry_over() -> None:
    training = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.35]
    validation = [1.0, 9.0, 0.4, 9.0, 0.6, 9.0, 0.1]
    a, frequency, eligible = 0.3, 2, {0, 4, 5, 6}
    effects = TableEffects(training, validation)
    state = run_epochs(
        effects,
        validation_frequency=frequency,
        return_min_validation_loss_model=eligible,
        validation_loss_exponential_smoothing_factor=a,
    )
    raw = [v if e % frequency == 0 else None for e, v in enumerate(validation)]
    expected = hand_smoothing(raw, a)
    assert effects.validated == [0, 2, 4, 6]
    assert [entry.epoch for entry in state.learning_curve] == list(range(7))
    assert [entry.training_loss for entry in state.learning_curve] == training
    for entry, want in zip(state.learning_curve, expected, strict=True):
        if want is None:
            assert entry.validation_loss is None
        else:
            assert entry.validation_loss == pytest.approx(want, abs=1e-15)
    # best by hand: eligible, validated epochs, strict improvement
    best, best_epoch, saved = math.inf, None, []
    for e, value in enumerate(expected):
        if value is not None and e in eligible and value[0] < best:
            best, best_epoch = value[0], e
            saved.append(e)
    assert effects.saved_at == saved
    assert state.min_validation_epoch == best_epoch
    assert state.min_validation_loss == pytest.approx(best, abs=1e-15)
    assert state.last_validation_loss == pytest.approx(expected[6][0], abs=1e-15)
    assert state.epoch == 7
    # the checkpoints: LoopState(e + 1, ...) after every epoch, with the smoothed loss carried
    assert [s.epoch for s, _ in effects.checkpoints] == list(range(1, 8))
    after_epoch_1 = effects.checkpoints[1][0]
    assert after_epoch_1.last_validation_loss == pytest.approx(expected[0][0])
    assert len(after_epoch_1.learning_curve) == 2


def test_epochs_strict_improvement_ties_keep_the_earlier_epoch() -> None:
    effects = TableEffects([1.0] * 4, [0.5, 0.5, 0.4, 0.4])
    state = run_epochs(effects, return_min_validation_loss_model=lamploop.ALL_EPOCHS)
    assert effects.saved_at == [0, 2]
    assert (state.min_validation_epoch, state.min_validation_loss) == (2, 0.4)


def test_epochs_default_eligibility_is_none() -> None:
    effects = TableEffects([1.0] * 3, [0.5, 0.4, 0.3])
    state = run_epochs(effects)
    assert effects.saved_at == []
    assert state.min_validation_epoch is None
    assert state.min_validation_loss is None
    assert state.last_validation_loss == 0.3


def test_epochs_schedule_asked_before_each_epoch_and_resume_is_exact() -> None:
    validation = [1.0, 0.5, 0.75, 0.5, 1.0, 0.75, 0.7]
    kwargs = {
        "return_min_validation_loss_model": lamploop.ALL_EPOCHS,
        "learning_rate_schedule": lamploop.reduce_lr_on_plateau(patience=0, reduce_factor=0.5),
        "validation_loss_exponential_smoothing_factor": 0.5,
    }
    full = TableEffects([0.1] * 7, validation)
    final = run_epochs(full, **kwargs)
    for k in (1, 3, 5):
        state, schedule_state = full.checkpoints[k - 1]
        again = TableEffects([0.1] * 7, validation, epoch=k)
        resumed = run_epochs(
            again, init_state=state, learning_rate_schedule_init_state=schedule_state, **kwargs
        )
        assert resumed == final
        assert again.lr_factors == full.lr_factors[k:]
    assert [e.learning_rate_factor for e in final.learning_curve] == full.lr_factors


def test_epochs_factor_zero_stops_before_that_epoch() -> None:
    effects = TableEffects([1.0] * 6, [1.0] * 6)
    state = run_epochs(
        effects, learning_rate_schedule=lamploop.from_epoch_count(lambda e: 1.0 if e < 2 else 0.0)
    )
    assert effects.trained == [0, 1]
    assert state.epoch == 2
    assert len(state.learning_curve) == 2


def test_epochs_max_epochs_counts_epochs_already_in_init_state() -> None:
    effects = TableEffects([1.0] * 5, [1.0] * 5, epoch=3)
    init = lamploop.LoopState(
        epoch=3, learning_curve=tuple(lamploop.LearningCurveEntry(e, 1.0, None) for e in range(3))
    )
    state = run_epochs(effects, max_epochs=5, init_state=init, validation_epoch=None)
    assert effects.trained == [3, 4]
    assert state.epoch == 5
    assert [e.epoch for e in state.learning_curve] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("patience", "expected_epochs"),
    [(1, 3), (2, 4), (3, 5)],
)
def test_epochs_early_stopping_counts_every_validation(patience: int, expected_epochs: int) -> None:
    # best 0.5 at epoch 1; epoch 2 worse, epoch 3 a tie (no new best), epoch 4 worse, epoch 5 better
    validation = [1.0, 0.5, 0.75, 0.5, 1.0, 0.1, 0.2, 0.3]
    effects = TableEffects([1.0] * 8, validation)
    # eligibility is irrelevant for the count: nothing is eligible here
    state = run_epochs(effects, early_stopping_patience=patience, return_min_validation_loss_model=())
    assert state.epoch == expected_epochs
    assert effects.trained == list(range(expected_epochs))


def test_epochs_non_finite_training_or_validation_loss_names_the_epoch() -> None:
    for training, validation in [
        ([1.0, float("nan"), 1.0], [1.0] * 3),
        ([1.0] * 3, [1.0, 1.0, float("inf")]),
    ]:
        effects = TableEffects(training, validation)
        with pytest.raises(NonFiniteLossError) as caught:
            run_epochs(effects)
        bad = 1 if math.isnan(training[1]) else 2
        assert caught.value.epoch == bad
        assert f"epoch {bad}" in str(caught.value)


@pytest.mark.parametrize(
    "bad",
    [
        {"validation_frequency": 0},
        {"max_epochs": -1},
        {"max_epochs": "3"},
        {"validation_loss_exponential_smoothing_factor": 1.5},
        {"validation_loss_exponential_smoothing_factor": float("nan")},
        {"init_state": {"epoch": 0}},
        {"early_stopping_patience": 0},
        {"train_epoch": "not callable"},
        {"learning_rate_schedule": lamploop.reduce_lr_on_plateau(), "validation_epoch": None},
    ],
    ids=lambda bad: ",".join(bad),
)
def test_epochs_bad_arguments_are_configuration_errors_before_training(bad: dict[str, Any]) -> None:
    effects = TableEffects([1.0] * 3, [1.0] * 3)
    kwargs: dict[str, Any] = {
        "max_epochs": 3,
        "train_epoch": effects.train_epoch,
        "validation_epoch": effects.validation_epoch,
        "save_min_validation_loss_model": effects.save_best,
    }
    kwargs.update(bad)
    with pytest.raises(ConfigurationError):
        anyio.run(lambda: lamploop.epochs(**kwargs))
    assert effects.trained == []


def test_epochs_train_epoch_returning_no_number_is_a_configuration_error() -> None:
    async def train_epoch(factor: float) -> Any:
        return "0.5"

    async def save() -> None:
        pass

    with pytest.raises(ConfigurationError):
        anyio.run(
            lambda: lamploop.epochs(
                max_epochs=2,
                train_epoch=train_epoch,
                validation_epoch=None,
                save_min_validation_loss_model=save,
            )
        )


# ---------------------------------------------------------------------------------------------
# one_epoch against plain torch in float64
# ---------------------------------------------------------------------------------------------


SIZES = [5, 3, 7, 4, 6, 2, 8, 5]  # 40 examples, uneven batches


@pytest.mark.parametrize("accumulate", [1, 2, 3, 8, 20])
def test_one_epoch_equals_float64_reference(accumulate: int) -> None:
    x, y = classification_data()
    batches = split(x, y, SIZES)
    module, reference = linear64(), linear64()
    loss = train_one_epoch(module, batches, lr=0.3, accumulate_gradient_over_n_batches=accumulate)
    expected = reference_epoch(reference, batches, lr=0.3, accumulate=accumulate)
    assert loss == pytest.approx(expected, abs=1e-13)
    assert_params_close(params(module), params(reference))


def test_accumulation_equals_one_big_batch() -> None:
    x, y = classification_data(n=48)
    small = split(x, y, [4] * 12)
    big = split(x, y, [12] * 4)
    accumulated, single = linear64(), linear64()
    loss_accumulated = train_one_epoch(accumulated, small, lr=0.5, accumulate_gradient_over_n_batches=3)
    loss_single = train_one_epoch(single, big, lr=0.5)
    assert loss_accumulated == pytest.approx(loss_single, abs=1e-14)
    assert_params_close(params(accumulated), params(single), tol=1e-14)


def test_one_epoch_steps_once_per_group_and_at_a_partial_end() -> None:
    x, y = classification_data()
    batches = split(x, y, SIZES)  # 8 batches
    module = linear64()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    steps = []
    model = lamploop.SupervisedModel(module)
    anyio.run(
        lambda: lamploop.one_epoch(
            model=model,
            batches=stream_of(batches),
            step_optimizer=lambda: (steps.append(1), optimizer.step()),
            accumulate_gradient_over_n_batches=3,
        )
    )
    assert len(steps) == 3  # groups of 3, 3, 2


def test_one_epoch_mse_and_summed_losses() -> None:
    torch.manual_seed(3)
    x = torch.randn(30, 4, dtype=torch.float64)
    y = x @ torch.randn(4, 1, dtype=torch.float64) + 0.1
    batches = split(x, y, [7, 8, 9, 6])
    for loss_fn, reference_sum in [
        (lamploop.mse_loss, lambda o, t: torch.nn.functional.mse_loss(o, t, reduction="sum")),
        (lamploop.summed(torch.nn.functional.l1_loss), lambda o, t: (o - t).abs().sum()),
    ]:
        module, reference = linear64(4, 1), linear64(4, 1)
        model = lamploop.SupervisedModel(module, loss_fn)
        loss = train_one_epoch(module, batches, lr=0.05, model=model, accumulate_gradient_over_n_batches=2)
        expected = reference_epoch(reference, batches, lr=0.05, accumulate=2, loss_sum=reference_sum)
        assert loss == pytest.approx(expected, abs=1e-13)
        assert_params_close(params(module), params(reference))


def test_one_epoch_forward_only_is_eval_mode_no_step_and_exact_mean() -> None:
    x, y = classification_data()
    batches = split(x, y, SIZES)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3)).double()
    module.train()
    before = params(module)
    loss = anyio.run(
        lambda: lamploop.one_epoch(
            model=lamploop.SupervisedModel(module), batches=stream_of(batches), forward_only=True
        )
    )
    module.eval()
    assert loss == pytest.approx(reference_eval(module, batches), abs=1e-13)
    assert_params_close(params(module), before, tol=0)
    assert all(p.grad is None or not p.grad.abs().any() for p in module.parameters())


def test_one_epoch_training_without_step_optimizer_is_a_configuration_error() -> None:
    x, y = classification_data()
    with pytest.raises(ConfigurationError):
        anyio.run(
            lambda: lamploop.one_epoch(
                model=lamploop.SupervisedModel(linear64()), batches=stream_of(split(x, y, [40]))
            )
        )


@pytest.mark.parametrize(
    "bad",
    [
        {"accumulate_gradient_over_n_batches": 0},
        {"accumulate_gradient_over_n_batches": 1.5},
        {"on_non_finite_loss": "ignore"},
        {"precision": "fp64"},
        {"max_gradient_norm": -1.0},
    ],
    ids=lambda bad: f"{next(iter(bad))}={next(iter(bad.values()))}",
)
def test_one_epoch_bad_arguments(bad: dict[str, Any]) -> None:
    x, y = classification_data()
    module = linear64()
    before = params(module)
    with pytest.raises(ConfigurationError):
        train_one_epoch(module, split(x, y, [20, 20]), lr=0.1, **bad)
    assert_params_close(params(module), before, tol=0)


def test_one_epoch_model_not_a_supervised_model() -> None:
    x, y = classification_data()
    module = linear64()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(ConfigurationError):
        anyio.run(
            lambda: lamploop.one_epoch(
                model=module, batches=stream_of(split(x, y, [40])), step_optimizer=optimizer.step
            )
        )


def test_one_epoch_plain_list_as_batches_is_a_configuration_error() -> None:
    x, y = classification_data()
    module = linear64()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(ConfigurationError):
        anyio.run(
            lambda: lamploop.one_epoch(
                model=lamploop.SupervisedModel(module),
                batches=split(x, y, [40]),
                step_optimizer=optimizer.step,
            )
        )


# --- bad batches --------------------------------------------------------------------------


def bad_batch_cases() -> list[tuple[str, Any]]:
    x, y = classification_data()
    return [
        ("empty", (x[:0], y[:0])),
        ("sizes differ", (x[:4], y[:3])),
        ("not a pair", (x[:4], y[:4], y[:4])),
        ("not a tuple", x[:4]),
        ("wrong feature width", (torch.randn(4, 5, dtype=torch.float64), y[:4])),
        ("wrong target dtype", (x[:4], y[:4].double())),
    ]


@pytest.mark.parametrize(("name", "bad"), bad_batch_cases(), ids=[name for name, _ in bad_batch_cases()])
@pytest.mark.parametrize("forward_only", [False, True])
def test_bad_batch_is_a_batch_error_naming_epoch_and_batch(name: str, bad: Any, forward_only: bool) -> None:
    x, y = classification_data()
    batches = [*split(x[:20], y[:20], [10, 10]), bad, (x[20:], y[20:])]
    module = linear64()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(BatchError) as caught:
        anyio.run(
            lambda: lamploop.one_epoch(
                model=lamploop.SupervisedModel(module),
                batches=stream_of(batches),
                step_optimizer=None if forward_only else optimizer.step,
                forward_only=forward_only,
                epoch=4,
            )
        )
    message = str(caught.value)
    assert "epoch 4" in message, message
    assert "batch 2" in message, message
    if name.startswith("wrong"):
        assert caught.value.__cause__ is not None  # torch's own error kept as the cause


@pytest.mark.parametrize("forward_only", [False, True])
def test_empty_stream_is_a_batch_error(forward_only: bool) -> None:
    module = linear64()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(BatchError) as caught:
        anyio.run(
            lambda: lamploop.one_epoch(
                model=lamploop.SupervisedModel(module),
                batches=stream_of([]),
                step_optimizer=None if forward_only else optimizer.step,
                forward_only=forward_only,
                epoch=1,
            )
        )
    assert "epoch 1" in str(caught.value)


def test_loss_returning_a_mean_is_a_configuration_error_naming_the_shape() -> None:
    x, y = classification_data()
    model = lamploop.SupervisedModel(linear64(), torch.nn.functional.cross_entropy)
    with pytest.raises(ConfigurationError) as caught:
        train_one_epoch(model.module, split(x, y, [20, 20]), lr=0.1, model=model)
    assert "()" in str(caught.value)
    assert "summed" in str(caught.value)


def test_supervised_model_rejects_a_non_module_and_a_non_callable_loss() -> None:
    with pytest.raises(ConfigurationError):
        lamploop.SupervisedModel(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        lamploop.SupervisedModel(torch.nn.Linear(2, 2), "cross_entropy")  # type: ignore[arg-type]


# --- non-finite losses ---------------------------------------------------------------------


def nan_batches() -> list[Batch]:
    x, y = classification_data(n=12)
    x = x.clone()
    x[7, 0] = float("nan")  # in batch 3 of 6 batches of 2
    return split(x, y, [2] * 6)


def test_non_finite_raise_is_caught_at_the_step_before_the_optimizer_steps() -> None:
    batches = nan_batches()
    module, reference = linear64(), linear64()
    with pytest.raises(NonFiniteLossError) as caught:
        train_one_epoch(module, batches, lr=0.2, epoch=2)
    error = caught.value
    assert (error.epoch, error.step, error.batch, tuple(error.ranks)) == (2, 3, 3, (0,))
    assert "epoch 2" in str(error)
    assert "step 3" in str(error)
    assert "batch 3" in str(error)
    reference_epoch(reference, batches[:3], lr=0.2)  # the three good steps only
    assert_params_close(params(module), params(reference))


def test_non_finite_raise_with_accumulation_names_the_optimizer_step() -> None:
    batches = nan_batches()
    module, reference = linear64(), linear64()
    with pytest.raises(NonFiniteLossError) as caught:
        train_one_epoch(module, batches, lr=0.2, epoch=0, accumulate_gradient_over_n_batches=2)
    assert (caught.value.step, caught.value.batch) == (1, 3)
    reference_epoch(reference, batches[:2], lr=0.2, accumulate=2)
    assert_params_close(params(module), params(reference))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_skip_step_equals_a_run_without_those_batches(
    accumulate: int, caplog: pytest.LogCaptureFixture
) -> None:
    batches = nan_batches()
    module, reference = linear64(), linear64()
    bad_group = 3 // accumulate
    with caplog.at_level(logging.WARNING):
        loss = train_one_epoch(
            module,
            batches,
            lr=0.2,
            epoch=0,
            on_non_finite_loss="skip_step",
            accumulate_gradient_over_n_batches=accumulate,
        )
    # "a warning with the same text" (docs/loop.md): here a logging warning
    texts = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(f"epoch 0, step {bad_group}" in t and "batch 3" in t for t in texts), texts
    kept = [b for i, b in enumerate(batches) if i // accumulate != bad_group]
    expected = reference_epoch(reference, kept, lr=0.2, accumulate=accumulate)
    assert loss == pytest.approx(expected, abs=1e-13)
    assert_params_close(params(module), params(reference))
    assert all(bool(torch.isfinite(p).all()) for p in module.parameters())


def test_infinite_loss_is_caught_too() -> None:
    x = torch.randn(8, 2, dtype=torch.float64)
    y = torch.zeros(8, 1, dtype=torch.float64)
    y[5, 0] = float("inf")
    module = linear64(2, 1)
    model = lamploop.SupervisedModel(module, lamploop.mse_loss)
    with pytest.raises(NonFiniteLossError) as caught:
        train_one_epoch(module, split(x, y, [4, 4]), lr=0.1, model=model, epoch=0)
    assert (caught.value.step, caught.value.batch) == (1, 1)


def test_skip_step_every_step_bad_raises() -> None:
    x, y = classification_data(n=8)
    x = torch.full_like(x, float("nan"))
    with pytest.raises(NonFiniteLossError):
        train_one_epoch(linear64(), split(x, y, [4, 4]), lr=0.1, on_non_finite_loss="skip_step", epoch=0)


def test_non_finite_validation_loss_always_raises() -> None:
    batches = nan_batches()
    with pytest.raises(NonFiniteLossError) as caught:
        anyio.run(
            lambda: lamploop.one_epoch(
                model=lamploop.SupervisedModel(linear64()),
                batches=stream_of(batches),
                forward_only=True,
                epoch=5,
                on_non_finite_loss="skip_step",
            )
        )
    assert caught.value.epoch == 5
    assert "epoch 5" in str(caught.value)


# --- precision -------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_precision_autocasts_forward_and_keeps_parameters_dtype(precision: str) -> None:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    module = torch.nn.Linear(4, 3)
    seen: list[torch.dtype] = []
    module.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    reference = copy.deepcopy(module)
    batches = split(x, y, [8] * 4)
    loss = train_one_epoch(module, batches, lr=0.1, precision=precision)
    assert seen
    assert all(d == dtype for d in seen)
    assert all(p.dtype == torch.float32 for p in module.parameters())
    expected = reference_epoch(reference, batches, lr=0.1)
    assert loss == pytest.approx(expected, rel=5e-2)
    assert_params_close(params(module), params(reference), tol=5e-2)
    valid = anyio.run(
        lambda: lamploop.one_epoch(
            model=lamploop.SupervisedModel(module),
            batches=stream_of(batches),
            forward_only=True,
            precision=precision,
        )
    )
    assert seen[-1] == dtype
    assert valid == pytest.approx(reference_eval(module, batches), rel=5e-2)


# ---------------------------------------------------------------------------------------------
# batch streams
# ---------------------------------------------------------------------------------------------


def targets_of(
    factory: lamploop.BatchStreamFactory, epoch: int = 0, rank: int = 0, nranks: int = 1
) -> list[list[int]]:
    return [t.tolist() for _, t in collect(factory(BatchContext(epoch=epoch, rank=rank, nranks=nranks)))]


def test_tensor_batches_order_sizes_purity_and_ranks() -> None:
    x, y = torch.arange(11.0).unsqueeze(1), torch.arange(11)
    factory = lamploop.tensor_batches(x, y, batch_size=3, seed=2)
    epoch0 = targets_of(factory, 0)
    assert [len(b) for b in epoch0] == [3, 3, 3, 2]
    assert sorted(functools.reduce(operator.iadd, epoch0, [])) == list(range(11))
    assert targets_of(factory, 0) == epoch0
    assert targets_of(factory, 1) != epoch0
    assert targets_of(lamploop.tensor_batches(x, y, batch_size=3, seed=3), 0) != epoch0
    assert targets_of(factory, 0, 1, 3) == epoch0[1::3]
    for features, target in collect(factory(BatchContext(epoch=0))):
        assert torch.equal(features.squeeze(1), target.float())
    ordered = lamploop.tensor_batches(x, y, batch_size=4, shuffle=False)
    assert targets_of(ordered, 3) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    dropped = lamploop.tensor_batches(x, y, batch_size=4, shuffle=False, drop_last=True)
    assert targets_of(dropped, 0) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ((torch.randn(5, 2), torch.arange(4)), {"batch_size": 2}),
        ((torch.randn(0, 2), torch.arange(0)), {"batch_size": 2}),
        (([[1.0], [2.0]], torch.arange(2)), {"batch_size": 2}),
        ((torch.tensor(1.0), torch.tensor(1)), {"batch_size": 1}),
        ((torch.randn(4, 2), torch.arange(4)), {"batch_size": 0}),
        ((torch.randn(4, 2), torch.arange(4)), {"batch_size": 2.0}),
        ((torch.randn(4, 2), torch.arange(4)), {"batch_size": 2, "seed": -1}),
        ((torch.randn(4, 2), torch.arange(4)), {"batch_size": 2, "shuffle": "yes"}),
        ((torch.randn(4, 2), torch.arange(4)), {"batch_size": 2, "drop_last": 1}),
    ],
    ids=[
        "lengths",
        "empty",
        "list",
        "scalar",
        "batch0",
        "batchfloat",
        "seedneg",
        "shufflestr",
        "droplastint",
    ],
)
def test_tensor_batches_bad_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        lamploop.tensor_batches(*args, **kwargs)


def test_batch_context_bad_values() -> None:
    for kwargs in [{"epoch": -1}, {"epoch": 0, "nranks": 0}, {"epoch": 0, "rank": 2, "nranks": 2}]:
        with pytest.raises(ConfigurationError):
            BatchContext(**kwargs)


def test_iterable_batches_adapts_a_plain_iterable_factory() -> None:
    x, y = classification_data()
    batches = split(x, y, SIZES)
    factory = lamploop.iterable_batches(lambda context: iter(batches[context.epoch :]))
    got = collect(factory(BatchContext(epoch=2)))
    assert len(got) == len(batches) - 2
    assert all(torch.equal(a[1], b[1]) for a, b in zip(got, batches[2:], strict=True))
    with pytest.raises(ConfigurationError):
        lamploop.iterable_batches(batches)  # type: ignore[arg-type]


def test_dataloader_batches_one_rank_seeded_every_example_once() -> None:
    data = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10))
    factory = lamploop.dataloader_batches(DataLoader(data, batch_size=3, shuffle=True), seed=7)
    epoch0 = targets_of(factory, 0)
    assert sorted(functools.reduce(operator.iadd, epoch0, [])) == list(range(10))
    assert [len(b) for b in epoch0] == [3, 3, 3, 1]
    torch.manual_seed(123)  # the global RNG must not matter
    assert targets_of(factory, 0) == epoch0
    epochs = [functools.reduce(operator.iadd, targets_of(factory, e), []) for e in range(1, 4)]
    assert any(order != functools.reduce(operator.iadd, epoch0, []) for order in epochs)
    shares = [functools.reduce(operator.iadd, targets_of(factory, 0, r, 3), []) for r in range(3)]
    assert sorted(functools.reduce(operator.iadd, shares, [])) == list(range(10))
    with pytest.raises(ConfigurationError):
        lamploop.dataloader_batches(data)  # type: ignore[arg-type]


def test_dataloader_batches_train_equals_reference() -> None:
    x, y = classification_data(n=24)
    factory = lamploop.dataloader_batches(DataLoader(TensorDataset(x, y), batch_size=5, shuffle=True), seed=1)
    batches = collect(factory(BatchContext(epoch=0)))
    module, reference = linear64(), linear64()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.3)
    loss = anyio.run(
        lambda: lamploop.one_epoch(
            model=lamploop.SupervisedModel(module),
            batches=factory(BatchContext(epoch=0)),
            step_optimizer=optimizer.step,
            accumulate_gradient_over_n_batches=2,
        )
    )
    assert loss == pytest.approx(reference_epoch(reference, batches, lr=0.3, accumulate=2), abs=1e-13)
    assert_params_close(params(module), params(reference))


# ---------------------------------------------------------------------------------------------
# fit, world_size=1
# ---------------------------------------------------------------------------------------------


def fit(**kwargs: Any) -> lamploop.LoopState:
    kwargs.setdefault("reporters", [])
    kwargs.setdefault("world_size", 1)
    kwargs.setdefault("device", "cpu")
    state = lamploop.fit(**kwargs)
    assert state is not None
    return state


def reference_fit(
    module: torch.nn.Module,
    train: lamploop.BatchStreamFactory,
    valid: lamploop.BatchStreamFactory | None,
    *,
    max_epochs: int,
    lr: float,
    accumulate: int = 1,
    a: float = 1.0,
    eligible: Callable[[int], bool] = lambda e: True,
) -> tuple[list[float], list[tuple[float, float] | None], int | None, float | None, dict[str, torch.Tensor]]:
    training, validation = [], []
    best, best_epoch, best_model, previous = math.inf, None, None, None
    for epoch in range(max_epochs):
        module.train()
        training.append(reference_epoch(module, collect(train(BatchContext(epoch=epoch))), lr, accumulate))
        if valid is None:
            validation.append(None)
            continue
        module.eval()
        raw = reference_eval(module, collect(valid(BatchContext(epoch=epoch))))
        smoothed = raw if previous is None else raw * a + previous * (1 - a)
        previous = smoothed
        validation.append((smoothed, raw))
        if eligible(epoch) and smoothed < best:
            best, best_epoch = smoothed, epoch
            best_model = copy.deepcopy(module.state_dict())
    return training, validation, best_epoch, (None if best_epoch is None else best), best_model


def test_fit_equals_float64_reference_with_smoothing_and_eligible_epochs() -> None:
    x, y = classification_data(n=60, seed=4)
    train = lamploop.tensor_batches(x[:44], y[:44], batch_size=6, seed=3)
    valid = lamploop.tensor_batches(x[44:], y[44:], batch_size=5, shuffle=False)
    eligible = {0, 1, 3}
    module, reference = linear64(), linear64()
    state = fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=sgd(0.4),
        train_batches=train,
        validation_batches=valid,
        max_epochs=5,
        accumulate_gradient_over_n_batches=2,
        validation_loss_exponential_smoothing_factor=0.6,
        return_min_validation_loss_model=eligible,
    )
    training, validation, best_epoch, best, best_model = reference_fit(
        reference, train, valid, max_epochs=5, lr=0.4, accumulate=2, a=0.6, eligible=lambda e: e in eligible
    )
    assert state.epoch == 5
    assert [e.epoch for e in state.learning_curve] == list(range(5))
    assert [e.training_loss for e in state.learning_curve] == pytest.approx(training, abs=1e-12)
    for entry, want in zip(state.learning_curve, validation, strict=True):
        assert entry.validation_loss == pytest.approx(want, abs=1e-12)
    assert state.min_validation_epoch == best_epoch
    assert state.min_validation_loss == pytest.approx(best, abs=1e-12)
    assert state.last_validation_loss == pytest.approx(validation[-1][0], abs=1e-12)
    # the module ends holding the best eligible epoch's weights
    assert best_model is not None
    for name, tensor in module.state_dict().items():
        assert torch.allclose(tensor, best_model[name], rtol=0, atol=1e-12), name


def test_fit_without_validation_keeps_the_last_model() -> None:
    x, y = classification_data(n=30)
    train = lamploop.tensor_batches(x, y, batch_size=7)
    module, reference = linear64(), linear64()
    state = fit(
        model=lamploop.SupervisedModel(module), optimizer_factory=sgd(0.2), train_batches=train, max_epochs=3
    )
    training, *_ = reference_fit(reference, train, None, max_epochs=3, lr=0.2)
    assert [e.training_loss for e in state.learning_curve] == pytest.approx(training, abs=1e-12)
    assert all(e.validation_loss is None for e in state.learning_curve)
    assert state.min_validation_epoch is None
    assert state.last_validation_loss is None
    assert_params_close(params(module), params(reference))


def test_fit_validation_frequency_carries_the_smoothed_loss_over() -> None:
    x, y = classification_data(n=40)
    train = lamploop.tensor_batches(x[:30], y[:30], batch_size=10)
    valid = lamploop.tensor_batches(x[30:], y[30:], batch_size=10, shuffle=False)
    state = fit(
        model=lamploop.SupervisedModel(linear64()),
        optimizer_factory=sgd(0.1),
        train_batches=train,
        validation_batches=valid,
        max_epochs=4,
        validation_frequency=3,
    )
    validated = [e.validation_loss is not None for e in state.learning_curve]
    assert validated == [True, False, False, True]
    assert state.last_validation_loss == state.learning_curve[3].validation_loss[0]


def test_fit_early_stopping_with_a_flat_validation_loss() -> None:
    x, y = classification_data(n=20)
    train = lamploop.tensor_batches(x[:12], y[:12], batch_size=4)
    valid = lamploop.tensor_batches(x[12:], y[12:], batch_size=4, shuffle=False)
    state = fit(
        model=lamploop.SupervisedModel(linear64()),
        optimizer_factory=sgd(0.0),  # nothing moves: no validation after the first is a new best
        train_batches=train,
        validation_batches=valid,
        max_epochs=10,
        early_stopping_patience=2,
    )
    assert state.epoch == 3
    assert state.min_validation_epoch == 0


def test_fit_schedule_factor_zero_stops_and_scales_the_rate() -> None:
    x, y = classification_data(n=20)
    train = lamploop.tensor_batches(x, y, batch_size=5)
    rates: list[float] = []

    def optimizer_factory(parameters: Any) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(parameters, lr=0.2)
        step = optimizer.step
        optimizer.step = lambda *a, **k: (rates.append(optimizer.param_groups[0]["lr"]), step())  # type: ignore[method-assign]
        return optimizer

    state = fit(
        model=lamploop.SupervisedModel(linear64()),
        optimizer_factory=optimizer_factory,
        train_batches=train,
        max_epochs=6,
        learning_rate_schedule=lamploop.from_epoch_count(lambda e: [1.0, 0.5, 0.25, 0.0][min(e, 3)]),
    )
    assert state.epoch == 3
    assert rates == pytest.approx([0.2] * 4 + [0.1] * 4 + [0.05] * 4)


def test_fit_non_finite_raise_and_skip_step() -> None:
    batches = nan_batches()
    train = factory_of(lambda epoch: batches)
    with pytest.raises(NonFiniteLossError) as caught:
        fit(
            model=lamploop.SupervisedModel(linear64()),
            optimizer_factory=sgd(0.1),
            train_batches=train,
            max_epochs=2,
        )
    assert (caught.value.epoch, caught.value.step) == (0, 3)
    module, reference = linear64(), linear64()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=sgd(0.1),
            train_batches=train,
            max_epochs=2,
            on_non_finite_loss="skip_step",
        )
    kept = batches[:3] + batches[4:]
    expected = [reference_epoch(reference, kept, 0.1) for _ in range(2)]
    assert [e.training_loss for e in state.learning_curve] == pytest.approx(expected, abs=1e-12)
    assert_params_close(params(module), params(reference))


def test_fit_empty_training_stream_is_a_batch_error() -> None:
    with pytest.raises(BatchError) as caught:
        fit(
            model=lamploop.SupervisedModel(linear64()),
            optimizer_factory=sgd(0.1),
            train_batches=factory_of(lambda epoch: []),
            max_epochs=1,
        )
    assert "epoch 0" in str(caught.value)


def test_fit_bad_batch_in_a_later_epoch_names_it() -> None:
    x, y = classification_data(n=20)
    good = split(x, y, [10, 10])
    train = factory_of(lambda epoch: good if epoch < 1 else [good[0], (x[:3], y[:4])])
    with pytest.raises(BatchError) as caught:
        fit(
            model=lamploop.SupervisedModel(linear64()),
            optimizer_factory=sgd(0.1),
            train_batches=train,
            max_epochs=3,
        )
    assert "epoch 1" in str(caught.value)
    assert "batch 1" in str(caught.value)


def test_fit_plain_generator_factory_is_a_configuration_error_and_iterable_batches_the_fix() -> None:
    x, y = classification_data(n=8)

    def plain(context: BatchContext):
        yield x, y

    with pytest.raises(ConfigurationError) as caught:
        fit(
            model=lamploop.SupervisedModel(linear64()),
            optimizer_factory=sgd(0.1),
            train_batches=plain,
            max_epochs=1,
        )
    assert "iterable_batches" in str(caught.value)
    state = fit(
        model=lamploop.SupervisedModel(linear64()),
        optimizer_factory=sgd(0.1),
        train_batches=lamploop.iterable_batches(plain),
        max_epochs=1,
    )
    assert state.epoch == 1


def _fit_bad_cases() -> list[tuple[str, dict[str, Any]]]:
    x, y = classification_data(n=8)
    module = linear64()
    return [
        ("bare module", {"model": module}),
        ("optimizer", {"optimizer_factory": torch.optim.SGD(module.parameters(), lr=0.1)}),
        ("tensors", {"train_batches": x}),
        ("list", {"train_batches": split(x, y, [4, 4])}),
        ("dataloader", {"train_batches": DataLoader(TensorDataset(x, y), batch_size=4)}),
        ("validation tensors", {"validation_batches": (x, y)}),
        ("world_size 0", {"world_size": 0}),
        ("max_epochs -1", {"max_epochs": -1}),
        ("max_epochs str", {"max_epochs": "2"}),
        ("accumulate 0", {"accumulate_gradient_over_n_batches": 0}),
        ("validation_frequency 0", {"validation_frequency": 0}),
        ("smoothing 2", {"validation_loss_exponential_smoothing_factor": 2.0}),
        ("policy", {"on_non_finite_loss": "ignore"}),
        ("precision", {"precision": "16"}),
        ("plateau without validation", {"learning_rate_schedule": lamploop.reduce_lr_on_plateau()}),
        ("patience 0", {"early_stopping_patience": 0}),
        ("cuda", {"device": "cuda"} if not torch.cuda.is_available() else {"device": "nonsense"}),
    ]


@pytest.mark.parametrize(("name", "bad"), _fit_bad_cases(), ids=[name for name, _ in _fit_bad_cases()])
def test_fit_bad_arguments_are_configuration_errors_before_anything_starts(
    name: str, bad: dict[str, Any]
) -> None:
    x, y = classification_data(n=8)
    made: list[int] = []
    asked: list[int] = []

    def optimizer_factory(parameters: Any) -> torch.optim.Optimizer:
        made.append(1)
        return torch.optim.SGD(parameters, lr=0.1)

    def train(context: BatchContext) -> Any:
        asked.append(context.epoch)
        return stream_of(split(x, y, [4, 4]))

    kwargs: dict[str, Any] = {
        "model": lamploop.SupervisedModel(linear64()),
        "optimizer_factory": optimizer_factory,
        "train_batches": train,
        "max_epochs": 2,
        "reporters": [],
        "device": "cpu",
    }
    kwargs.update(bad)
    with pytest.raises(ConfigurationError) as caught:
        lamploop.fit(**kwargs)
    assert isinstance(caught.value, LamploopError)
    assert str(caught.value)
    assert asked == [], "a batch stream was made before the arguments were checked"
    if name != "plateau without validation":  # not among the checks fit lists as made first
        assert made == [], "the optimizer was made before the arguments were checked"
    if name == "bare module":
        assert "SupervisedModel" in str(caught.value)


# ---------------------------------------------------------------------------------------------
# more bad inputs
# ---------------------------------------------------------------------------------------------


async def _train_one(factor: float) -> float:
    return 1.0


async def _validate_one() -> float:
    return 1.0


async def _save_nothing() -> None:
    return None


def _epochs_with(**bad: Any) -> None:
    kwargs: dict[str, Any] = {
        "max_epochs": 2,
        "train_epoch": _train_one,
        "validation_epoch": _validate_one,
        "save_min_validation_loss_model": _save_nothing,
        "return_min_validation_loss_model": lamploop.ALL_EPOCHS,
    }
    kwargs.update(bad)
    anyio.run(lambda: lamploop.epochs(**kwargs))


@pytest.mark.parametrize(
    "bad",
    [
        {"validation_epoch": lambda: 1.0},
        {"train_epoch": lambda factor: 1.0},
        {"save_min_validation_loss_model": None},
        {"checkpoint_state": 5},
        {"validation_loss_exponential_smoothing_factor": 0.0},
        {"learning_rate_schedule": lamploop.reduce_lr_on_plateau(), "learning_rate_schedule_init_state": 3},
        {"learning_rate_schedule": lamploop.from_epoch_count(lambda e: float("nan"))},
        {"model_selection_mode": "avg"},
    ],
    ids=[
        "sync validation",
        "sync train",
        "save None",
        "checkpoint 5",
        "smoothing 0",
        "schedule state",
        "nan",
        "mode",
    ],
)
def test_epochs_more_bad_arguments(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        _epochs_with(**bad)


@pytest.mark.parametrize(
    "bad",
    [
        {"save_min_validation_loss_model": lambda: None},
        {"checkpoint_state": lambda state, schedule_state: None},
    ],
    ids=["sync save", "sync checkpoint"],
)
def test_epochs_synchronous_callbacks_are_configuration_errors(bad: dict[str, Any]) -> None:
    # epochs' docstring: ConfigurationError for "a callback that is not callable or returns no awaitable"
    with pytest.raises(ConfigurationError):
        _epochs_with(**bad)


@pytest.mark.parametrize("schedule", [0.5, object()], ids=["float", "object"])
def test_epochs_a_schedule_that_is_not_one_is_a_configuration_error(schedule: Any) -> None:
    with pytest.raises(ConfigurationError):
        _epochs_with(learning_rate_schedule=schedule)


def test_fit_a_schedule_that_is_not_one_is_a_configuration_error() -> None:
    x, y = classification_data(n=8)
    with pytest.raises(ConfigurationError):
        fit(
            model=lamploop.SupervisedModel(linear64()),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=4),
            max_epochs=1,
            learning_rate_schedule=0.5,
        )


@pytest.mark.parametrize(
    "bad",
    [
        {"epoch": "x"},
        {"epoch": -1},
        {"step_optimizer": 5},
        {"step_optimizer": "optimizer"},
        {"forward_only": "yes"},
        {"channel": 5},
        {"device": "nonsense"},
        {"max_gradient_norm": float("nan")},
        {"batches": None},
        {"batches": "iterator"},
    ],
    ids=lambda bad: next(iter(bad)) + "=" + repr(next(iter(bad.values()))),
)
def test_one_epoch_more_bad_arguments(bad: dict[str, Any]) -> None:
    x, y = classification_data(n=20)
    module = linear64()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    before = params(module)
    kwargs: dict[str, Any] = {
        "model": lamploop.SupervisedModel(module),
        "batches": stream_of(split(x, y, [10, 10])),
        "step_optimizer": optimizer.step,
    }
    kwargs.update(bad)
    if kwargs["step_optimizer"] == "optimizer":
        kwargs["step_optimizer"] = optimizer
    if kwargs["batches"] == "iterator":
        kwargs["batches"] = iter(split(x, y, [10, 10]))
    with pytest.raises(ConfigurationError):
        anyio.run(lambda: lamploop.one_epoch(**kwargs))
    assert_params_close(params(module), before, tol=0)


class TwoInputs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3).double()
        self.b = torch.nn.Linear(2, 3).double()

    def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.a(features["a"]) + self.b(features["b"])


def test_structured_features_train_and_a_mismatched_member_is_a_batch_error() -> None:
    x, y = classification_data(n=12)
    z = torch.randn(12, 2, dtype=torch.float64)
    good = [({"a": x[i : i + 4], "b": z[i : i + 4]}, y[i : i + 4]) for i in range(0, 12, 4)]
    module = TwoInputs()
    reference = copy.deepcopy(module)
    loss = train_one_epoch(module, good, lr=0.2, model=lamploop.SupervisedModel(module))
    assert loss == pytest.approx(reference_epoch(reference, good, lr=0.2), abs=1e-13)
    assert_params_close(params(module), params(reference))
    bad = [good[0], ({"a": x[4:8], "b": z[4:7]}, y[4:8])]
    with pytest.raises(BatchError) as caught:
        train_one_epoch(module, bad, lr=0.2, model=lamploop.SupervisedModel(module), epoch=3)
    assert "epoch 3" in str(caught.value)
    assert "batch 1" in str(caught.value)
    with pytest.raises(BatchError) as caught:
        train_one_epoch(
            module, [(good[0][0], [0, 1, 2, 0])], lr=0.2, model=lamploop.SupervisedModel(module), epoch=3
        )
    assert "epoch 3" in str(caught.value)
    assert "batch 0" in str(caught.value)


def test_iterable_batches_make_returning_a_non_iterable_is_a_lamploop_error() -> None:
    with pytest.raises(LamploopError) as caught:
        fit(
            model=lamploop.SupervisedModel(linear64()),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.iterable_batches(lambda context: 5),
            max_epochs=1,
        )
    assert "epoch 0" in str(caught.value) or "int" in str(caught.value)


def test_a_loss_that_counts_no_example_in_any_batch_is_named() -> None:
    x, y = classification_data(n=20)

    def zero_count(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        return ce_sum(output, target), 0

    model = lamploop.SupervisedModel(linear64(), zero_count)
    with pytest.raises(LamploopError) as caught:
        train_one_epoch(model.module, split(x, y, [10, 10]), lr=0.1, model=model, epoch=0)
    # The first step counts no example: refused there, naming it (a step that counts none would
    # otherwise end the pass, as if the stream had ended).
    assert "epoch 0, batch 0" in str(caught.value), str(caught.value)
    assert "counted 0 examples" in str(caught.value), str(caught.value)


def test_fit_validation_stream_errors_and_nan_validation_raises_even_with_skip_step() -> None:
    x, y = classification_data(n=20)
    train = lamploop.tensor_batches(x[:12], y[:12], batch_size=4)
    nan_x = torch.full_like(x[:4], float("nan"))
    for valid, error, where in [
        (factory_of(lambda e: []), BatchError, "epoch 0"),
        (factory_of(lambda e: [(x[:4], y[:4]), (x[:3], y[:4])]), BatchError, "batch 1"),
        (factory_of(lambda e: [(nan_x, y[:4])]), NonFiniteLossError, "epoch 0"),
    ]:
        with pytest.raises(error) as caught:
            fit(
                model=lamploop.SupervisedModel(linear64()),
                optimizer_factory=sgd(0.1),
                train_batches=train,
                validation_batches=valid,
                max_epochs=2,
                on_non_finite_loss="skip_step",
            )
        assert where in str(caught.value), str(caught.value)


def test_fit_with_no_eligible_epoch_keeps_the_last_model() -> None:
    x, y = classification_data(n=30)
    train = lamploop.tensor_batches(x[:20], y[:20], batch_size=5)
    valid = lamploop.tensor_batches(x[20:], y[20:], batch_size=5, shuffle=False)
    module, reference = linear64(), linear64()
    state = fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=sgd(0.3),
        train_batches=train,
        validation_batches=valid,
        max_epochs=3,
        return_min_validation_loss_model=(),
    )
    _training, validation, *_ = reference_fit(reference, train, valid, max_epochs=3, lr=0.3)
    assert state.min_validation_epoch is None
    assert state.min_validation_loss is None
    for entry, want in zip(state.learning_curve, validation, strict=True):
        assert entry.validation_loss == pytest.approx(want, abs=1e-12)
    assert_params_close(params(module), params(reference))


def test_fit_on_epoch_sees_each_state() -> None:
    x, y = classification_data(n=12)
    seen: list[lamploop.LoopState] = []
    final = fit(
        model=lamploop.SupervisedModel(linear64()),
        optimizer_factory=sgd(0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=4),
        max_epochs=3,
        on_epoch=seen.append,
    )
    assert [s.epoch for s in seen] == [1, 2, 3]
    assert seen[-1] == final
    assert [len(s.learning_curve) for s in seen] == [1, 2, 3]
