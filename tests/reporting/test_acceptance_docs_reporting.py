"""Acceptance tests of observability and reporters, written from the documentation alone.

Sources: docs/observability.md, docs/how-to/custom-reporters.md, the public docstrings of
``lamploop.reporting`` (events, reporter protocol, MetricsFileReporter, PrometheusReporter,
LoggingReporter, ProgressReporter, TensorBoardReporter) and ``lamploop.errors``.

Every number a reporter receives is compared with the same run replayed here in plain torch:
the same initial weights, the same batches in the same order (``shuffle=False``), SGD with the
schedule's factor times the base rate, and the loss sum / example count of every step.
In-process, one rank, CPU.
"""

from __future__ import annotations

import copy
import csv
import io
import itertools
import json
import logging
import math
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch
import torch.nn.functional as F

import lamploop
from lamploop.errors import (
    ConfigurationError,
    MissingDependencyError,
    NonFiniteLossError,
    TrainingInterrupted,
)
from lamploop.reporting import (
    CheckpointWritten,
    EpochFinished,
    EpochStarted,
    LoggingReporter,
    MetricsFileReporter,
    ProgressReporter,
    ProgressSampled,
    PrometheusReporter,
    RunFailed,
    RunFinished,
    RunStarted,
    RunStopped,
    TensorBoardReporter,
    ValidationFinished,
)
from lamploop.reporting.metrics_file import STEP_COLUMNS

LR = 0.1
BATCH = 16
N_TRAIN = 64  # 4 steps per epoch
N_VAL = 32
FEATURES, CLASSES = 5, 3


