"""Metrics beside the loss: reduced over ranks like the loss, in the learning curve, and usable
to select the best model by their minimum or maximum."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch
from workers import rank as worker

import lamploop
from lamploop.errors import ConfigurationError
from lamploop.metrics import PassResult, accuracy
from lamploop.state import LearningCurveEntry, converter

pytestmark = pytest.mark.anyio

METRICS = {"accuracy": accuracy, "mean_target": lambda output, target: (target.double().sum(), len(target))}
DATA = {"seed": 41, "batches": [5, 2, 4], "valid_batches": [3, 1, 2]}
EPOCHS = 3


def _model(rank: int) -> lamploop.SupervisedModel:
    return lamploop.SupervisedModel(worker.make_module({"seed": 6}, rank), metrics=METRICS)


@pytest.mark.timeout(60)
async def test_metrics_over_three_uneven_ranks_equal_the_union() -> None:
    models = [_model(rank) for rank in range(3)]
    train = worker.stream_factory(lambda e, r: worker.train_batches_of(DATA, e, r))
    valid = worker.stream_factory(lambda e, r: worker.valid_batches_of(DATA, e, r))
    with anyio.fail_after(50):
        state = await lamploop.local_data_parallel_training_loop(
            [(m, train, valid) for m in models], worker.optimizer_factory({"name": "adam"}), EPOCHS
        )
    reference = await lamploop.drive_distributed_training(
        nranks=1,
        device="cpu",
        control=None,
        model=_model(0),
        optimizer_factory=worker.optimizer_factory({"name": "adam"}),
        train_batches=worker.stream_factory(lambda e, r: worker.union_train_batches(DATA, e, 3, 1)),
        validation_batches=worker.stream_factory(lambda e, r: worker.union_valid_batches(DATA, e, 3)),
        max_epochs=EPOCHS,
    )
    for got, want in zip(state.learning_curve, reference.learning_curve, strict=True):
        assert sorted(got.training_metrics) == sorted(got.validation_metrics) == sorted(METRICS)
        for name in METRICS:
            assert got.training_metrics[name] == pytest.approx(want.training_metrics[name], abs=1e-12)
            assert got.validation_metrics[name] == pytest.approx(want.validation_metrics[name], abs=1e-12)
    # independently: the validation mean target over every rank's examples
    targets = torch.cat([y for _, y in worker.union_valid_batches(DATA, 0, 3)]).double()
    assert state.learning_curve[0].validation_metrics["mean_target"][1] == pytest.approx(
        float(targets.mean())
    )


async def _select(
    accuracies: list[float], mode: str, smoothing: float = 1.0, eligible: Any = lamploop.ALL_EPOCHS
) -> tuple[lamploop.LoopState, list[int]]:
    epoch = iter(range(len(accuracies)))
    saved: list[int] = []
    current = [0]

    async def train(factor: float) -> float:
        current[0] = next(epoch)
        return PassResult(1.0, {"accuracy": 0.5})

    async def valid() -> float:
        return PassResult(1.0 - accuracies[current[0]], {"accuracy": accuracies[current[0]]})

    async def save() -> None:
        saved.append(current[0])

    state = await lamploop.epochs(
        max_epochs=len(accuracies),
        train_epoch=train,
        validation_epoch=valid,
        save_min_validation_loss_model=save,
        return_min_validation_loss_model=eligible,
        validation_loss_exponential_smoothing_factor=smoothing,
        model_selection_metric="accuracy",
        model_selection_mode=mode,  # type: ignore[arg-type]
    )
    return state, saved


async def test_selection_by_the_largest_metric_picks_the_right_epoch() -> None:
    accuracies = [0.5, 0.8, 0.7, 0.9, 0.85]
    state, saved = await _select(accuracies, "max")
    assert (state.min_validation_epoch, state.min_validation_loss) == (3, 0.9)
    assert saved == [0, 1, 3]
    state, saved = await _select(accuracies, "min")
    assert state.min_validation_epoch == 0
    assert saved == [0]
    # the loss (1 - accuracy here) would have chosen the same as "max": the metric is what counts
    state, _ = await _select(accuracies, "max", eligible=(0, 1, 2))
    assert state.min_validation_epoch == 1


async def test_metrics_are_smoothed_like_the_loss() -> None:
    accuracies = [0.2, 1.0, 0.4, 0.9]
    state, _ = await _select(accuracies, "max", smoothing=0.5)
    smoothed = [0.2]
    for a in accuracies[1:]:
        smoothed.append(0.5 * a + 0.5 * smoothed[-1])  # 0.6, 0.5, 0.7
    assert [e.validation_metrics["accuracy"] for e in state.learning_curve] == [
        pytest.approx((s, a)) for s, a in zip(smoothed, accuracies, strict=True)
    ]
    assert state.min_validation_epoch == 3  # smoothed 0.7 beats 0.6, although raw 1.0 was epoch 1


async def test_an_unknown_selection_metric_is_named() -> None:
    async def train(factor: float) -> float:
        return 1.0

    async def valid() -> float:
        return PassResult(1.0, {"accuracy": 0.5})

    async def save() -> None:
        pass

    with pytest.raises(ConfigurationError, match="model_selection_metric 'f1' is not among epoch 0's"):
        await lamploop.epochs(
            max_epochs=2,
            train_epoch=train,
            validation_epoch=valid,
            save_min_validation_loss_model=save,
            model_selection_metric="f1",
        )
    with pytest.raises(ConfigurationError, match="model_selection_mode must be 'min' or 'max', got 'up'"):
        lamploop.settings.TrainingSettings(model_selection_mode="up")


def test_fit_records_accuracy_and_selects_by_it() -> None:
    (x, y), (xv, yv) = worker.fit_data()
    state = lamploop.fit(
        model=_model(0),
        optimizer_factory=worker.optimizer_factory({"name": "adam", "lr": 0.05}),
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),
        validation_batches=lamploop.tensor_batches(xv, yv, batch_size=8, shuffle=False),
        max_epochs=3,
        model_selection_metric="accuracy",
        model_selection_mode="max",
        reporters=[],
    )
    assert state is not None
    accuracies = [e.validation_metrics["accuracy"][0] for e in state.learning_curve]
    assert state.min_validation_epoch == accuracies.index(max(accuracies))
    assert all(0.0 <= e.training_metrics["accuracy"] <= 1.0 for e in state.learning_curve)


def test_a_curve_without_metrics_is_written_as_before() -> None:
    entry = LearningCurveEntry(2, 0.5, (0.4, 0.3))
    assert converter.unstructure(entry) == {"epoch": 2, "training_loss": 0.5, "validation_loss": (0.4, 0.3)}
    with_metrics = LearningCurveEntry(2, 0.5, None, {"accuracy": 0.9}, {})
    assert converter.structure(converter.unstructure(with_metrics), LearningCurveEntry) == with_metrics


class _StopAt:
    """A step boundary that stops the pass after step ``at`` and keeps where it was."""

    def __init__(self, at: int) -> None:
        self.at, self.progress = at, None

    def requests(self, steps_done: int) -> tuple[bool, bool]:
        return False, steps_done + 1 == self.at

    async def reached(self, progress: Any, *, stop: bool) -> None:
        self.progress = progress


async def test_a_pass_resumed_mid_epoch_ends_with_the_whole_epochs_metrics() -> None:
    batches = worker.train_batches_of(DATA, 0, 0)

    async def run(start: Any = None, boundary: Any = None) -> Any:
        module = worker.make_module({"seed": 6}, 0)
        optimizer = torch.optim.SGD(module.parameters(), lr=0.0)  # same parameters all along

        async def stream() -> Any:
            for batch in batches:
                yield batch

        return await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module, metrics=METRICS),
            batches=stream(),
            step_optimizer=optimizer.step,
            start=start,
            boundary=boundary,
        )

    whole = await run()
    stop = _StopAt(2)
    with pytest.raises(lamploop.loop.boundary.EpochStopped):
        await run(boundary=stop)
    assert stop.progress is not None
    assert len(stop.progress.metric_sums) == 4  # [sum, count] of each of the 2 metrics
    resumed = await run(start=stop.progress)
    assert float(resumed) == pytest.approx(float(whole), rel=1e-12)
    for name in METRICS:
        assert resumed.metrics[name] == pytest.approx(whole.metrics[name], rel=1e-12)
    one_metric = lamploop.SupervisedModel(worker.make_module({"seed": 6}, 0), metrics={"accuracy": accuracy})
    with pytest.raises(ConfigurationError, match="resumes with the sums of 2 metrics, but the model has 1"):
        await lamploop.one_epoch(
            model=one_metric,
            batches=worker.stream_factory(lambda e, r: batches)(lamploop.BatchContext(epoch=0)),
            step_optimizer=lambda: None,
            start=stop.progress,
        )


async def test_early_stopping_by_a_metric_stops_after_patience_validations_without_a_new_best() -> None:
    accuracies = [0.5, 0.8, 0.7, 0.75, 0.79, 0.95, 0.6]
    epoch = iter(range(len(accuracies)))
    current = [0]

    async def train(factor: float) -> float:
        current[0] = next(epoch)
        return 1.0

    async def valid() -> float:
        return PassResult(1.0, {"accuracy": accuracies[current[0]]})

    async def save() -> None:
        pass

    async def run(patience: int, init_state: Any = None, max_epochs: int = len(accuracies)) -> Any:
        return await lamploop.epochs(
            max_epochs=max_epochs,
            train_epoch=train,
            validation_epoch=valid,
            save_min_validation_loss_model=save,
            return_min_validation_loss_model=lamploop.ALL_EPOCHS,
            model_selection_metric="accuracy",
            model_selection_mode="max",
            early_stopping_patience=patience,
            init_state=init_state,
        )

    state = await run(3)  # best at epoch 1, then 0.7, 0.75, 0.79: three without a new best
    assert (state.epoch, state.min_validation_epoch) == (5, 1)
    epoch = iter(range(len(accuracies)))
    state = await run(4)  # one more chance: epoch 5 (0.95) is a new best, then 0.6
    assert (state.epoch, state.min_validation_epoch) == (7, 5)
    # resuming needs nothing more: the count comes from the learning curve
    epoch = iter(range(len(accuracies)))
    half = await run(3, max_epochs=4)
    assert half.epoch == 4
    epoch = iter(range(4, len(accuracies)))
    assert (await run(3, init_state=half)).epoch == 5


def test_the_logging_reporter_reports_the_metrics() -> None:
    from lamploop.reporting import EpochFinished
    from lamploop.reporting.logging_reporter import describe_epoch

    entry = LearningCurveEntry(2, 0.5, (0.4, 0.3), {"accuracy": 0.91}, {"accuracy": (0.87, 0.88)})
    line = describe_epoch(EpochFinished(lamploop.LoopState(epoch=3, learning_curve=(entry,))))
    assert line == (
        "epoch 2: train loss 0.5000, validation loss 0.3000 (smoothed 0.4000), "
        "train accuracy 0.9100, validation accuracy 0.8800 (smoothed 0.8700)"
    )