# --------------------------------------------------------------------------- reference


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(N_TRAIN + N_VAL, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (N_TRAIN + N_VAL,), generator=generator)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def make_module(seed: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(FEATURES, CLASSES)


def in_order(x: torch.Tensor, y: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


@attrs.define
class RefEpoch:
    step_losses: list[tuple[float, int]]  # (loss sum, examples) per step
    train_loss: float
    train_accuracy: float
    val_loss: float | None = None
    val_accuracy: float | None = None
    val_loss_smoothed: float | None = None
    val_accuracy_smoothed: float | None = None


def reference(
    module: torch.nn.Module,
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    factors: list[float],
    *,
    validate: bool = True,
    smoothing: float = 1.0,
    batch_size: int = BATCH,
) -> list[RefEpoch]:
    """The run replayed in plain torch: one SGD step per batch on (loss sum) / (examples)."""
    module = copy.deepcopy(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    x, y, vx, vy = data
    out: list[RefEpoch] = []
    smoothed_loss = smoothed_acc = None
    for factor in factors:
        for group in optimizer.param_groups:
            group["lr"] = LR * factor
        steps, correct = [], 0
        for xb, yb in in_order(x, y, batch_size):
            optimizer.zero_grad()
            output = module(xb)
            loss_sum = F.cross_entropy(output, yb, reduction="sum")
            (loss_sum / len(yb)).backward()
            optimizer.step()
            steps.append((loss_sum.item(), len(yb)))
            correct += int((output.argmax(dim=1) == yb).sum())
        n = sum(count for _, count in steps)
        entry = RefEpoch(steps, sum(s for s, _ in steps) / n, correct / n)
        if validate:
            with torch.no_grad():
                output = module(vx)
                entry.val_loss = F.cross_entropy(output, vy, reduction="sum").item() / len(vy)
                entry.val_accuracy = int((output.argmax(dim=1) == vy).sum()) / len(vy)
            a = smoothing
            smoothed_loss = (
                entry.val_loss if smoothed_loss is None else entry.val_loss * a + smoothed_loss * (1 - a)
            )
            smoothed_acc = (
                entry.val_accuracy
                if smoothed_acc is None
                else entry.val_accuracy * a + smoothed_acc * (1 - a)
            )
            entry.val_loss_smoothed, entry.val_accuracy_smoothed = smoothed_loss, smoothed_acc
        out.append(entry)
    return out


def approx(value: float, rel: float = 1e-5) -> Any:
    return pytest.approx(value, rel=rel, abs=1e-7)


# --------------------------------------------------------------------------- helpers


class Recorder:
    """Records every event, the thread it came on, and start/close calls."""

    def __init__(self, delay: float = 0.0) -> None:
        self.events: list[Any] = []
        self.threads: set[int] = set()
        self.started = self.closed = 0
        self.overlap = False
        self._inside = False
        self.delay = delay

    def start(self) -> None:
        self.started += 1

    def report(self, event: Any) -> None:
        if self._inside:
            self.overlap = True
        self._inside = True
        try:
            self.threads.add(threading.get_ident())
            self.events.append(event)
            if self.delay:
                time.sleep(self.delay)
        finally:
            self._inside = False

    def close(self) -> None:
        self.closed += 1

    def of(self, kind: type) -> list[Any]:
        return [event for event in self.events if isinstance(event, kind)]


def counting(factory: Any) -> Any:
    """A batch factory that counts how often it was asked for a stream."""

    def make(context: Any) -> Any:
        make.calls += 1  # type: ignore[attr-defined]
        return factory(context)

    make.calls = 0  # type: ignore[attr-defined]
    return make


def slowed(factory: Any, delay: float) -> Any:
    def make(context: Any) -> Any:
        async def stream() -> Any:
            async for batch in factory(context):
                await anyio.sleep(delay)
                yield batch

        return stream()

    return make


def model_of(module: torch.nn.Module) -> lamploop.SupervisedModel:
    return lamploop.SupervisedModel(
        module, lamploop.cross_entropy_loss, metrics={"accuracy": lamploop.accuracy}
    )


def fit(module: torch.nn.Module, data: Any, **kwargs: Any) -> Any:
    x, y, vx, vy = data
    kwargs.setdefault("train_batches", lamploop.tensor_batches(x, y, batch_size=BATCH, shuffle=False))
    kwargs.setdefault("validation_batches", lamploop.tensor_batches(vx, vy, batch_size=N_VAL, shuffle=False))
    return lamploop.fit(
        model=model_of(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
        device="cpu",
        **kwargs,
    )


def tiny_fit(reporters: Any, **kwargs: Any) -> Any:
    x, y, _, _ = make_data()
    return lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(FEATURES, CLASSES)),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
        train_batches=kwargs.pop("train_batches", lamploop.tensor_batches(x, y, batch_size=BATCH)),
        max_epochs=kwargs.pop("max_epochs", 1),
        device="cpu",
        reporters=reporters,
        **kwargs,
    )


def describe(entry: RefEpoch, epoch: int) -> str:
    """describe_epoch's documented line, from the reference's numbers.

    ``(smoothed ...)`` is left out where the smoothed value is the raw one (as lamploop
    prints it: the docs' example only shows values that differ).
    """

    def smoothed(raw: float, value: float) -> str:
        return "" if value == raw else f" (smoothed {value:.4f})"

    loss_smoothed = smoothed(entry.val_loss, entry.val_loss_smoothed)
    accuracy_smoothed = smoothed(entry.val_accuracy, entry.val_accuracy_smoothed)
    return (
        f"epoch {epoch}: train loss {entry.train_loss:.4f}, validation loss {entry.val_loss:.4f}"
        f"{loss_smoothed}, train accuracy {entry.train_accuracy:.4f}, "
        f"validation accuracy {entry.val_accuracy:.4f}{accuracy_smoothed}"
    )


FACTORS = [1.0, 0.5, 0.25]  # lamploop.decrement(1, 0.5): 0.5 ** epoch


# --------------------------------------------------------------------------- events


def test_events_arrive_once_in_documented_order_with_the_computed_values(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data, module = make_data(), make_module()
    ref = reference(module, data, FACTORS, smoothing=0.5)
    recorder = Recorder(delay=0.002)  # a (slightly) slow reporter loses nothing
    caplog.set_level(logging.INFO, logger="lamploop")
    before = time.time()
    state = fit(
        module,
        data,
        max_epochs=3,
        checkpoint_dir=tmp_path / "ckpt",
        learning_rate_schedule=lamploop.decrement(1, 0.5),
        validation_loss_exponential_smoothing_factor=0.5,
        reporters=[recorder],
    )
    after = time.time()
    events = recorder.events

    # Order: RunStarted, per epoch EpochStarted, ProgressSampled*, ValidationFinished,
    # EpochFinished, CheckpointWritten, then RunFinished.
    expected_kinds: list[type] = [RunStarted]
    index = 1
    for _ in range(3):
        assert isinstance(events[index], EpochStarted), events[index]
        index += 1
        samples = 0
        while isinstance(events[index], ProgressSampled):
            index, samples = index + 1, samples + 1
        assert samples >= 1, "a sample after each epoch's first step"
        expected_kinds += [EpochStarted] + [ProgressSampled] * samples
        expected_kinds += [ValidationFinished, EpochFinished, CheckpointWritten]
        index += 3
    expected_kinds.append(RunFinished)
    assert [type(event) for event in events] == expected_kinds

    assert recorder.started == recorder.closed == 1
    assert len(recorder.threads) == 1
    assert not recorder.overlap
    assert recorder.threads == {threading.main_thread().ident}
    times = [event.time for event in events]
    assert times == sorted(times)
    assert before <= times[0]
    assert times[-1] <= after

    (started,) = recorder.of(RunStarted)
    assert (started.nranks, started.epoch, started.max_epochs) == (1, 0, 3)

    for epoch, event in enumerate(recorder.of(EpochStarted)):
        assert event.epoch == epoch
        assert event.learning_rate_factor == FACTORS[epoch]
        assert (event.steps_done, event.examples_done) == (0, 0)
        assert event.expected_steps == (None if epoch == 0 else 4)

    for epoch, event in enumerate(recorder.of(ValidationFinished)):
        assert event.epoch == epoch
        assert event.loss == approx(ref[epoch].val_loss)
        assert dict(event.metrics) == {"accuracy": approx(ref[epoch].val_accuracy)}
        assert event.seconds >= 0

    finished = recorder.of(EpochFinished)
    for epoch, event in enumerate(finished):
        assert event.state.epoch == epoch + 1
        entry = event.state.learning_curve[-1]
        assert entry.epoch == epoch
        assert entry.training_loss == approx(ref[epoch].train_loss)
        assert entry.validation_loss == (approx(ref[epoch].val_loss_smoothed), approx(ref[epoch].val_loss))
        assert entry.learning_rate_factor == FACTORS[epoch]
        assert (event.steps, event.examples) == (4, 64)
        assert 0 < event.seconds < after - before
        breakdown = event.step_breakdown
        assert breakdown is not None
        assert breakdown.steps == 4
        parts = [
            breakdown.data_wait,
            breakdown.forward_backward,
            breakdown.communication_wait,
            breakdown.optimizer,
            breakdown.checkpoint,
        ]
        assert all(part >= 0 for part in parts)
        assert sum(parts) <= breakdown.seconds + 1e-9
        validation = recorder.of(ValidationFinished)[epoch]
        # the epoch's wall-clock time holds its training steps' and its validation's
        assert event.seconds >= breakdown.seconds + validation.seconds - 1e-6
        assert breakdown.communication_wait == 0.0  # one rank
    assert finished[-1].state == state

    for epoch, event in enumerate(recorder.of(CheckpointWritten)):
        assert (event.epoch, event.steps_done) == (epoch + 1, 0)
        path = Path(event.path)
        assert path.is_dir()
        assert path.parent == tmp_path / "ckpt"
        assert path.name == f"epoch-{epoch + 1:06d}"
        assert event.seconds >= 0

    (end,) = recorder.of(RunFinished)
    assert end.state == state
    assert end.reason == ""

    # The samples: the first of each epoch right after its first step.
    for epoch in range(3):
        first = next(s for s in recorder.of(ProgressSampled) if s.epoch == epoch)
        assert (first.steps_done, first.steps, first.examples) == (1, 1, BATCH)
        assert first.loss == approx(ref[epoch].step_losses[0][0] / BATCH)
        assert (first.total_steps, first.total_examples) == (4 * epoch + 1, 64 * epoch + BATCH)

    # reporters=[mine] replaced the default LoggingReporter: no epoch line was logged.
    assert not [r for r in caplog.records if r.name == "lamploop" and "train loss" in r.getMessage()]


def test_progress_samples_hold_the_mean_loss_since_the_previous_sample(tmp_path: Path) -> None:
    data, module = make_data(), make_module()
    x, y, _vx, _vy = data
    ref = reference(module, data, [1.0, 1.0], validate=False, batch_size=8)  # 8 steps per epoch
    recorder = Recorder()
    delay = 0.1
    fit(
        module,
        data,
        max_epochs=2,
        train_batches=slowed(lamploop.tensor_batches(x, y, batch_size=8, shuffle=False), delay),
        validation_batches=None,
        reporters=[recorder],
    )
    samples = recorder.of(ProgressSampled)
    assert len(samples) >= 3, "after each first step, and every 0.5 s of the 0.8 s epochs"
    previous: dict[int, tuple[int, int]] = {}
    for sample in samples:
        done_before, _ = previous.get(sample.epoch, (0, 0))
        losses = ref[sample.epoch].step_losses[done_before : sample.steps_done]
        assert sample.steps == sample.steps_done - done_before
        assert sample.examples == sum(n for _, n in ref[sample.epoch].step_losses[: sample.steps_done])
        # the run's totals: every earlier epoch's 8 steps and 64 examples, then this one's
        assert sample.total_steps == 8 * sample.epoch + sample.steps_done
        assert sample.total_examples == 64 * sample.epoch + sample.examples
        if losses:
            assert sample.loss == approx(sum(s for s, _ in losses) / sum(n for _, n in losses))
            assert sample.seconds_per_step > 0
            assert sample.examples_per_second > 0
        else:
            assert sample.loss is None
        assert sample.communication_seconds_per_step == 0.0
        previous[sample.epoch] = (sample.steps_done, sample.examples)
    for epoch in range(2):
        times = [sample.time for sample in samples if sample.epoch == epoch]
        assert len(times) >= 2  # after the first step, then 0.5 s later (epochs last 0.8 s)
        assert all(later - earlier >= 0.45 for earlier, later in itertools.pairwise(times))
    for event in recorder.of(EpochFinished):
        assert event.step_breakdown.data_wait >= 8 * delay * 0.9  # the stream's sleeps are data wait
        assert event.state.learning_curve[-1].training_loss == approx(ref[event.state.epoch - 1].train_loss)


def test_run_finished_says_why_it_ended_before_max_epochs() -> None:
    recorder = Recorder()
    state = tiny_fit(
        [recorder],
        max_epochs=5,
        learning_rate_schedule=lamploop.from_epoch_count(lambda epoch: 0.0 if epoch >= 2 else 1.0),
    )
    assert state.epoch == 2
    assert recorder.of(RunStarted)[0].max_epochs == 5
    assert [e.epoch for e in recorder.of(EpochStarted)] == [0, 1]
    assert isinstance(recorder.events[-1], RunFinished)
    assert recorder.events[-1].reason != ""
    assert recorder.events[-1].state == state

    # Early stopping: a rate of 0 never improves the validation loss after epoch 0.
    early = Recorder()
    data = make_data()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(make_module()),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.0),
        train_batches=lamploop.tensor_batches(data[0], data[1], batch_size=BATCH),
        validation_batches=lamploop.tensor_batches(data[2], data[3], batch_size=N_VAL),
        max_epochs=5,
        early_stopping_patience=1,
        device="cpu",
        reporters=[early],
    )
    assert state.epoch < 5
    assert isinstance(early.events[-1], RunFinished)
    assert early.events[-1].reason.startswith("early stopping")


def test_accumulated_batches_are_reported_as_optimizer_steps() -> None:
    data, module = make_data(), make_module()
    ref = reference(module, data, [1.0, 1.0], validate=False, batch_size=2 * BATCH)  # the same steps
    recorder = Recorder()
    state = fit(
        module,
        data,
        max_epochs=2,
        validation_batches=None,
        accumulate_gradient_over_n_batches=2,
        reporters=[recorder],
    )
    assert [(e.steps, e.examples) for e in recorder.of(EpochFinished)] == [(2, 64), (2, 64)]
    assert [e.expected_steps for e in recorder.of(EpochStarted)] == [None, 2]
    for epoch in range(2):
        first = next(s for s in recorder.of(ProgressSampled) if s.epoch == epoch)
        assert (first.steps_done, first.examples, first.total_steps) == (1, 2 * BATCH, 2 * epoch + 1)
        assert first.loss == approx(ref[epoch].step_losses[0][0] / (2 * BATCH))
    assert [e.training_loss for e in state.learning_curve] == [approx(r.train_loss) for r in ref]


# --------------------------------------------------------------------------- failures


class Scraper:
    """Scrapes a PrometheusReporter (listed before it) at each event, over real HTTP."""

    def __init__(self, prometheus: PrometheusReporter) -> None:
        self.prometheus = prometheus
        self.scrapes: list[tuple[Any, dict[tuple[str, frozenset], float]]] = []

    def report(self, event: Any) -> None:
        self.scrapes.append((event, scrape(self.prometheus.url)))

    def at(self, kind: type) -> list[tuple[Any, dict]]:
        return [(e, m) for e, m in self.scrapes if isinstance(e, kind)]


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    assert url.startswith("http://127.0.0.1:")
    assert url.endswith("/metrics")
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return values


def metric(values: dict, key: str, /, **labels: str) -> float | None:
    return values.get((key, frozenset(labels.items())))


def test_a_failed_run_ends_with_run_failed_naming_the_error() -> None:
    data = make_data()
    x, y, _, _ = data
    plain = lamploop.tensor_batches(x, y, batch_size=BATCH, shuffle=False)

    def nan_in_epoch_1(context: Any) -> Any:
        async def stream() -> Any:
            index = 0
            async for features, target in plain(context):
                if context.epoch == 1 and index == 1:
                    features = torch.full_like(features, float("nan"))
                index += 1
                yield features, target

        return stream()

    recorder = Recorder()
    prometheus = PrometheusReporter(port=0)
    scraper = Scraper(prometheus)
    with pytest.raises(NonFiniteLossError) as caught:
        fit(
            make_module(),
            data,
            max_epochs=3,
            train_batches=nan_in_epoch_1,
            validation_batches=None,
            reporters=[prometheus, scraper, recorder],
        )
    kinds = [type(e) for e in recorder.events]
    assert kinds.count(EpochFinished) == 1
    assert kinds.count(EpochStarted) == 2
    assert isinstance(recorder.events[-1], RunFailed)
    assert kinds.count(RunFailed) == 1
    assert RunFinished not in kinds
    assert recorder.events[-1].error == f"NonFiniteLossError: {caught.value}"
    assert recorder.closed == 1
    (_, at_failure), *_ = scraper.at(RunFailed)
    assert metric(at_failure, "lamploop_run_state") == 3.0
    assert metric(at_failure, "lamploop_epochs_total") == 1.0


def test_a_reporter_that_raises_in_report_is_logged_and_the_run_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        def __init__(self) -> None:
            self.calls = 0

        def report(self, event: Any) -> None:
            self.calls += 1
            raise RuntimeError("reporter exploded")

    class BrokenClose(Recorder):
        def close(self) -> None:
            super().close()
            raise RuntimeError("close exploded")

    broken, recorder, after = Broken(), BrokenClose(), Recorder()
    caplog.set_level(logging.DEBUG, logger="lamploop")
    state = tiny_fit([broken, recorder, after], max_epochs=2)
    assert state is not None
    assert state.epoch == 2
    assert broken.calls == len(recorder.events) == len(after.events)
    assert [type(e) for e in recorder.events] == [type(e) for e in after.events]
    assert isinstance(after.events[-1], RunFinished)
    assert recorder.closed == after.closed == 1
    logged = " ".join(
        r.getMessage() + " " + (str(r.exc_info[1]) if r.exc_info else "")
        for r in caplog.records
        if r.name.startswith("lamploop")
    )
    assert "reporter exploded" in logged
    assert "close exploded" in logged


def test_a_failing_start_stops_the_run_before_it_begins_and_closes_every_reporter() -> None:
    class NeedsAPort(Recorder):
        def start(self) -> None:
            super().start()
            raise OSError("port 9100 is in use")

    good, bad = Recorder(), NeedsAPort()
    x, y, _, _ = make_data()
    batches = counting(lamploop.tensor_batches(x, y, batch_size=BATCH))
    with pytest.raises(OSError, match="port 9100 is in use"):
        tiny_fit([good, bad], train_batches=batches)
    assert batches.calls == 0
    assert good.events == []
    assert bad.events == []
    assert (good.started, good.closed, bad.closed) == (1, 1, 1)


@pytest.mark.parametrize(
    "reporters",
    [
        [object()],
        [42],
        ["not a reporter"],
        LoggingReporter(),
        [LoggingReporter],
    ],
    ids=["object", "int", "str", "bare-reporter-not-a-list", "a-reporter-class-not-an-instance"],
)
def test_a_non_reporter_is_a_configuration_error_before_training(reporters: Any) -> None:
    x, y, _, _ = make_data()
    batches = counting(lamploop.tensor_batches(x, y, batch_size=BATCH))
    module = torch.nn.Linear(FEATURES, CLASSES)
    weights = copy.deepcopy(module.state_dict())
    with pytest.raises(ConfigurationError, match="reporter"):
        lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
            train_batches=batches,
            max_epochs=1,
            device="cpu",
            reporters=reporters,
        )
    assert batches.calls == 0
    assert all(torch.equal(weights[k], v) for k, v in module.state_dict().items())


def test_sigterm_stops_with_a_step_checkpoint_then_the_resumed_epoch_reports_its_position(
    tmp_path: Path,
) -> None:
    class StopAtEpoch1(Recorder):
        sent = False

        def report(self, event: Any) -> None:
            super().report(event)
            if isinstance(event, ProgressSampled) and event.epoch == 1 and not self.sent:
                self.sent = True
                signal.raise_signal(signal.SIGTERM)

    data, module = make_data(), make_module()
    x, y, _, _ = data
    ref = reference(module, data, [1.0, 1.0, 1.0], validate=False, batch_size=8)  # 8 steps per epoch
    # A stream that awaits between batches, so the event loop turns (and sees the signal) each step.
    batches = slowed(lamploop.tensor_batches(x, y, batch_size=8, shuffle=False), 0.005)
    checkpoints, curve = tmp_path / "ckpt", tmp_path / "curve.jsonl"
    recorder = StopAtEpoch1()
    fallback = signal.signal(signal.SIGTERM, lambda *_: None)  # never kill pytest
    try:
        with pytest.raises(TrainingInterrupted) as caught:
            fit(
                copy.deepcopy(module),
                data,
                max_epochs=3,
                checkpoint_dir=checkpoints,
                train_batches=batches,
                validation_batches=None,
                reporters=[MetricsFileReporter(curve), recorder],
            )
    finally:
        signal.signal(signal.SIGTERM, fallback)
    assert caught.value.reason == "SIGTERM"
    assert caught.value.epoch == 1
    events = recorder.events
    assert isinstance(events[-1], RunStopped)
    assert events[-1].reason == "SIGTERM"
    assert events[-1].message
    assert isinstance(events[-2], CheckpointWritten)
    done = events[-2].steps_done
    assert events[-2].epoch == 1
    assert 0 < done == caught.value.steps_done < 8
    assert Path(events[-2].path).is_dir()
    assert not recorder.of(RunFinished)
    assert not recorder.of(RunFailed)
    assert recorder.closed == 1

    # The next run resumes at that step boundary.
    resumed = Recorder()
    prometheus = PrometheusReporter(port=0)
    scraper = Scraper(prometheus)
    state = fit(
        copy.deepcopy(module),
        data,
        max_epochs=3,
        checkpoint_dir=checkpoints,
        train_batches=lamploop.tensor_batches(x, y, batch_size=8, shuffle=False),
        validation_batches=None,
        reporters=[MetricsFileReporter(curve), prometheus, scraper, resumed],
    )
    assert resumed.of(RunStarted)[0].epoch == 1
    first_start = resumed.of(EpochStarted)[0]
    assert (first_start.epoch, first_start.steps_done, first_start.examples_done) == (1, done, 8 * done)
    first_sample = resumed.of(ProgressSampled)[0]
    assert (first_sample.epoch, first_sample.steps_done, first_sample.examples) == (
        1,
        done + 1,
        8 * (done + 1),
    )
    assert first_sample.steps == 1
    assert first_sample.total_steps == 1
    assert first_sample.loss == approx(ref[1].step_losses[done][0] / 8)
    finished = resumed.of(EpochFinished)
    assert [(e.steps, e.examples) for e in finished] == [(8, 64), (8, 64)]  # the resumed epoch's all
    assert finished[0].step_breakdown.steps == 8 - done  # the steps this process ran
    assert [e.training_loss for e in state.learning_curve] == [approx(r.train_loss) for r in ref]
    (at_epoch_1,) = [values for event, values in scraper.at(EpochFinished) if event.state.epoch == 2]
    assert metric(at_epoch_1, "lamploop_steps_total") == 8 - done  # not the steps before the checkpoint
    assert metric(at_epoch_1, "lamploop_examples_total") == 8 * (8 - done)
    rows = [json.loads(line) for line in curve.read_text().splitlines()]
    assert [row["epoch"] for row in rows] == [0, 1, 2]
    assert [row["training_loss"] for row in rows] == [approx(r.train_loss) for r in ref]


# --------------------------------------------------------------------------- metrics file


def test_metrics_file_csv_rows_hold_the_epochs_and_a_resumed_run_appends(tmp_path: Path) -> None:
    data, module = make_data(), make_module()
    ref = reference(module, data, FACTORS)
    path = tmp_path / "out" / "curve.csv"  # the directory is made
    first, second = Recorder(), Recorder()
    checkpoints = tmp_path / "ckpt"
    schedule = lamploop.decrement(1, 0.5)
    fit(
        copy.deepcopy(module),
        data,
        max_epochs=2,
        checkpoint_dir=checkpoints,
        learning_rate_schedule=schedule,
        reporters=[MetricsFileReporter(path), first],
    )
    state = fit(
        copy.deepcopy(module),
        data,
        max_epochs=3,
        checkpoint_dir=checkpoints,
        learning_rate_schedule=schedule,
        reporters=[MetricsFileReporter(path), second],
    )
    # The resumed run: it starts at epoch 2, and counts its steps from 0 again.
    (started,) = second.of(RunStarted)
    assert (started.epoch, started.max_epochs) == (2, 3)
    (epoch_started,) = second.of(EpochStarted)
    assert (epoch_started.epoch, epoch_started.expected_steps) == (2, None)
    assert second.of(ProgressSampled)[0].total_steps == 1

    text = path.read_text()
    assert text.count("epoch,") == 1, "one header"
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    header = list(rows[0].keys())
    base = [
        "epoch",
        "training_loss",
        "validation_loss",
        "validation_loss_smoothed",
        "learning_rate_factor",
        "seconds",
        "steps",
        "examples",
    ]
    assert header[: len(base)] == base
    assert set(STEP_COLUMNS) <= set(header)
    assert {"train_accuracy", "validation_accuracy"} <= set(header)
    assert [int(row["epoch"]) for row in rows] == [0, 1, 2]
    events = first.of(EpochFinished) + second.of(EpochFinished)
    for epoch, (row, event) in enumerate(zip(rows, events, strict=True)):
        assert float(row["training_loss"]) == approx(ref[epoch].train_loss)
        assert float(row["training_loss"]) == event.state.learning_curve[-1].training_loss
        assert float(row["validation_loss"]) == approx(ref[epoch].val_loss)
        assert float(row["validation_loss_smoothed"]) == approx(ref[epoch].val_loss)  # factor 1
        assert float(row["learning_rate_factor"]) == FACTORS[epoch]
        assert float(row["seconds"]) == event.seconds
        assert (int(row["steps"]), int(row["examples"])) == (4, 64)
        assert float(row["train_accuracy"]) == approx(ref[epoch].train_accuracy)
        assert float(row["validation_accuracy"]) == approx(ref[epoch].val_accuracy)
        assert float(row["step_seconds"]) == approx(event.step_breakdown.seconds, 1e-9)
        assert float(row["data_wait_seconds"]) == approx(event.step_breakdown.data_wait, 1e-9)
        assert float(row["forward_backward_seconds"]) == approx(event.step_breakdown.forward_backward, 1e-9)
        assert float(row["communication_wait_seconds"]) == 0.0
    assert float(rows[-1]["training_loss"]) == state.learning_curve[-1].training_loss


def test_metrics_file_json_lines_carry_time_and_null_for_values_an_epoch_lacks(tmp_path: Path) -> None:
    data, module = make_data(), make_module()
    ref = reference(module, data, [1.0, 1.0, 1.0])
    path = tmp_path / "curve.ndjson"
    recorder = Recorder()
    fit(module, data, max_epochs=3, validation_frequency=2, reporters=[MetricsFileReporter(path), recorder])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    events = recorder.of(EpochFinished)
    assert [row["epoch"] for row in rows] == [0, 1, 2]
    validated = [
        row["validation_loss"] is not None for row in rows
    ]  # validation_frequency=2 validates some epochs, not all
    assert any(validated)
    assert not all(validated)
    for row, event in zip(rows, events, strict=True):
        epoch = row["epoch"]
        assert row["time"] == event.time
        assert row["training_loss"] == approx(ref[epoch].train_loss)
        assert row["train_accuracy"] == approx(ref[epoch].train_accuracy)
        assert (row["steps"], row["examples"]) == (4, 64)
        entry = event.state.learning_curve[-1]
        if entry.validation_loss is None:
            assert row["validation_loss"] is None
            assert row["validation_accuracy"] is None
        else:
            assert row["validation_loss"] == approx(ref[epoch].val_loss)
            assert row["validation_accuracy"] == approx(ref[epoch].val_accuracy)


def test_metrics_file_unknown_suffix_or_format_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError):
        MetricsFileReporter(tmp_path / "curve.txt")
    with pytest.raises(ConfigurationError):
        MetricsFileReporter(tmp_path / "curve.csv", format="xml")  # type: ignore[arg-type]


def test_metrics_file_with_a_foreign_csv_header_is_logged_and_the_run_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "curve.csv"
    path.write_text("alpha,beta\n1,2\n")
    recorder = Recorder()
    caplog.set_level(logging.DEBUG, logger="lamploop")
    state = tiny_fit([MetricsFileReporter(path), recorder], max_epochs=2)
    assert state.epoch == 2
    assert isinstance(recorder.events[-1], RunFinished)
    assert path.read_text() == "alpha,beta\n1,2\n"  # the reporter then writes nothing
    assert [r for r in caplog.records if r.name.startswith("lamploop") and r.levelno >= logging.WARNING]


# --------------------------------------------------------------------------- prometheus


def test_prometheus_serves_the_documented_metrics_over_http(tmp_path: Path) -> None:
    data, module = make_data(), make_module()
    ref = reference(module, data, FACTORS)
    prometheus = PrometheusReporter(port=0)
    scraper, recorder = Scraper(prometheus), Recorder()
    fit(
        module,
        data,
        max_epochs=3,
        checkpoint_dir=tmp_path,
        learning_rate_schedule=lamploop.decrement(1, 0.5),
        reporters=[prometheus, scraper, recorder],
    )
    (_, at_start), *_ = scraper.at(RunStarted)
    for counter in ("steps", "examples", "epochs", "checkpoints"):
        assert metric(at_start, f"lamploop_{counter}_total") == 0.0
    for gauge in ("loss", "validation_loss", "epoch_training_loss", "checkpoint_seconds", "step_seconds"):
        assert metric(at_start, f"lamploop_{gauge}") is None, f"{gauge} before it was measured"
    assert metric(at_start, "lamploop_ranks") == 1.0
    assert metric(at_start, "lamploop_peers_alive") == 1.0
    assert metric(at_start, "lamploop_run_state") == 0.0

    for event, values in scraper.at(EpochStarted):
        assert metric(values, "lamploop_epoch") == event.epoch
        assert metric(values, "lamploop_learning_rate_factor") == FACTORS[event.epoch]

    for event, values in scraper.at(ProgressSampled):
        assert metric(values, "lamploop_steps_total") == event.total_steps
        assert metric(values, "lamploop_examples_total") == event.total_examples
        assert metric(values, "lamploop_loss") == approx(event.loss, 1e-9)
        assert metric(values, "lamploop_step_seconds") == approx(event.seconds_per_step, 1e-9)
        assert metric(values, "lamploop_communication_seconds") == 0.0
        assert metric(values, "lamploop_examples_per_second") == approx(event.examples_per_second, 1e-9)

    for event, values in scraper.at(ValidationFinished):
        assert metric(values, "lamploop_validation_loss") == approx(ref[event.epoch].val_loss)

    for event, values in scraper.at(EpochFinished):
        epoch = event.state.epoch - 1
        assert metric(values, "lamploop_epochs_total") == epoch + 1
        assert metric(values, "lamploop_steps_total") == 4 * (epoch + 1)
        assert metric(values, "lamploop_examples_total") == 64 * (epoch + 1)
        assert metric(values, "lamploop_checkpoints_total") == epoch  # its checkpoint comes next
        assert metric(values, "lamploop_epoch_training_loss") == approx(ref[epoch].train_loss)
        assert metric(values, "lamploop_epoch_seconds") == approx(event.seconds, 1e-9)
        assert metric(values, "lamploop_epoch") == epoch + 1  # the next one after EpochFinished
        # lamploop_metric: the last finished epoch's metrics (raw)
        assert metric(values, "lamploop_metric", split="train", name="accuracy") == approx(
            ref[epoch].train_accuracy
        )
        assert metric(values, "lamploop_metric", split="validation", name="accuracy") == approx(
            ref[epoch].val_accuracy
        )
        assert metric(values, "lamploop_validation_loss") == approx(ref[epoch].val_loss)

    for event, values in scraper.at(CheckpointWritten):
        assert metric(values, "lamploop_checkpoints_total") == event.epoch
        assert metric(values, "lamploop_checkpoint_seconds") == approx(event.seconds, 1e-9)
        assert 0 <= metric(values, "lamploop_seconds_since_checkpoint") < 5

    (_, at_end), *_ = scraper.at(RunFinished)
    assert metric(at_end, "lamploop_run_state") == 1.0
    assert metric(at_end, "lamploop_epochs_total") == 3.0
    assert metric(at_end, "lamploop_checkpoints_total") == 3.0
    assert metric(at_end, "lamploop_steps_total") == 12.0
    last_loss = [e.loss for e in recorder.of(ProgressSampled) if e.loss is not None][-1]
    assert metric(at_end, "lamploop_loss") == approx(last_loss, 1e-9)

    # fit closed the reporter: the port is free again.
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(prometheus.url, timeout=1)
    with socket.socket() as again:  # nothing listens there (TIME_WAIT of the scrapes allowed)
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", int(prometheus.url.split(":")[2].split("/")[0])))


def test_prometheus_port_in_use_is_a_configuration_error_before_training() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        recorder = Recorder()
        x, y, _, _ = make_data()
        batches = counting(lamploop.tensor_batches(x, y, batch_size=BATCH))
        with pytest.raises(ConfigurationError):
            tiny_fit([recorder, PrometheusReporter(port)], train_batches=batches)
        assert batches.calls == 0
        assert recorder.events == []
        assert recorder.closed == 1


@pytest.mark.parametrize("port", [-1, 65536, 10**6, "9100", 1.5])
def test_prometheus_port_out_of_range_is_a_configuration_error_when_made(port: Any) -> None:
    with pytest.raises(ConfigurationError, match="port"):
        PrometheusReporter(port)


# --------------------------------------------------------------------------- text reporters


def test_logging_reporter_logs_one_line_per_epoch_with_the_computed_losses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    data, module = make_data(), make_module()
    ref = reference(module, data, [1.0, 1.0], smoothing=0.5)
    assert ref[1].val_loss_smoothed != ref[1].val_loss
    caplog.set_level(logging.INFO, logger="lamploop")
    fit(
        module,
        data,
        max_epochs=2,
        validation_loss_exponential_smoothing_factor=0.5,
        reporters=[LoggingReporter()],
    )
    messages = [r.getMessage() for r in caplog.records if r.name == "lamploop" and r.levelno == logging.INFO]
    for epoch in range(2):
        lines = [m for m in messages if m.startswith(f"epoch {epoch}: ")]
        assert len(lines) == 1, messages
        assert lines[0].startswith(describe(ref[epoch], epoch)), (lines[0], describe(ref[epoch], epoch))
        # ... and ends with the step breakdown's shares
        assert "per step " in lines[0]
        assert "data wait " in lines[0]
        assert lines[0].endswith("%)")


def test_default_reporter_without_logging_setup_writes_epoch_lines_to_stderr(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No logging set up: no handler on "lamploop" or any ancestor (pytest's own taken off the
    # root for this test), and stderr is not a terminal, so fit's default is a LoggingReporter.
    lamploop_logger = logging.getLogger("lamploop")
    monkeypatch.setattr(logging.root, "handlers", [])
    monkeypatch.setattr(lamploop_logger, "handlers", [])
    monkeypatch.setattr(lamploop_logger, "level", logging.NOTSET)
    monkeypatch.setattr(logging.root, "level", logging.WARNING)
    assert not lamploop_logger.hasHandlers()
    data, module = make_data(), make_module()
    ref = reference(module, data, [1.0, 1.0])
    fit(module, data, max_epochs=2)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("lamploop: epoch ")]
    assert len(lines) == 2, err
    for epoch, line in enumerate(lines):
        assert line.startswith(f"lamploop: {describe(ref[epoch], epoch)}"), (
            line,
            describe(ref[epoch], epoch),
        )
    assert "\x1b" not in err


def test_progress_reporter_in_a_file_prints_plain_lines_with_the_computed_losses() -> None:
    data, module = make_data(), make_module()
    ref = reference(module, data, FACTORS)
    out = io.StringIO()
    fit(
        module,
        data,
        max_epochs=3,
        learning_rate_schedule=lamploop.decrement(1, 0.5),
        reporters=[ProgressReporter(out)],
    )
    text = out.getvalue()
    assert "\x1b" not in text
    lines = text.splitlines()
    assert lines[0] == "training on 1 rank(s) from epoch 0 to 3"
    epoch_lines = [line for line in lines if line.startswith("epoch ")]
    assert len(epoch_lines) == 3
    for epoch, line in enumerate(epoch_lines):
        assert line.startswith(describe(ref[epoch], epoch)), (line, describe(ref[epoch], epoch))
        assert "examples/s" in line
    assert lines[-1].startswith("finished after epoch 2 (")


# --------------------------------------------------------------------------- tensorboard


def test_tensorboard_writes_the_documented_scalars_at_the_global_step(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data, module = make_data(), make_module()
    ref = reference(module, data, FACTORS, smoothing=0.5)
    recorder = Recorder()
    fit(
        module,
        data,
        max_epochs=3,
        checkpoint_dir=tmp_path / "ckpt",
        learning_rate_schedule=lamploop.decrement(1, 0.5),
        validation_loss_exponential_smoothing_factor=0.5,
        checkpoint_every_n_steps=2,
        reporters=[TensorBoardReporter(tmp_path / "tb"), recorder],
    )
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    # Step-boundary checkpoints come inside the epoch, before its validation.
    checkpoints = recorder.of(CheckpointWritten)
    inside = [c for c in checkpoints if c.steps_done != 0]
    assert {(c.epoch, c.steps_done) for c in inside} >= {(0, 2), (1, 2), (2, 2)}
    assert all(0 < c.steps_done <= 4 and c.steps_done % 2 == 0 for c in inside)
    for epoch in range(3):
        kinds = [
            type(e)
            for e in recorder.events
            if getattr(e, "epoch", None) == epoch
            or (isinstance(e, EpochFinished) and e.state.epoch == epoch + 1)
        ]
        assert kinds.index(CheckpointWritten) < kinds.index(ValidationFinished) < kinds.index(EpochFinished)
    accumulator = EventAccumulator(str(tmp_path / "tb"))
    accumulator.Reload()

    def points(tag: str) -> list[tuple[int, float]]:
        return [(s.step, s.value) for s in accumulator.Scalars(tag)]

    ends = [4, 8, 12]
    expectations = {
        "train/loss": [r.train_loss for r in ref],
        "validation/loss": [r.val_loss for r in ref],
        "validation/loss_smoothed": [r.val_loss_smoothed for r in ref],
        "train/accuracy": [r.train_accuracy for r in ref],
        "validation/accuracy": [r.val_accuracy for r in ref],
        "validation/accuracy_smoothed": [r.val_accuracy_smoothed for r in ref],
        "schedule/learning_rate_factor": FACTORS,
        "perf/epoch_seconds": [e.seconds for e in recorder.of(EpochFinished)],
    }
    for tag, values in expectations.items():
        got = points(tag)
        assert [step for step, _ in got] == ends, tag
        for (_, value), want in zip(got, values, strict=True):
            assert value == pytest.approx(want, rel=1e-5, abs=1e-6), tag
    # checkpoint/seconds at its step boundary's global step: 4 steps per epoch before it.
    got = points("checkpoint/seconds")
    assert [step for step, _ in got] == [4 * c.epoch + c.steps_done for c in checkpoints]
    for (_, value), checkpoint in zip(got, checkpoints, strict=True):
        assert value == pytest.approx(checkpoint.seconds, rel=1e-5, abs=1e-6)
    epoch_points = set(points("epoch"))
    assert {(4, 0.0), (8, 1.0), (12, 2.0)} <= epoch_points
    sampled = points("train/loss_sampled")
    samples = [s for s in recorder.of(ProgressSampled) if s.loss is not None]
    assert [step for step, _ in sampled] == [s.total_steps for s in samples]
    for (_, value), sample in zip(sampled, samples, strict=True):
        assert value == pytest.approx(sample.loss, rel=1e-5)
    assert [step for step, _ in points("perf/examples_per_second")] == [
        s.total_steps for s in recorder.of(ProgressSampled)
    ]
    counted = [s for s in recorder.of(ProgressSampled) if s.steps > 0]
    for tag, field in (("perf/step_seconds", "seconds_per_step"), ("perf/communication_seconds", None)):
        got = points(tag)
        assert [step for step, _ in got] == [s.total_steps for s in counted], tag
        for (_, value), sample in zip(got, counted, strict=True):
            want = getattr(sample, field) if field else sample.communication_seconds_per_step
            assert value == pytest.approx(want, rel=1e-5, abs=1e-9), tag
    for sample in recorder.of(ProgressSampled):
        assert (sample.total_steps, float(sample.epoch)) in epoch_points  # the epoch in progress


# --------------------------------------------------------------------------- extras


@pytest.mark.parametrize(
    ("make", "package", "extra"),
    [
        (lambda: ProgressReporter(io.StringIO()), "rich", "progress"),
        (lambda path: TensorBoardReporter(path), "tensorboard", "tensorboard"),
        (lambda: PrometheusReporter(port=0), "prometheus_client", "prometheus"),
    ],
    ids=["progress", "tensorboard", "prometheus"],
)
def test_a_missing_extra_is_a_missing_dependency_error_when_the_reporter_is_made(
    make: Any, package: str, extra: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in list(sys.modules):
        if name == package or name.startswith(package + "."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, package, None)  # import fails
    with pytest.raises(MissingDependencyError) as caught:
        make(tmp_path) if make.__code__.co_argcount else make()
    assert isinstance(caught.value, ConfigurationError)
    assert f'pip install "lamploop[{extra}]"' in str(caught.value)


def test_reporters_empty_list_reports_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="lamploop")
    state = tiny_fit([], max_epochs=2)
    assert state.epoch == 2
    assert not [r for r in caplog.records if r.name == "lamploop" and "epoch" in r.getMessage()]
    assert math.isfinite(state.learning_curve[-1].training_loss)


# --------------------------------------------------------------------------- hand-fed reporters


def hand_state(epoch: int = 0, *, metrics: bool = True) -> lamploop.LoopState:
    entry = lamploop.LearningCurveEntry(
        epoch,
        0.5,
        validation_loss=(0.6, 0.7),
        training_metrics={"accuracy": 0.25} if metrics else {},
        validation_metrics={"accuracy": (0.3, 0.375)} if metrics else {},
        learning_rate_factor=0.5,
    )
    return lamploop.LoopState(epoch=epoch + 1, learning_curve=[entry])


def test_metrics_file_csv_header_rules(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="lamploop")
    breakdown = lamploop.StepBreakdown(steps=2, seconds=0.5, data_wait=0.1, forward_backward=0.2)
    full = ["epoch", "training_loss", "validation_loss", "validation_loss_smoothed", "learning_rate_factor"]
    full += ["seconds", "steps", "examples", *STEP_COLUMNS, "train_accuracy", "validation_accuracy"]

    # An existing header with more columns, every one of the row's among them: carried on.
    wider = tmp_path / "wider.csv"
    wider.write_text(",".join([*full, "notes"]) + "\n")
    reporter = MetricsFileReporter(wider)
    reporter.report(EpochFinished(hand_state(), seconds=2.0, steps=2, examples=32, step_breakdown=breakdown))
    reporter.close()
    reporter.close()  # again: nothing
    reporter.report(EpochFinished(hand_state(1), seconds=2.0, steps=2, examples=32))  # after close: nothing
    with wider.open(newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["epoch"] == "0"
    assert float(row["training_loss"]) == 0.5
    assert row["notes"] == ""
    assert float(row["validation_loss"]) == 0.7
    assert float(row["validation_loss_smoothed"]) == 0.6
    assert float(row["learning_rate_factor"]) == 0.5
    assert float(row["train_accuracy"]) == 0.25
    assert float(row["validation_accuracy"]) == 0.375
    assert float(row["step_seconds"]) == 0.5
    assert float(row["data_wait_seconds"]) == 0.1
    assert float(row["forward_backward_seconds"]) == 0.2

    # A header written before step breakdowns were: the step columns are left out.
    older = tmp_path / "older.csv"
    older.write_text(",".join(c for c in full if c not in STEP_COLUMNS) + "\n")
    reporter = MetricsFileReporter(older)
    reporter.report(EpochFinished(hand_state(), seconds=2.0, steps=2, examples=32, step_breakdown=breakdown))
    reporter.close()
    with older.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1
    assert "step_seconds" not in rows[0]
    assert float(rows[0]["training_loss"]) == 0.5

    # A later row with a column the header lacks: written without it, the loss logged once.
    fresh = tmp_path / "fresh.csv"
    reporter = MetricsFileReporter(fresh)
    reporter.report(EpochFinished(hand_state(0, metrics=False), seconds=1.0, steps=2, examples=32))
    caplog.clear()
    reporter.report(EpochFinished(hand_state(1), seconds=1.0, steps=2, examples=32))
    reporter.report(EpochFinished(hand_state(2), seconds=1.0, steps=2, examples=32))
    reporter.close()
    with fresh.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["epoch"] for row in rows] == ["0", "1", "2"]
    assert "train_accuracy" not in rows[0]
    mentions = [r for r in caplog.records if "train_accuracy" in r.getMessage()]
    assert len(mentions) == 1

    # An explicit format wins over the suffix.
    forced = tmp_path / "forced.csv"
    reporter = MetricsFileReporter(forced, format="jsonl")
    event = EpochFinished(hand_state(), seconds=1.0, steps=2, examples=32)
    reporter.report(event)
    reporter.close()
    (line,) = forced.read_text().splitlines()
    record = json.loads(line)
    assert record["epoch"] == 0
    assert record["time"] == event.time
    assert record["validation_accuracy"] == 0.375


def test_prometheus_hand_fed_counts_a_resumed_epoch_once_and_tracks_peers_and_state() -> None:
    from prometheus_client import CollectorRegistry

    from lamploop.reporting import PeerJoined, PeerLost

    reporter = PrometheusReporter(port=0, namespace="acc", registry=CollectorRegistry())
    other = PrometheusReporter(port=0)  # two in one process do not clash
    try:
        reporter.report(RunStarted(nranks=3, epoch=1, max_epochs=4))
        other.report(RunStarted(nranks=1, epoch=0, max_epochs=1))
        assert reporter.url != other.url
        values = scrape(reporter.url)
        assert metric(values, "acc_ranks") == 3.0
        assert metric(values, "acc_peers_alive") == 1.0
        assert metric(values, "acc_steps_total") == 0.0
        assert metric(values, "acc_run_state") == 0.0
        assert metric(values, "acc_loss") is None
        assert metric(values, "acc_validation_loss") is None
        since_start = metric(values, "acc_seconds_since_checkpoint")
        assert 0 <= since_start < 5
        time.sleep(0.3)
        assert (
            metric(scrape(reporter.url), "acc_seconds_since_checkpoint") >= since_start + 0.29
        )  # when scraped
        assert not [key for key in values if key[0].startswith("lamploop_")]

        reporter.report(PeerJoined(rank=1, nranks=3))
        reporter.report(PeerJoined(rank=2, nranks=3))
        assert metric(scrape(reporter.url), "acc_peers_alive") == 3.0

        # Epoch 1 resumes after 3 steps (48 examples).
        reporter.report(EpochStarted(epoch=1, learning_rate_factor=0.5, steps_done=3, examples_done=48))
        sample = ProgressSampled(1, 4, 64, 0.75, 1, 0.125, 0.03125, 160.0, total_steps=1, total_examples=16)
        reporter.report(sample)
        values = scrape(reporter.url)
        assert metric(values, "acc_epoch") == 1.0
        assert metric(values, "acc_learning_rate_factor") == 0.5
        assert metric(values, "acc_steps_total") == 1.0
        assert metric(values, "acc_examples_total") == 16.0
        assert metric(values, "acc_loss") == 0.75
        assert metric(values, "acc_step_seconds") == 0.125
        assert metric(values, "acc_communication_seconds") == 0.03125
        assert metric(values, "acc_examples_per_second") == 160.0
        reporter.report(ProgressSampled(1, 4, 64, None, 0, 0.0, 0.0, 0.0, total_steps=1, total_examples=16))
        assert metric(scrape(reporter.url), "acc_loss") == 0.75  # no step since: the loss stays

        reporter.report(CheckpointWritten(epoch=1, steps_done=4, path=None, seconds=0.25))
        reporter.report(ValidationFinished(epoch=1, loss=0.7))
        values = scrape(reporter.url)
        assert metric(values, "acc_checkpoints_total") == 1.0
        assert metric(values, "acc_checkpoint_seconds") == 0.25
        assert metric(values, "acc_seconds_since_checkpoint") < 0.29  # since the checkpoint now
        assert metric(values, "acc_validation_loss") == 0.7

        reporter.report(EpochFinished(hand_state(1), seconds=3.0, steps=6, examples=96))
        values = scrape(reporter.url)
        assert metric(values, "acc_steps_total") == 3.0  # 6 - 3 resumed: each step counted once
        assert metric(values, "acc_examples_total") == 48.0
        assert metric(values, "acc_epochs_total") == 1.0
        assert metric(values, "acc_epoch") == 2.0
        assert metric(values, "acc_epoch_training_loss") == 0.5
        assert metric(values, "acc_epoch_seconds") == 3.0
        assert metric(values, "acc_metric", split="train", name="accuracy") == 0.25
        assert metric(values, "acc_metric", split="validation", name="accuracy") == 0.375

        reporter.report(PeerLost(rank=2, how="died", message="connection reset"))
        reporter.report(RunStopped(reason="SIGTERM", message="after step 4"))
        values = scrape(reporter.url)
        assert metric(values, "acc_peers_alive") == 2.0
        assert metric(values, "acc_run_state") == 2.0
        other.report(RunFailed(error="RuntimeError: boom"))
        assert metric(scrape(other.url), "lamploop_run_state") == 3.0
    finally:
        reporter.close()
        other.close()
    reporter.close()  # again: nothing
    for url in (reporter.url, other.url):
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url, timeout=1)


def test_reporter_options_out_of_range_are_configuration_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError):
        ProgressReporter(io.StringIO(), refresh_per_second=0)
    with pytest.raises(ConfigurationError):
        ProgressReporter(io.StringIO(), refresh_per_second=-1.0)
    with pytest.raises(ConfigurationError):
        TensorBoardReporter(tmp_path / "tb", flush_secs=0)


def test_logging_reporter_levels_hand_fed(caplog: pytest.LogCaptureFixture) -> None:
    from lamploop.reporting import PeerLost

    logger = logging.getLogger("acceptance.reporting")
    caplog.set_level(logging.DEBUG, logger="acceptance.reporting")
    reporter = LoggingReporter(logger, level=logging.DEBUG)
    reporter.report(RunStarted(nranks=1, epoch=0, max_epochs=2))
    reporter.report(ProgressSampled(0, 1, 32, 0.9, 1, 0.01, 0.0, 3200.0, total_steps=1, total_examples=32))
    reporter.report(EpochFinished(hand_state(), seconds=1.5, steps=4, examples=128))
    reporter.report(PeerLost(rank=1, how="silent", message="no heartbeat"))
    reporter.report(RunFailed(error="RuntimeError: boom"))
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "acceptance.reporting"]
    levels = [level for level, _ in records]
    assert levels[0] == logging.DEBUG
    epoch_lines = [message for level, message in records if message.startswith("epoch 0: ")]
    assert len(epoch_lines) == 1
    assert epoch_lines[0].startswith(
        "epoch 0: train loss 0.5000, validation loss 0.7000 (smoothed 0.6000), train accuracy 0.2500, "
        "validation accuracy 0.3750 (smoothed 0.3000)"
    )
    assert [level for level, message in records if message.startswith("epoch 0: ")] == [logging.DEBUG]
    assert logging.WARNING in levels
    assert logging.ERROR in levels
    assert any("boom" in message for level, message in records if level == logging.ERROR)
    assert not any("3200" in message for _, message in records)  # progress samples are not logged


def test_progress_reporter_plain_lines_are_quiet_inside_an_epoch() -> None:
    out = io.StringIO()
    reporter = ProgressReporter(out, terminal=False)
    reporter.report(RunStarted(nranks=1, epoch=0, max_epochs=2, time=100.0))
    reporter.report(EpochStarted(epoch=0, learning_rate_factor=1.0, time=100.0))

    def sample(at: float, steps_done: int) -> ProgressSampled:
        return ProgressSampled(
            0, steps_done, 32 * steps_done, 0.9, 1, 0.01, 0.0, 3200.0, steps_done, 32, time=at
        )

    reporter.report(sample(101.0, 1))
    reporter.report(sample(120.0, 2))
    assert len(out.getvalue().splitlines()) == 1  # under 30 s since the last line: nothing
    reporter.report(sample(131.0, 3))
    assert len(out.getvalue().splitlines()) == 2  # 30 s passed: one line
    reporter.report(sample(140.0, 4))
    assert len(out.getvalue().splitlines()) == 2
    reporter.report(EpochFinished(hand_state(), seconds=2.0, steps=10, examples=640, time=141.0))
    reporter.report(RunFailed(error="RuntimeError: boom", time=142.0))  # only stops the display
    reporter.close()
    reporter.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert "\x1b" not in out.getvalue()
    assert lines[0] == "training on 1 rank(s) from epoch 0 to 2"
    assert lines[2].startswith("epoch 0: train loss 0.5000, validation loss 0.7000 (smoothed 0.6000)")
    assert "(2.0 s, 320 examples/s" in lines[2]


def test_progress_reporter_on_a_terminal_prints_the_epoch_lines_above_the_bars() -> None:
    out = io.StringIO()
    reporter = ProgressReporter(out, terminal=True)
    reporter.report(RunStarted(nranks=1, epoch=0, max_epochs=2, time=100.0))
    reporter.report(EpochStarted(epoch=0, learning_rate_factor=1.0, time=100.0))
    reporter.report(ProgressSampled(0, 1, 32, 0.9, 1, 0.01, 0.0, 3200.0, 1, 32, time=100.5))
    reporter.report(EpochFinished(hand_state(), seconds=2.0, steps=10, examples=640, time=102.0))
    reporter.report(RunFinished(hand_state(), time=102.5))
    reporter.close()
    text = out.getvalue()
    assert "training on 1 rank(s) from epoch 0 to 2" in text
    assert "epoch 0: train loss 0.5000, validation loss 0.7000 (smoothed 0.6000)" in text
    assert "finished after epoch 0" in text
