"""Acceptance tests, from the documentation alone, of the API pages ``lamploop.settings``,
``lamploop.state``, ``lamploop.schedules.step`` / ``.torch_scheduler``, ``lamploop.errors``,
``lamploop.sync`` (with ``lamploop.sync.strategy``) and of docs/observability.md, with
DESIGN.md as the contract behind them.

The API pages are mkdocstrings pages: what they show is the modules' docstrings (and the
names their ``__all__`` re-exports), read here, never the code.  References are computed
apart from lamploop: plain PyTorch training loops in float64, the formulas the docstrings
give, PyTorch's own ``torch.optim.lr_scheduler`` stepped by hand, TensorBoard's event reader,
raw ``urllib`` scrapes of the Prometheus endpoint.  Several ranks are real processes: a
``ProcessGroupGloo`` over a ``TCPStore`` on 127.0.0.1 for the sync page, ``fit(world_size=2)``
for the observability page.
"""

from __future__ import annotations

import builtins
import csv
import io
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch
from support import free_port

import lamploop
from lamploop import errors
from lamploop.errors import (
    BatchError,
    CheckpointError,
    ConfigurationError,
    DistributedError,
    LamploopError,
    MissingDependencyError,
    NonFiniteLossError,
    TrainingInterrupted,
)
from lamploop.loop.profiler import Profile
from lamploop.loop.step_timing import StepBreakdown, StepTimes
from lamploop.reporting import (
    LoggingReporter,
    MetricsFileReporter,
    ProgressReporter,
    PrometheusReporter,
    TensorBoardReporter,
)
from lamploop.reporting.events import (
    CheckpointWritten,
    EpochFinished,
    EpochStarted,
    PeerJoined,
    PeerLost,
    ProgressSampled,
    RunFailed,
    RunFinished,
    RunStarted,
    RunStopped,
    ValidationFinished,
)
from lamploop.reporting.logging_reporter import describe_step_breakdown
from lamploop.schedules.step import (
    StepSchedule,
    check_step_factor,
    check_step_schedule,
    warmup_cosine,
    warmup_linear,
)
from lamploop.schedules.torch_scheduler import LR_SCHEDULER_KEY, check_interval, make_lr_scheduler
from lamploop.settings import (
    DEFAULT_BUCKET_CAP_MB,
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    LocalSettingKeywords,
    RankSettingKeywords,
    SettingKeywords,
    TrainingSettings,
    check_int,
    check_positive,
    check_seconds,
    check_smoothing,
    merged_settings,
)
from lamploop.state import (
    LearningCurveEntry,
    LoopState,
    LoopStateWithModelAndOptimizerData,
    converter,
)
from lamploop.sync import AUTO, SingleProcessChannel, strategy_named, strategy_names
from lamploop.sync.strategy import (
    check_saved_state,
    check_strategy_name,
    keeps_state,
    optimizer_state_per_rank,
)

ROOT = Path(__file__).resolve().parent.parent
F64 = torch.float64

# ------------------------------------------------------------------------------ references


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator, dtype=F64)
    y = (x[:, 0] - 0.5 * x[:, 1] > 0).long()
    return x, y


def _module(seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 2).double()


def _clone(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _mean_ce(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(module(x).double(), y, reduction="sum")) / len(x)


def _accuracy(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((module(x).argmax(dim=1) == y).double().mean())


def _reference_run(
    init: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    xv: torch.Tensor,
    yv: torch.Tensor,
    *,
    epochs: int,
    lr: float,
    batch: int,
    a: float,
    factors: list[float],
    validate: Callable[[int], bool],
) -> dict[str, Any]:
    """Plain PyTorch, one rank, batches in order: what DESIGN.md section 3 says a run measures."""
    module = torch.nn.Linear(4, 2).double()
    module.load_state_dict(init)
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    curve: list[dict[str, Any]] = []
    smoothed: float | None = None
    smoothed_accuracy: float | None = None
    first_batch_losses: list[float] = []
    for epoch in range(epochs):
        for group in optimizer.param_groups:
            group["lr"] = lr * factors[epoch]
        loss_total, correct, count = 0.0, 0.0, 0
        for start in range(0, len(x), batch):
            xb, yb = x[start : start + batch], y[start : start + batch]
            out = module(xb)
            loss_sum = torch.nn.functional.cross_entropy(out, yb, reduction="sum")
            if start == 0:
                first_batch_losses.append(loss_sum.item() / len(xb))
            correct += float((out.argmax(dim=1) == yb).sum())
            optimizer.zero_grad()
            (loss_sum / len(xb)).backward()
            optimizer.step()
            loss_total += loss_sum.item()
            count += len(xb)
        entry: dict[str, Any] = {"training_loss": loss_total / count, "training_accuracy": correct / count}
        if validate(epoch):
            raw = _mean_ce(module, xv, yv)
            raw_accuracy = _accuracy(module, xv, yv)
            smoothed = raw if smoothed is None else raw * a + smoothed * (1 - a)
            smoothed_accuracy = (
                raw_accuracy if smoothed_accuracy is None else raw_accuracy * a + smoothed_accuracy * (1 - a)
            )
            entry["validation"] = (smoothed, raw)
            entry["validation_accuracy"] = (smoothed_accuracy, raw_accuracy)
        else:
            entry["validation"] = None
        curve.append(entry)
    return {"curve": curve, "first_batch_losses": first_batch_losses}


class Recorder:
    """A custom reporter (docs/how-to/custom-reporters.md): keeps every event."""

    def __init__(self, on_event: Callable[[Any], None] | None = None) -> None:
        self.events: list[Any] = []
        self.started = 0
        self.closed = 0
        self.on_event = on_event

    def start(self) -> None:
        self.started += 1

    def report(self, event: Any) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(event)

    def close(self) -> None:
        self.closed += 1


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip() or "_created" in line:
            continue
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    return values


def _sgd(lr: float) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda params: torch.optim.SGD(params, lr=lr)


# ------------------------------------------------------------------ one observed run (module)

N_TRAIN, N_VALID, BATCH, EPOCHS, SMOOTHING, LR = 50, 20, 16, 3, 0.5, 0.2
STEPS_PER_EPOCH = math.ceil(N_TRAIN / BATCH)  # 16, 16, 16, 2


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One 3-epoch run heard by every in-process reporter the observability page lists."""
    directory = tmp_path_factory.mktemp("observed")
    x, y = _data(N_TRAIN + N_VALID, seed=11)
    module = _module()
    init = _clone(module)
    prometheus = PrometheusReporter(port=0)
    scrapes: dict[str, list[dict[str, float]]] = {}

    def scrape_now(event: Any) -> None:
        if isinstance(event, (RunStarted, RunFinished, EpochFinished)):
            scrapes.setdefault(type(event).__name__, []).append(_scrape(prometheus.url))

    recorder = Recorder(scrape_now)
    logger = logging.getLogger("acceptance.observability.observed")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    handler = ListHandler()
    logger.addHandler(handler)
    learning_rates: list[float] = []

    def optimizer_factory(params: Any) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(params, lr=LR)
        optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: learning_rates.append(opt.param_groups[0]["lr"])
        )
        return optimizer

    try:
        state = lamploop.fit(
            model=lamploop.SupervisedModel(module, metrics={"accuracy": lamploop.metrics.accuracy}),
            optimizer_factory=optimizer_factory,
            train_batches=lamploop.tensor_batches(x[:N_TRAIN], y[:N_TRAIN], batch_size=BATCH, shuffle=False),
            validation_batches=lamploop.tensor_batches(x[N_TRAIN:], y[N_TRAIN:], batch_size=8, shuffle=False),
            max_epochs=EPOCHS,
            learning_rate_schedule=lamploop.schedules.decrement(every=1, fraction=0.5),
            validation_loss_exponential_smoothing_factor=SMOOTHING,
            checkpoint_dir=directory / "checkpoints",
            device="cpu",
            reporters=[
                prometheus,
                recorder,
                MetricsFileReporter(directory / "curve.csv"),
                MetricsFileReporter(directory / "curve.jsonl"),
                TensorBoardReporter(directory / "tensorboard"),
                LoggingReporter(logger=logger, level=logging.INFO),
            ],
        )
    finally:
        logger.removeHandler(handler)
    factors = [0.5**epoch for epoch in range(EPOCHS)]  # decrement: fraction ** (epoch // every)
    reference = _reference_run(
        init,
        x[:N_TRAIN],
        y[:N_TRAIN],
        x[N_TRAIN:],
        y[N_TRAIN:],
        epochs=EPOCHS,
        lr=LR,
        batch=BATCH,
        a=SMOOTHING,
        factors=factors,
        validate=lambda epoch: True,
    )
    return {
        "state": state,
        "directory": directory,
        "events": recorder.events,
        "recorder": recorder,
        "scrapes": scrapes,
        "prometheus": prometheus,
        "records": handler.records,
        "learning_rates": learning_rates,
        "reference": reference,
        "factors": factors,
    }


# ============================================================================ settings page


def test_settings_defaults() -> None:
    """settings: ``TrainingSettings(max_epochs=3, accumulate_gradient_over_n_batches=2).strategy``
    gives ``'auto'``; ``bucket_cap_mb``/``collective_timeout`` default to the module's
    DEFAULT_* (collective timeout 1800 s, "the backstop"); fit's docstring: ``"raise"``
    (default), ``precision`` ``"32"`` (default), ``lr_scheduler_interval`` ``"epoch"``
    (default), ``max_gradient_norm`` ``None``: no clipping."""
    assert TrainingSettings(max_epochs=3, accumulate_gradient_over_n_batches=2).strategy == "auto"
    settings = TrainingSettings()
    assert settings.max_epochs == 0
    assert settings.validation_frequency == 1
    assert settings.validation_loss_exponential_smoothing_factor == 1.0
    assert settings.accumulate_gradient_over_n_batches == 1
    assert settings.bucket_cap_mb == DEFAULT_BUCKET_CAP_MB == 25.0
    assert settings.collective_timeout == DEFAULT_COLLECTIVE_TIMEOUT_S == 1800.0
    assert (DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TIMEOUT_S) == (0.5, 4.0)
    assert settings.on_non_finite_loss == "raise"
    assert settings.precision == "32"
    assert settings.lr_scheduler_interval == "epoch"
    assert settings.model_selection_mode == "min"
    assert settings.max_gradient_norm is None
    assert settings.checkpoint_every_n_steps is settings.checkpoint_every_seconds is None
    assert settings.step_schedule is settings.lr_scheduler is settings.averaging is None
    assert settings.profile is None
    assert settings.early_stopping_patience is None
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        settings.max_epochs = 4  # type: ignore[misc]


def test_settings_doctest_message() -> None:
    """settings: ``TrainingSettings(max_epochs=-1)`` raises
    ``lamploop.errors.ConfigurationError: max_epochs must be an int >= 0, got -1``."""
    with pytest.raises(ConfigurationError) as raised:
        TrainingSettings(max_epochs=-1)
    assert str(raised.value) == "max_epochs must be an int >= 0, got -1"
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_epochs", True),
        ("max_epochs", 2.0),
        ("validation_frequency", 0),
        ("validation_loss_exponential_smoothing_factor", 0.0),
        ("validation_loss_exponential_smoothing_factor", 1.5),
        ("accumulate_gradient_over_n_batches", 0),
        ("strategy", "no_such_strategy"),
        ("bucket_cap_mb", 0),
        ("bucket_cap_mb", math.nan),
        ("collective_timeout", -1.0),
        ("collective_timeout", math.inf),
        ("checkpoint_every_n_steps", 0),
        ("checkpoint_every_seconds", 0.0),
        ("on_non_finite_loss", "ignore"),
        ("max_gradient_norm", -1.0),
        ("precision", "16"),
        ("step_schedule", 5),
        ("lr_scheduler_interval", "batch"),
        ("model_selection_mode", "median"),
        ("early_stopping_patience", 0),
        ("profile", "traces"),
        ("return_min_validation_loss_model", 3),
        ("learning_rate_schedule", 0.5),
    ],
)
def test_settings_out_of_range_names_the_argument(field: str, value: object) -> None:
    """settings, TrainingSettings: "Raises: ConfigurationError: a value is out of range; the
    message names the argument." (``validation_loss_exponential_smoothing_factor``: ``a`` in
    ``smoothed = raw * a + previous * (1 - a)``; ``check_smoothing``: "in ``(0, 1]``".)"""
    with pytest.raises(ConfigurationError) as raised:
        TrainingSettings(**{field: value})
    assert field in str(raised.value)


def test_check_helpers() -> None:
    """settings (re-exported): ``check_int``: "``value`` if it is an int (not a bool) ``>= low``,
    else ConfigurationError naming ``name``"; ``check_positive``/``check_seconds``: "a positive
    finite number"; ``check_smoothing``: "in ``(0, 1]``"."""
    assert check_int("count", 3, 1) == 3
    for bad in (True, 0, 2.5):
        with pytest.raises(ConfigurationError, match="count"):
            check_int("count", bad, 1)
    assert check_positive("size", 0.5) == 0.5
    assert check_seconds("wait", 2) == 2.0
    for bad in (0, -1.0, math.inf, math.nan, "1"):
        with pytest.raises(ConfigurationError, match="size"):
            check_positive("size", bad)
        with pytest.raises(ConfigurationError, match="wait"):
            check_seconds("wait", bad)
    assert check_smoothing(1.0) == 1.0
    assert check_smoothing(0.25) == 0.25
    for bad in (0.0, 1.0000001, -0.5):
        with pytest.raises(ConfigurationError):
            check_smoothing(bad)


def test_every_rank_fingerprint() -> None:
    """settings, every_rank_fingerprint: "The EVERY_RANK settings as one string that the ranks
    compare ... Numbers, strings and frozen attrs values (schedules) by value; a function (an
    ``lr_scheduler`` factory, a step schedule of your own) by whether it is set." """
    base = TrainingSettings(strategy="all_reduce", bucket_cap_mb=4.0)
    same = TrainingSettings(strategy="all_reduce", bucket_cap_mb=4.0, max_epochs=9, validation_frequency=3)
    assert base.every_rank_fingerprint() == same.every_rank_fingerprint()  # not EVERY_RANK fields
    assert (
        base.every_rank_fingerprint()
        != attrs.evolve(base, strategy="reduce_to_root").every_rank_fingerprint()
    )
    assert base.every_rank_fingerprint() != attrs.evolve(base, bucket_cap_mb=8.0).every_rank_fingerprint()
    one = attrs.evolve(base, step_schedule=warmup_linear(warmup_steps=1, total_steps=8, steps_per_epoch=4))
    alike = attrs.evolve(base, step_schedule=warmup_linear(warmup_steps=1, total_steps=8, steps_per_epoch=4))
    other = attrs.evolve(base, step_schedule=warmup_linear(warmup_steps=2, total_steps=8, steps_per_epoch=4))
    assert one.every_rank_fingerprint() == alike.every_rank_fingerprint()
    assert one.every_rank_fingerprint() != other.every_rank_fingerprint()
    first = attrs.evolve(base, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1))
    second = attrs.evolve(base, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 7))
    assert first.every_rank_fingerprint() == second.every_rank_fingerprint()
    assert first.every_rank_fingerprint() != base.every_rank_fingerprint()


def test_for_every_rank_and_keyword_typed_dicts() -> None:
    """settings: ``for_every_rank``: "The EVERY_RANK settings as keyword arguments";
    ``LocalSettingKeywords``: "every rank's and the root's choices"; ``SettingKeywords``: "all
    of the above and the checkpoint cadence"."""
    settings = TrainingSettings(strategy="reduce_to_root", max_gradient_norm=2.0, precision="bf16")
    as_keywords = settings.for_every_rank()
    assert set(as_keywords) == set(TrainingSettings.EVERY_RANK)
    assert all(as_keywords[name] == getattr(settings, name) for name in TrainingSettings.EVERY_RANK)
    fields = {field.name for field in attrs.fields(TrainingSettings)}
    rank = set(RankSettingKeywords.__annotations__)
    local = set(LocalSettingKeywords.__annotations__)
    driver = set(SettingKeywords.__annotations__)
    assert rank <= set(TrainingSettings.EVERY_RANK)
    assert rank < local < driver <= fields
    assert {"averaging", "model_selection_metric", "model_selection_mode", "early_stopping_patience"} <= (
        local - rank
    )
    assert driver - local == {"checkpoint_every_n_steps", "checkpoint_every_seconds"}


def test_from_arguments_picks_by_name() -> None:
    """settings, from_arguments: "The settings among a public function's arguments
    (``locals()``), picked by name." """
    settings = TrainingSettings.from_arguments(
        {"max_epochs": 4, "strategy": "reduce_to_root", "model": object(), "checkpoint_dir": "x"}
    )
    assert (settings.max_epochs, settings.strategy) == (4, "reduce_to_root")
    assert settings.validation_frequency == 1


def _driver(*, max_epochs: int, validation_frequency: int = 1, settings: Any = None, **keywords: Any) -> None:
    """A lower-level entry point's shape: lamp's keywords, ``settings=``, ``**keywords``."""


def _merge(**given: Any) -> TrainingSettings:
    arguments = {"max_epochs": 3, "validation_frequency": 1, "settings": None, "keywords": {}}
    arguments.update(given)
    return merged_settings(_driver, arguments, SettingKeywords)


def test_merged_settings_refusals_name_what_is_wrong() -> None:
    """settings, merged_settings: "Raises: ConfigurationError: an unknown keyword (named, with
    the function), a setting given both as a keyword and in ``settings=``, ``settings`` not a
    TrainingSettings, or a value out of range." """
    with pytest.raises(ConfigurationError) as unknown:
        _merge(keywords={"bucket_cap": 4})
    assert "bucket_cap" in str(unknown.value)
    assert "_driver" in str(unknown.value)
    with pytest.raises(ConfigurationError) as both:
        _merge(keywords={"strategy": "all_reduce"}, settings=TrainingSettings(strategy="reduce_to_root"))
    assert "strategy" in str(both.value)
    with pytest.raises(ConfigurationError, match="settings"):
        _merge(settings={"strategy": "all_reduce"})
    with pytest.raises(ConfigurationError, match="bucket_cap_mb"):
        _merge(keywords={"bucket_cap_mb": -1})
    assert _merge(keywords={"strategy": "reduce_to_root"}).strategy == "reduce_to_root"


def test_merged_settings_lamp_keywords() -> None:
    """settings, merged_settings: "A lamp keyword counts as given when it differs from the
    function's default (a required one always does); with ``settings=`` it must then agree with
    the settings' value unless that is TrainingSettings' default, and one left at its default
    takes the settings' value." """
    assert _merge(settings=TrainingSettings(validation_frequency=2)).validation_frequency == 2
    assert (
        _merge(settings=TrainingSettings(validation_frequency=2), validation_frequency=2).validation_frequency
        == 2
    )
    with pytest.raises(ConfigurationError, match="validation_frequency"):
        _merge(settings=TrainingSettings(validation_frequency=2), validation_frequency=3)
    with pytest.raises(ConfigurationError, match="max_epochs"):  # required: always given
        _merge(settings=TrainingSettings(max_epochs=5))
    merged = _merge(settings=TrainingSettings(max_epochs=0), max_epochs=4, validation_frequency=3)
    assert (merged.max_epochs, merged.validation_frequency) == (4, 3)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_local_loop_refuses_a_setting_given_twice() -> None:
    """settings (module doc): the lower-level entry points "take everything beyond lamp as one
    ``settings=`` object; the settings keywords they took before it are still accepted";
    merged_settings: a setting given both ways is a ConfigurationError naming it."""
    x, y = _data(16, seed=1)
    batches = lamploop.tensor_batches(x, y, batch_size=8)
    replicas = [(lamploop.SupervisedModel(_module()), batches, None) for _ in range(2)]
    with pytest.raises(ConfigurationError) as raised:
        anyio.run(
            lambda: lamploop.local_data_parallel_training_loop(
                replicas,
                _sgd(0.1),
                1,
                strategy="all_reduce",
                settings=TrainingSettings(max_epochs=1, strategy="reduce_to_root"),
            )
        )
    assert "strategy" in str(raised.value)


# =============================================================================== state page


def test_loop_state_defaults_frozen_and_curve_tuple() -> None:
    """state: "All three classes are frozen attrs classes: a new epoch makes a new value";
    LoopState.epoch: "the next epoch to run (0 for a fresh run)"; learning_curve: "one entry
    per finished epoch, oldest first" (a tuple, DESIGN.md section 2)."""
    state = LoopState()
    assert (state.epoch, state.last_validation_loss, state.min_validation_loss) == (0, None, None)
    assert state.min_validation_epoch is None
    assert state.learning_curve == ()
    entries = [LearningCurveEntry(0, 0.5), LearningCurveEntry(1, 0.25)]
    state = LoopState(epoch=2, learning_curve=entries)
    assert isinstance(state.learning_curve, tuple)
    assert list(state.learning_curve) == entries
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        state.epoch = 3  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        entries[0].training_loss = 1.0  # type: ignore[misc]
    data = LoopStateWithModelAndOptimizerData(loop_state=state, model={}, optimizer={})
    assert (data.best_model, data.averaged_model, data.averaged_count) == ({}, {}, 0)


def test_learning_curve_entry_fields() -> None:
    """state, LearningCurveEntry: "validation_loss: ``(smoothed, raw)`` ... or ``None`` when
    validation did not run"; "learning_rate_factor ... informational, so left out of ``==``"."""
    entry = LearningCurveEntry(0, 0.5)
    assert entry.validation_loss is None
    assert entry.training_metrics == {}
    assert entry.validation_metrics == {}
    assert entry.learning_rate_factor is None
    paired = LearningCurveEntry(
        2,
        0.5,
        validation_loss=[0.6, 0.7],
        validation_metrics={"accuracy": [0.8, 0.9]},
        learning_rate_factor=1,
    )
    assert paired.validation_loss == (0.6, 0.7)
    assert isinstance(paired.validation_loss, tuple)
    assert paired.validation_metrics["accuracy"] == (0.8, 0.9)
    assert paired == attrs.evolve(paired, learning_rate_factor=0.125)
    assert paired != attrs.evolve(paired, training_loss=0.51)


def test_converter_round_trip_json() -> None:
    """state, converter: "``converter.unstructure(loop_state)`` gives a dict for
    ``json.dumps``; ``converter.structure(d, LoopState)`` reads it back" (a
    ``cattrs.Converter(forbid_extra_keys=True)``)."""
    curve = (
        LearningCurveEntry(0, 0.9, validation_loss=(0.8, 0.8), training_metrics={"accuracy": 0.5}),
        LearningCurveEntry(
            1,
            0.7,
            validation_loss=(0.75, 0.7),
            validation_metrics={"accuracy": (0.6, 0.7)},
            learning_rate_factor=0.5,
        ),
    )
    state = LoopState(
        epoch=2,
        last_validation_loss=0.75,
        min_validation_loss=0.75,
        min_validation_epoch=1,
        learning_curve=curve,
    )
    text = json.dumps(converter.unstructure(state))
    back = converter.structure(json.loads(text), LoopState)
    assert back == state
    assert back.learning_curve[1].learning_rate_factor == 0.5
    old = {"epoch": 1, "learning_curve": [{"epoch": 0, "training_loss": 0.5, "validation_loss": None}]}
    before_0_3 = converter.structure(old, LoopState)  # entries written before lamploop 0.3
    assert before_0_3.learning_curve[0].learning_rate_factor is None
    assert before_0_3.learning_curve[0].training_metrics == {}
    extra = json.loads(text) | {"surprise": 1}
    with pytest.raises(Exception):  # noqa: B017, PT011 - cattrs' own error class is not documented
        converter.structure(extra, LoopState)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_learning_curve_matches_reference(observed: dict[str, Any]) -> None:
    """state, LearningCurveEntry: "training_loss: mean training loss over every example of every
    rank"; "validation_loss: (smoothed, raw)"; "validation_metrics: each metric's (smoothed, raw)
    validation value, smoothed like the loss"; LoopState: "min_validation_loss: the smallest
    smoothed validation loss seen in an epoch eligible for model selection"; settings:
    ``smoothed = raw * a + previous * (1 - a)``."""
    state: LoopState = observed["state"]
    reference = observed["reference"]["curve"]
    assert state.epoch == EPOCHS
    assert len(state.learning_curve) == EPOCHS
    for epoch, (entry, expected) in enumerate(zip(state.learning_curve, reference, strict=True)):
        assert entry.epoch == epoch
        assert entry.training_loss == pytest.approx(expected["training_loss"], rel=1e-9)
        assert entry.training_metrics["accuracy"] == pytest.approx(expected["training_accuracy"], rel=1e-9)
        assert entry.validation_loss == pytest.approx(expected["validation"], rel=1e-9)
        assert entry.validation_metrics["accuracy"] == pytest.approx(
            expected["validation_accuracy"], rel=1e-9
        )
        assert entry.learning_rate_factor == pytest.approx(observed["factors"][epoch])
    smoothed = [expected["validation"][0] for expected in reference]
    assert state.last_validation_loss == pytest.approx(smoothed[-1], rel=1e-9)
    assert state.min_validation_loss == pytest.approx(min(smoothed), rel=1e-9)
    assert state.min_validation_epoch == smoothed.index(min(smoothed))


def test_last_smoothed_loss_carries_over_epochs_without_validation() -> None:
    """state, LoopState: "last_validation_loss: the latest smoothed validation loss, carried over
    epochs in which validation does not run"; settings: "validation_frequency: validate in epochs
    ``e`` with ``e % frequency == 0``"; LearningCurveEntry.validation_loss ``None`` when
    validation did not run."""
    x, y = _data(40, seed=5)
    module = _module(seed=8)
    init = _clone(module)
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=_sgd(0.3),
        train_batches=lamploop.tensor_batches(x[:28], y[:28], batch_size=10, shuffle=False),
        validation_batches=lamploop.tensor_batches(x[28:], y[28:], batch_size=12, shuffle=False),
        max_epochs=4,
        validation_frequency=2,
        validation_loss_exponential_smoothing_factor=0.3,
        device="cpu",
        reporters=[],
    )
    reference = _reference_run(
        init,
        x[:28],
        y[:28],
        x[28:],
        y[28:],
        epochs=4,
        lr=0.3,
        batch=10,
        a=0.3,
        factors=[1.0] * 4,
        validate=lambda epoch: epoch % 2 == 0,
    )["curve"]
    assert [entry.validation_loss is None for entry in state.learning_curve] == [False, True, False, True]
    for entry, expected in zip(state.learning_curve, reference, strict=True):
        assert entry.training_loss == pytest.approx(expected["training_loss"], rel=1e-9)
        if expected["validation"] is not None:
            assert entry.validation_loss == pytest.approx(expected["validation"], rel=1e-9)
    assert state.last_validation_loss == pytest.approx(reference[2]["validation"][0], rel=1e-9)


# ====================================================================== step schedules page


def _warmup_then(kind: str, g: int, warmup: int, total: int, final: float) -> float:
    """The module's doctest and docstrings: linear warm-up ((g + 1) / warmup in the doctest),
    then from 1 at ``warmup`` to ``final`` at ``total_steps`` (and after)."""
    if g < warmup:
        return (g + 1) / warmup
    progress = min(1.0, (g - warmup) / (total - warmup))
    if kind == "linear":
        return 1.0 + (final - 1.0) * progress
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def test_warmup_linear_doctest() -> None:
    """step: ``warmup_linear(warmup_steps=2, total_steps=6, steps_per_epoch=3)`` gives
    ``[0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0]``; "Schedules count a global step
    ``epoch * steps_per_epoch + step``"."""
    schedule = warmup_linear(warmup_steps=2, total_steps=6, steps_per_epoch=3)
    assert [round(schedule.factor(e, s), 3) for e in range(3) for s in range(3)] == [
        0.5,
        1.0,
        1.0,
        0.75,
        0.5,
        0.25,
        0.0,
        0.0,
        0.0,
    ]
    assert isinstance(schedule, StepSchedule)


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_warmup_decay_formula(kind: str) -> None:
    """step: WarmupCosine: "Linear warm-up, then a half cosine from 1 down to ``final`` at
    ``total_steps`` (and after)"; WarmupLinear: "... a straight line from 1 down to ``final``
    at ``total_steps`` (and after)"; "A step schedule is a pure function of ``(epoch, step)``"."""
    make = warmup_linear if kind == "linear" else warmup_cosine
    schedule = make(warmup_steps=3, total_steps=13, steps_per_epoch=5, final=0.1)
    for epoch in range(4):
        for step in range(5):
            expected = _warmup_then(kind, epoch * 5 + step, 3, 13, 0.1)
            assert schedule.factor(epoch, step) == pytest.approx(expected, abs=1e-12)
            assert schedule.factor(epoch, step) == schedule.factor(epoch, step)
    assert schedule.factor(2, 3) == pytest.approx(0.1)  # global step 13 = total_steps
    assert schedule.factor(9, 0) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"warmup_steps": 5, "total_steps": 4, "steps_per_epoch": 2}, "warmup_steps"),
        ({"warmup_steps": -1, "total_steps": 4, "steps_per_epoch": 2}, "warmup_steps"),
        ({"warmup_steps": 1, "total_steps": 0, "steps_per_epoch": 2}, "total_steps"),
        ({"warmup_steps": 1, "total_steps": 4, "steps_per_epoch": 0}, "steps_per_epoch"),
        ({"warmup_steps": 1.5, "total_steps": 4, "steps_per_epoch": 2}, "warmup_steps"),
    ],
)
def test_step_schedule_bad_counts(arguments: dict[str, Any], named: str) -> None:
    """step, warmup_cosine / warmup_linear: "Raises: ConfigurationError: a count out of range or
    ``warmup_steps > total_steps``"; errors: "Each message names the offending value"."""
    for make in (warmup_linear, warmup_cosine):
        with pytest.raises(ConfigurationError) as raised:
            make(**arguments)
        assert named in str(raised.value)


def test_check_step_schedule_names_an_epoch_schedule() -> None:
    """step, check_step_schedule: "ConfigurationError naming ``name`` unless ``value`` has
    ``factor(epoch, step)``. An epoch schedule ... passed as a step schedule is named as one,
    before training starts"."""
    check_step_schedule("step_schedule", warmup_cosine(warmup_steps=0, total_steps=3, steps_per_epoch=1))
    with pytest.raises(ConfigurationError) as raised:
        check_step_schedule("step_schedule", lamploop.schedules.decrement(every=1, fraction=0.5))
    assert "step_schedule" in str(raised.value)
    assert "epoch schedule" in str(raised.value)
    with pytest.raises(ConfigurationError, match="my_schedule"):
        check_step_schedule("my_schedule", 3)


def test_check_step_factor() -> None:
    """step, check_step_factor: "``schedule``'s factor for the step, which must be a finite
    number >= 0"."""

    class Fixed:
        def __init__(self, value: object) -> None:
            self.value = value

        def factor(self, epoch: int, step: int) -> object:
            return self.value

    assert check_step_factor(Fixed(0.0), 1, 2) == 0.0  # type: ignore[arg-type]
    assert check_step_factor(Fixed(2.5), 1, 2) == 2.5  # type: ignore[arg-type]
    for bad in (math.nan, -0.1, math.inf, "x"):
        with pytest.raises(LamploopError) as raised:
            check_step_factor(Fixed(bad), 1, 2)  # type: ignore[arg-type]
        assert isinstance(raised.value, ValueError)
        assert "epoch 1" in str(raised.value)
        assert "step 2" in str(raised.value)


def test_fit_step_rate_is_base_times_epoch_times_step_factor() -> None:
    """step (module doc): "the learning rate of a step is ``base_lr * epoch_factor *
    step_factor``"; ``steps_per_epoch`` is the number of optimizer steps of a full epoch."""
    x, y = _data(40, seed=2)
    rates: list[float] = []

    def factory(params: Any) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(params, lr=0.8)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: rates.append(opt.param_groups[0]["lr"]))
        return optimizer

    schedule = warmup_linear(warmup_steps=2, total_steps=9, steps_per_epoch=4)
    lamploop.fit(
        model=lamploop.SupervisedModel(_module()),
        optimizer_factory=factory,
        train_batches=lamploop.tensor_batches(x, y, batch_size=10, shuffle=False),  # 4 steps
        max_epochs=3,
        learning_rate_schedule=lamploop.schedules.step_after(steps=1, factor=0.5),
        step_schedule=schedule,
        device="cpu",
        reporters=[],
    )
    expected = [
        0.8 * (1.0 if epoch < 1 else 0.5) * _warmup_then("linear", epoch * 4 + step, 2, 9, 0.0)
        for epoch in range(3)
        for step in range(4)
    ]
    assert rates == pytest.approx(expected, abs=1e-12)


def test_lr_scheduler_key_and_interval() -> None:
    """torch_scheduler: the state goes "under LR_SCHEDULER_KEY" (``'lamploop_lr_scheduler'``);
    check_interval: "``"epoch"`` or ``"step"``, else ConfigurationError"."""
    assert LR_SCHEDULER_KEY == "lamploop_lr_scheduler"
    assert check_interval("epoch") == "epoch"
    assert check_interval("step") == "step"
    for bad in ("batch", None, 1):
        with pytest.raises(ConfigurationError):
            check_interval(bad)


def test_make_lr_scheduler_refusals_and_saved_state() -> None:
    """torch_scheduler, make_lr_scheduler: "The scheduler over ``optimizer``, going on from
    ``saved`` (a checkpoint's) when given. Raises: ConfigurationError: the factory gave
    something that is not a scheduler, or a ``ReduceLROnPlateau``"."""
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    with pytest.raises(ConfigurationError, match="lr_scheduler"):
        make_lr_scheduler(lambda o: 3, optimizer, None)
    with pytest.raises(ConfigurationError, match="ReduceLROnPlateau"):
        make_lr_scheduler(lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o), optimizer, None)
    reference = torch.optim.lr_scheduler.StepLR(torch.optim.SGD([parameter], lr=1.0), 1, 0.5)
    for _ in range(3):
        reference.optimizer.step()
        reference.step()
    made = make_lr_scheduler(
        lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5),
        torch.optim.SGD([parameter], lr=1.0),
        reference.state_dict(),
    )
    assert made.last_epoch == reference.last_epoch == 3
    assert made.get_last_lr() == reference.get_last_lr() == [0.125]


def _rates_of_fit(max_epochs: int, checkpoint_dir: Path | None = None, **keywords: Any) -> list[float]:
    x, y = _data(40, seed=4)
    rates: list[float] = []

    def factory(params: Any) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(params, lr=0.8)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: rates.append(opt.param_groups[0]["lr"]))
        return optimizer

    lamploop.fit(
        model=lamploop.SupervisedModel(_module()),
        optimizer_factory=factory,
        train_batches=lamploop.tensor_batches(x, y, batch_size=10, shuffle=False),  # 4 steps
        max_epochs=max_epochs,
        checkpoint_dir=checkpoint_dir,
        device="cpu",
        reporters=[],
        **keywords,
    )
    return rates


def _torch_rates(steps: int, step_size: int, interval_steps: int) -> list[float]:
    """PyTorch's StepLR(gamma=0.5) stepped by hand every ``interval_steps`` optimizer steps."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size, 0.5)
    rates = []
    for step in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if (step + 1) % interval_steps == 0:
            scheduler.step()
    return rates


def test_fit_lr_scheduler_per_step_and_per_epoch() -> None:
    """torch_scheduler: "``lr_scheduler_interval="step"`` (after every optimizer step) or
    ``"epoch"`` (after every training epoch)"."""
    per_step = _rates_of_fit(
        2, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5), lr_scheduler_interval="step"
    )
    assert per_step == pytest.approx(_torch_rates(8, 3, 1))
    per_epoch = _rates_of_fit(3, lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5))
    assert per_epoch == pytest.approx(_torch_rates(12, 1, 4))


def test_fit_lr_scheduler_resumes_exactly(tmp_path: Path) -> None:
    """torch_scheduler: "Its ``state_dict()`` is written to checkpoints beside the optimizer's
    ... so a resumed run ... steps on exactly"."""
    factory = lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5)  # noqa: E731
    first = _rates_of_fit(1, tmp_path, lr_scheduler=factory, lr_scheduler_interval="step")
    second = _rates_of_fit(3, tmp_path, lr_scheduler=factory, lr_scheduler_interval="step")
    assert first + second == pytest.approx(_torch_rates(12, 3, 1))


def test_fit_lr_scheduler_owns_the_rates() -> None:
    """torch_scheduler: "The scheduler owns the learning rates: it cannot be combined with
    ``learning_rate_schedule`` (other than ``noop()``) or ``step_schedule``."""
    factory = lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5)  # noqa: E731
    with pytest.raises(ConfigurationError, match="learning_rate_schedule"):
        _rates_of_fit(
            1,
            lr_scheduler=factory,
            learning_rate_schedule=lamploop.schedules.decrement(every=1, fraction=0.5),
        )
    with pytest.raises(ConfigurationError, match="step_schedule"):
        _rates_of_fit(
            1,
            lr_scheduler=factory,
            step_schedule=warmup_linear(warmup_steps=1, total_steps=4, steps_per_epoch=4),
        )
    assert (
        _rates_of_fit(1, lr_scheduler=factory, learning_rate_schedule=lamploop.schedules.noop()) == [0.8] * 4
    )


# ============================================================================== errors page

HIERARCHY = [
    ("LamploopError", (Exception,)),
    ("ConfigurationError", ("LamploopError", ValueError)),
    ("MissingDependencyError", ("ConfigurationError",)),
    ("BatchError", ("LamploopError", ValueError)),
    ("StreamExhausted", ("BatchError",)),
    ("SampleMismatchError", ("BatchError",)),
    ("NonFiniteLossError", ("LamploopError", FloatingPointError)),
    ("CheckpointError", ("LamploopError",)),
    ("DistributedError", ("LamploopError",)),
    ("TransportError", ("LamploopError",)),
    ("StreamingError", ("TransportError",)),
    ("FederatedError", ("LamploopError",)),
    ("PlanNotApprovedError", ("FederatedError",)),
    ("StreamEnded", ("LamploopError",)),
    ("BufferClosedError", ("LamploopError",)),
    ("DuplicateSampleError", ("LamploopError", ValueError)),
    ("FrameError", ("TransportError",)),
    ("HandshakeError", ("TransportError",)),
    ("PeerLostError", ("TransportError",)),
    ("TrainingInterrupted", ("LamploopError",)),
]


@pytest.mark.parametrize(("name", "bases"), HIERARCHY)
def test_error_classes_derive_as_documented(name: str, bases: tuple[Any, ...]) -> None:
    """errors: "Every error lamploop raises on purpose derives from LamploopError ... Errors
    about bad arguments also derive from ValueError"; each class's documented bases."""
    cls = getattr(errors, name)
    for base in bases:
        base_class = getattr(errors, base) if isinstance(base, str) else base
        assert issubclass(cls, base_class)
    if name != "LamploopError":
        assert issubclass(cls, LamploopError)
    assert errors.ControlChannelError is errors.TransportError


def test_detected_by_every_rank() -> None:
    """errors: the doctest (``mark_detected_by_every_rank(DistributedError(...))`` -> True,
    ``DistributedError(...)`` -> False, ``NonFiniteLossError(...)`` -> True); "``True`` for
    every NonFiniteLossError and StreamExhausted"; error_detected_by_every_rank: "``exc``
    itself, or one inside its exception groups, the first such; ``None`` when there is none"."""
    error = errors.mark_detected_by_every_rank(DistributedError("the ranks disagree"))
    assert (error.detected_by_every_rank, DistributedError("a peer is gone").detected_by_every_rank) == (
        True,
        False,
    )
    assert NonFiniteLossError("nan", epoch=1, batch=None).detected_by_every_rank is True
    assert errors.StreamExhausted("over").detected_by_every_rank is True
    assert errors.LamploopError("x").detected_by_every_rank is False
    shared = errors.mark_detected_by_every_rank(DistributedError("first"))
    later = NonFiniteLossError("nan", epoch=0, batch=1)
    group = builtins.ExceptionGroup(
        "outer",
        [ValueError("x"), builtins.ExceptionGroup("inner", [DistributedError("alone"), shared]), later],
    )
    assert errors.error_detected_by_every_rank(group) is shared
    assert errors.error_detected_by_every_rank(later) is later
    assert (
        errors.error_detected_by_every_rank(builtins.ExceptionGroup("g", [DistributedError("alone")])) is None
    )
    assert errors.error_detected_by_every_rank(None) is None


def test_error_attributes() -> None:
    """errors: the documented attributes of SampleMismatchError, NonFiniteLossError ("step
    ... (``None`` when found at the epoch's end)", "ranks ... (empty when unknown)"),
    PlanNotApprovedError, PeerLostError ("or ``None`` when unknown") and TrainingInterrupted."""
    mismatch = errors.SampleMismatchError(
        "m", producer="sim-1", seq=7, field="image", shape=(3,), expected_shape=(4,)
    )
    assert (mismatch.producer, mismatch.seq, mismatch.field, mismatch.shape, mismatch.expected_shape) == (
        "sim-1",
        7,
        "image",
        (3,),
        (4,),
    )
    assert mismatch.epoch is None
    assert mismatch.batch is None
    nan = NonFiniteLossError("nan", epoch=2, batch=None)
    assert (nan.epoch, nan.batch, nan.step, nan.ranks) == (2, None, None, ())
    assert errors.PlanNotApprovedError("no", plan_hash="ab" * 32).plan_hash == "ab" * 32
    lost = errors.PeerLostError("gone")
    assert (lost.rank, lost.how) == (None, None)
    named = errors.PeerLostError("gone", rank=2, how="silent")
    assert (named.rank, named.how) == (2, "silent")
    stop = TrainingInterrupted("stopped", epoch=3, steps_done=5, reason="SIGTERM")
    assert (stop.epoch, stop.steps_done, stop.reason) == (3, 5, "SIGTERM")


def _one_batch_stream(
    features: torch.Tensor, target: torch.Tensor | None
) -> Callable[[Any], AsyncIterator[Any]]:
    def factory(context: Any) -> AsyncIterator[Any]:
        async def batches() -> AsyncIterator[Any]:
            yield features if target is None else (features, target)

        return batches()

    return factory


@pytest.mark.parametrize(
    ("stream", "says"),
    [
        (_one_batch_stream(torch.zeros(0, 4, dtype=F64), torch.zeros(0, dtype=torch.long)), "empty"),
        (_one_batch_stream(torch.zeros(3, 4, dtype=F64), torch.zeros(2, dtype=torch.long)), "3"),
        (_one_batch_stream(torch.zeros(3, 4, dtype=F64), None), "pair"),
    ],
    ids=["empty", "sizes-differ", "not-a-pair"],
)
def test_bad_batches_are_batch_errors(stream: Callable[[Any], AsyncIterator[Any]], says: str) -> None:
    """errors, BatchError: "A batch stream yielded something that cannot be trained on.
    Examples: an empty batch, features and targets with different batch sizes, or an item that
    is not a ``(features, target)`` pair"; "Each message names the offending value and where it
    came from"."""
    with pytest.raises(BatchError) as raised:
        lamploop.fit(
            model=lamploop.SupervisedModel(_module()),
            optimizer_factory=_sgd(0.1),
            train_batches=stream,
            max_epochs=1,
            device="cpu",
            reporters=[],
        )
    message = str(raised.value)
    assert says in message
    assert "epoch 0" in message
    assert "batch 0" in message


def test_nan_loss_names_epoch_batch_step_and_rank() -> None:
    """errors, NonFiniteLossError: "A loss was NaN or infinite"; "epoch: the epoch in which it
    happened", "batch: the 0-based index of the first bad batch in that epoch on this rank",
    "step: the 0-based optimizer step of the epoch whose loss was bad", "ranks: the ranks whose
    loss was bad at that step"."""
    x, y = _data(40, seed=6)
    x[25] = math.nan  # batch 2 (batches of 10, in order)
    with pytest.raises(NonFiniteLossError) as raised:
        lamploop.fit(
            model=lamploop.SupervisedModel(_module()),
            optimizer_factory=_sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=10, shuffle=False),
            max_epochs=2,
            device="cpu",
            reporters=[],
        )
    error = raised.value
    assert (error.epoch, error.batch, error.step, tuple(error.ranks)) == (0, 2, 2, (0,))
    assert error.detected_by_every_rank


def _slow(factory: Callable[[Any], Any], seconds: float) -> Callable[[Any], AsyncIterator[Any]]:
    """``factory``'s batches, each after ``seconds`` (steps of 20 ms or more stop at their step)."""

    def slow_factory(context: Any) -> AsyncIterator[Any]:
        async def batches() -> AsyncIterator[Any]:
            async for batch in factory(context):
                await anyio.sleep(seconds)
                yield batch

        return batches()

    return slow_factory


def test_sigterm_is_training_interrupted(tmp_path: Path) -> None:
    """errors, TrainingInterrupted: "Training stopped on request (SIGTERM, SIGINT) at a step
    boundary, after writing a checkpoint. Attributes: epoch: the epoch that was in progress.
    steps_done: the optimizer steps done in it. reason: what asked for the stop"; events:
    ``RunStopped`` "(``reason``: ``"SIGINT"``, ``"SIGTERM"``...)"."""
    previous = signal.getsignal(signal.SIGTERM)
    caught: list[int] = []
    signal.signal(signal.SIGTERM, lambda number, frame: caught.append(number))  # never the default kill

    def stop_in_epoch_1(event: Any) -> None:
        if isinstance(event, ProgressSampled) and event.epoch == 1:
            signal.raise_signal(signal.SIGTERM)

    recorder = Recorder(stop_in_epoch_1)
    x, y = _data(40, seed=7)
    try:
        with pytest.raises(TrainingInterrupted) as raised:
            lamploop.fit(
                model=lamploop.SupervisedModel(_module()),
                optimizer_factory=_sgd(0.1),
                train_batches=_slow(lamploop.tensor_batches(x, y, batch_size=5, shuffle=False), 0.03),
                max_epochs=3,
                checkpoint_dir=tmp_path,
                device="cpu",
                reporters=[recorder],
            )
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert caught == []  # the run handled it
    stop = raised.value
    assert stop.reason == "SIGTERM"
    assert stop.epoch == 1
    assert stop.steps_done in (1, 2)  # after the step in progress
    assert isinstance(recorder.events[-1], RunStopped)
    assert recorder.events[-1].reason == "SIGTERM"
    written = [event for event in recorder.events if isinstance(event, CheckpointWritten)]
    assert (written[-1].epoch, written[-1].steps_done) == (1, stop.steps_done)
    assert written[-1].path is not None
    assert Path(written[-1].path).is_dir()


@pytest.mark.parametrize(
    ("make", "modules", "extra"),
    [
        (lambda path: ProgressReporter(io.StringIO()), ["rich"], "progress"),
        (lambda path: TensorBoardReporter(path), ["tensorboard", "torch.utils.tensorboard"], "tensorboard"),
        (lambda path: PrometheusReporter(0), ["prometheus_client"], "prometheus"),
        (lambda path: lamploop.reporting.MlflowReporter(f"sqlite:///{path}/m.db"), ["mlflow"], "mlflow"),
        (
            lambda path: lamploop.reporting.WandbReporter(project="p", mode="offline", dir=path),
            ["wandb"],
            "wandb",
        ),
    ],
    ids=["progress", "tensorboard", "prometheus", "mlflow", "wandb"],
)
def test_missing_extra_is_missing_dependency_error(
    make: Callable[[Path], Any],
    modules: list[str],
    extra: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """observability: "A missing extra is a MissingDependencyError (a ConfigurationError) raised
    when the reporter is made, with the command that installs it, e.g. ``pip install
    "lamploop[tensorboard]"``"; errors, MissingDependencyError: "the message gives the pip
    command"."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # import of it fails: not installed
    with pytest.raises(MissingDependencyError) as raised:
        make(tmp_path)
    assert isinstance(raised.value, ConfigurationError)
    assert f'pip install "lamploop[{extra}]"' in str(raised.value)


# ================================================================================ sync page


def test_strategy_registry_names() -> None:
    """sync.strategy: ``AUTO``: "Not a strategy but a choice"; strategy_names: "The registered
    strategies' names, sorted"; sync: ``all_reduce`` and ``reduce_to_root`` "registered by
    lamploop.sync itself", and the strategies that send less (``all_reduce_bf16``,
    ``all_reduce_fp16``, ``powersgd1``, ``powersgd4``, ``local_sgd8``, ``diloco8``)."""
    names = strategy_names()
    assert AUTO == "auto"
    assert AUTO not in names
    assert list(names) == sorted(names)
    expected = {"all_reduce", "reduce_to_root", "all_reduce_bf16", "all_reduce_fp16", "powersgd1"}
    assert expected | {"powersgd4", "local_sgd8", "diloco8"} <= set(names)
    assert strategy_named("all_reduce").name == "all_reduce"
    assert strategy_named("all_reduce").steps_on_every_rank is True
    assert strategy_named("reduce_to_root").steps_on_every_rank is False


def test_check_strategy_name() -> None:
    """sync.strategy, check_strategy_name: "``name`` if it is ``"auto"`` or registered, else
    ConfigurationError listing the choices"."""
    assert check_strategy_name("auto") == "auto"
    assert check_strategy_name("reduce_to_root") == "reduce_to_root"
    with pytest.raises(ConfigurationError) as raised:
        check_strategy_name("all_reduse")
    assert "all_reduse" in str(raised.value)
    assert all(name in str(raised.value) for name in strategy_names())


def test_strategy_optional_flags() -> None:
    """sync.strategy: keeps_state: "(PowerSGD's error feedback, the fp16 scale, DiLoCo's outer
    momentum)"; optimizer_state_per_rank: "(ranks step on their own gradients: local SGD)"."""
    assert [keeps_state(strategy_named(name)) for name in ("powersgd1", "all_reduce_fp16", "diloco8")] == [
        True
    ] * 3
    assert not keeps_state(strategy_named("all_reduce"))
    assert not keeps_state(strategy_named("reduce_to_root"))
    assert optimizer_state_per_rank(strategy_named("local_sgd8"))
    assert not optimizer_state_per_rank(strategy_named("all_reduce"))


def test_check_saved_state() -> None:
    """sync.strategy, check_saved_state: "Raises: CheckpointError: keys missing or unexpected,
    or a shape that differs (saved by another strategy, model or rank)"."""
    expected = {"error": torch.zeros(3, 2), "scale": torch.zeros(())}
    check_saved_state("powersgd", {"error": torch.ones(3, 2), "scale": torch.ones(())}, expected)
    with pytest.raises(CheckpointError, match="scale"):
        check_saved_state("powersgd", {"error": torch.ones(3, 2)}, expected)
    with pytest.raises(CheckpointError, match="extra"):
        check_saved_state("powersgd", {**expected, "extra": torch.ones(1)}, expected)
    with pytest.raises(CheckpointError, match="error"):
        check_saved_state("powersgd", {"error": torch.ones(2, 3), "scale": torch.ones(())}, expected)


def test_single_process_channel() -> None:
    """sync, SingleProcessChannel: "The trivial channel of a run with one rank"; gradient_sync:
    "Gradients need no reduction; ``reduce`` only rescales them"; begin_all_reduce_sum:
    "Already known: the values themselves (and ``per_rank``, this rank's slot)"."""
    channel = SingleProcessChannel()
    assert (channel.rank, channel.nranks) == (0, 1)
    assert channel.all_reduce_sum([1.5, 2.0]) == [1.5, 2.0]
    assert channel.begin_all_reduce_sum([1.0, 2.0], per_rank=7.0).wait() == [1.0, 2.0, 7.0]
    module = _module()
    sync = channel.gradient_sync(module)
    sync.begin_pass()
    sync.last_backward()
    x, y = _data(6, seed=9)
    torch.nn.functional.cross_entropy(module(x), y, reduction="sum").backward()
    before = [parameter.grad.clone() for parameter in module.parameters()]
    sync.reduce(0.25)
    for parameter, grad in zip(module.parameters(), before, strict=True):
        torch.testing.assert_close(parameter.grad, grad * 0.25)
    sync.after_step()
    sync.end_pass()
    sync.close(abandon=False)


def test_single_process_channel_same_sync_for_same_module() -> None:
    """sync, TensorChannel.gradient_sync: "The gradient sync of ``module``'s parameters (the same
    object for the same module)"; channel: "the same epoch code serves one process
    (SingleProcessChannel) and many"."""
    channel = SingleProcessChannel()
    module = _module()
    assert channel.gradient_sync(module) is channel.gradient_sync(module)


GLOO_WORKER = r"""
import json, os, sys, threading, time
from datetime import timedelta
import torch
import torch.distributed as dist
from lamploop.errors import LamploopError
from lamploop.settings import TrainingSettings
from lamploop.sync import AbortSignal, Collectives, register_strategy, strategy_named, strategy_names
from lamploop.sync.collectives import WaitAborted
from lamploop.sync.strategy import check_strategy_name, reduces_linearly

rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
res = {}
def err(e):
    return {"type": type(e).__name__, "lamploop": isinstance(e, LamploopError), "message": str(e)}
def attempt(f):
    try:
        return {"value": f()}
    except Exception as e:
        return err(e)
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=40))
group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=40))
cpu = torch.device("cpu")
coll = Collectives(group, rank=rank, nranks=2, device=cpu, timeout=40.0)
res["sum"] = coll.sum([float(rank + 1), 10.0], per_rank=float(rank + 5)).wait()
res["gather"] = coll.gather_json({"rank": rank}, "gather test")
res["broadcast"] = coll.broadcast_json({"from": rank}, "broadcast test")
res["sum_tensor_slot"] = coll.sum([1.0], per_rank=torch.tensor(rank + 0.5)).wait()
tensors = [torch.full((2, 3), float(rank)), torch.arange(4, dtype=torch.float64) * (rank + 1)]
coll.broadcast_tensors(tensors, "broadcast tensors test")
res["broadcast_tensors"] = [t.tolist() for t in tensors]
res["broadcast_bytes"] = coll.broadcast_bytes(b"root" if rank == 0 else b"follower!", "bytes test").decode()
gathered = coll.gather_bytes_to_root(b"r" * (rank + 3), "gather bytes test")
res["gather_bytes"] = None if gathered is None else [g.decode() for g in gathered]
res["agree"] = attempt(lambda: coll.check_agreement("the model", "Linear(4, 2)"))
res["disagree"] = attempt(lambda: coll.check_agreement("the optimizer", "SGD" if rank == 0 else "Adam"))

torch.manual_seed(0)
x = torch.randn(10, 3, dtype=torch.float64)
y = torch.randint(0, 2, (10,))
mine = slice(0, 6) if rank == 0 else slice(6, 10)

def one_step(name, guess=None):
    torch.manual_seed(1)
    module = torch.nn.Linear(3, 2).double()
    params = list(module.parameters())
    sync = strategy_named(name).gradient_sync(coll, params, [module], bucket_cap_mb=25.0)
    optimizer = torch.optim.SGD(params, lr=0.5)
    record = {"reduces_linearly": reduces_linearly(sync)}
    expected = 10 if guess is None else guess
    sync.begin_pass()
    sync.last_backward()
    loss_sum = torch.nn.functional.cross_entropy(module(x[mine]), y[mine], reduction="sum")
    (loss_sum / expected).backward()
    sync.reduce(expected / 10)
    record["grads"] = [p.grad.detach().reshape(-1).tolist() for p in params]
    if strategy_named(name).steps_on_every_rank or rank == 0:
        optimizer.step()
    sync.after_step()
    sync.end_pass()
    record["params"] = [p.detach().reshape(-1).tolist() for p in params]
    sync.close(abandon=False)
    return record

res["all_reduce"] = one_step("all_reduce")
res["all_reduce_guessed"] = one_step("all_reduce", guess=4)
res["reduce_to_root"] = one_step("reduce_to_root")
res["linear"] = {}
for name in ("all_reduce_bf16", "powersgd1", "all_reduce_fp16"):
    module = torch.nn.Linear(3, 2).double() if name == "powersgd1" else torch.nn.Linear(3, 2)
    sync = strategy_named(name).gradient_sync(coll, list(module.parameters()), [module], bucket_cap_mb=25.0)
    res["linear"][name] = reduces_linearly(sync)
    sync.close(abandon=False)

faults = dist.ProcessGroupGloo(dist.PrefixStore("faults", store), rank, 2, timedelta(seconds=40))
if rank == 0:
    short = Collectives(faults, rank=0, nranks=2, device=cpu, timeout=1.0)
    t0 = time.monotonic()
    res["timeout"] = attempt(lambda: short.wait(short.all_reduce([torch.ones(3)]), "a sum rank 1 skips"))
    res["timeout_seconds"] = time.monotonic() - t0
    abort = AbortSignal()
    patient = Collectives(faults, rank=0, nranks=2, device=cpu, timeout=60.0, abort=abort)
    threading.Timer(0.5, abort.set, ["the test gave up"]).start()
    t0 = time.monotonic()
    try:
        patient.wait(patient.all_reduce([torch.ones(3)]), "another sum rank 1 skips")
        res["aborted"] = {"value": None}
    except Exception as e:
        res["aborted"] = err(e) | {"wait_aborted": isinstance(e, WaitAborted)}
    res["aborted_seconds"] = time.monotonic() - t0
    store.set("faults_done", "1")
    # Rank 0 holds the store: it leaves only once rank 1 has seen the key (else rank 1's wait
    # can find the store gone: "Failed to recv, got 0 bytes", once on a loaded machine).
    store.wait(["faults_seen"], timedelta(seconds=40))
else:
    class Probe:
        name = "acceptance_probe"
        steps_on_every_rank = True
        def gradient_sync(self, collectives, parameters, modules, *, bucket_cap_mb):
            return strategy_named("all_reduce").gradient_sync(
                collectives, parameters, modules, bucket_cap_mb=bucket_cap_mb)
    class Auto(Probe):
        name = "auto"
    class Taken(Probe):
        name = "all_reduce"
    class Lacking:
        name = "acceptance_lacking"
    reg = {}
    reg["auto"] = attempt(lambda: register_strategy(Auto()))
    reg["taken"] = attempt(lambda: register_strategy(Taken()))
    reg["lacking"] = attempt(lambda: register_strategy(Lacking()))
    probe = Probe()
    reg["new"] = attempt(lambda: register_strategy(probe))
    reg["names"] = list(strategy_names())
    reg["named_is_it"] = strategy_named("acceptance_probe") is probe
    reg["again"] = attempt(lambda: register_strategy(Probe()))
    replacement = Probe()
    reg["replace"] = attempt(lambda: register_strategy(replacement, replace=True))
    reg["replaced"] = strategy_named("acceptance_probe") is replacement
    reg["checked"] = check_strategy_name("acceptance_probe")
    reg["settings"] = TrainingSettings(strategy="acceptance_probe").strategy
    res["registry"] = reg
    store.wait(["faults_done"], timedelta(seconds=40))
    store.set("faults_seen", "1")
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(res, f)
sys.stdout.flush()
os._exit(0)
"""


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Two real processes over one ProcessGroupGloo on 127.0.0.1 run GLOO_WORKER."""
    directory = tmp_path_factory.mktemp("gloo")
    script = directory / "worker.py"
    script.write_text(GLOO_WORKER)
    port = free_port()
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(port), str(directory)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=environment,
            cwd=ROOT,
        )
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=55)[0].decode(errors="replace"))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    for rank, process in enumerate(ranks):
        assert process.returncode == 0, f"rank {rank}: {outputs[rank][-3000:]}"
    return {rank: json.loads((directory / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def _step_reference(lr: float = 0.5) -> tuple[list[list[float]], list[list[float]]]:
    """The gradient of the mean loss over both ranks' 10 examples, and one SGD step, in float64."""
    torch.manual_seed(0)
    x = torch.randn(10, 3, dtype=F64)
    y = torch.randint(0, 2, (10,))
    torch.manual_seed(1)
    module = torch.nn.Linear(3, 2).double()
    torch.nn.functional.cross_entropy(module(x), y).backward()
    grads = [parameter.grad.reshape(-1).tolist() for parameter in module.parameters()]
    with torch.no_grad():
        params = [(parameter - lr * parameter.grad).reshape(-1).tolist() for parameter in module.parameters()]
    return grads, params


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_collectives_sum_gather_broadcast(gloo: dict[int, dict[str, Any]]) -> None:
    """sync, Collectives.sum: "Start summing a small float vector over all ranks (float64).
    ``per_rank``: one more value from each rank, in its own slot after ``values``";
    gather_json: "Every rank's JSON-ready ``value``, in rank order, on every rank";
    broadcast_json: "Rank 0's JSON-ready ``value`` on every rank"."""
    for rank in (0, 1):
        assert gloo[rank]["sum"] == [3.0, 20.0, 5.0, 6.0]
        assert gloo[rank]["gather"] == [{"rank": 0}, {"rank": 1}]
        assert gloo[rank]["broadcast"] == {"from": 0}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_collectives_check_agreement(gloo: dict[int, dict[str, Any]]) -> None:
    """sync, Collectives.check_agreement: "Raise DistributedError on every rank if the ranks hold
    different ``value`` for ``label``"."""
    for rank in (0, 1):
        assert gloo[rank]["agree"] == {"value": None}
        disagree = gloo[rank]["disagree"]
        assert disagree["type"] == "DistributedError"
        assert "the optimizer" in disagree["message"]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_all_reduce_gradient_contract(gloo: dict[int, dict[str, Any]]) -> None:
    """sync.strategy, GradientSync: "before reduce each rank's ``.grad`` holds the sum of its
    batches' gradients of ``loss_sum / expected``; after ``reduce(scale)`` every rank that steps
    holds the sum over ranks times ``scale`` (the gradient of the step's mean loss)"; a sync
    that reduces linearly "is given a guessed ``expected`` and a ``scale`` that corrects it"."""
    grads, params = _step_reference()
    for rank in (0, 1):
        for case in ("all_reduce", "all_reduce_guessed"):
            record = gloo[rank][case]
            assert record["reduces_linearly"] is True
            for got, want in zip(record["grads"], grads, strict=True):
                assert got == pytest.approx(want, abs=1e-12)
            for got, want in zip(record["params"], params, strict=True):
                assert got == pytest.approx(want, abs=1e-12)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_reduce_to_root_root_steps_and_shares(gloo: dict[int, dict[str, Any]]) -> None:
    """sync.strategy, SyncStrategy.steps_on_every_rank: "``False`` when only the root steps and
    shares parameters"; GradientSync.end_pass: "wait until nothing is in flight"; DESIGN.md 4:
    "reduce gradients to the root, the root steps, parameters are broadcast"."""
    grads, params = _step_reference()
    root, follower = gloo[0]["reduce_to_root"], gloo[1]["reduce_to_root"]
    for got, want in zip(root["grads"], grads, strict=True):
        assert got == pytest.approx(want, abs=1e-12)
    for record in (root, follower):
        for got, want in zip(record["params"], params, strict=True):
            assert got == pytest.approx(want, abs=1e-12)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_reduces_linearly_flags(gloo: dict[int, dict[str, Any]]) -> None:
    """sync.strategy, reduces_linearly: "(plain sums: ``all_reduce``, ``reduce_to_root``,
    ``all_reduce_bf16``) ... Without it (the safe default: PowerSGD's error feedback, fp16's
    range and scale, local SGD)"."""
    for rank in (0, 1):
        assert gloo[rank]["reduce_to_root"]["reduces_linearly"] is True
        assert gloo[rank]["linear"] == {"all_reduce_bf16": True, "powersgd1": False, "all_reduce_fp16": False}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_collective_timeout_and_abort(gloo: dict[int, dict[str, Any]]) -> None:
    """sync, Collectives: "timeout: seconds after which a wait whose peers never arrive fails";
    wait: "Raises: WaitAborted: the abort signal was set. DistributedError: the collective ...
    outlasted the timeout"; collectives: "between slices checks an AbortSignal ... raises
    WaitAborted within a slice" (POLL_S, 0.1 s)."""
    root = gloo[0]
    assert root["timeout"]["type"] == "DistributedError"
    assert "a sum rank 1 skips" in root["timeout"]["message"]
    assert 0.9 <= root["timeout_seconds"] < 6.0
    assert root["aborted"]["wait_aborted"] is True
    assert "the test gave up" in root["aborted"]["message"]
    assert root["aborted_seconds"] < 3.0


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_register_strategy(gloo: dict[int, dict[str, Any]]) -> None:
    """sync.strategy, register_strategy: "Make ``strategy`` available under ``strategy.name``.
    Raises: ConfigurationError: the name is ``"auto"`` or already taken (unless ``replace``), or
    ``strategy`` lacks the SyncStrategy members"; "the name travels in TrainingSettings"."""
    registry = gloo[1]["registry"]
    for case in ("auto", "taken", "lacking", "again"):
        assert registry[case]["type"] == "ConfigurationError", case
    assert "auto" in registry["auto"]["message"]
    assert "all_reduce" in registry["taken"]["message"]
    assert registry["new"] == {"value": None}
    assert registry["replace"] == {"value": None}
    assert "acceptance_probe" in registry["names"]
    assert registry["names"] == sorted(registry["names"])
    assert "acceptance_lacking" not in registry["names"]
    assert "auto" not in registry["names"]
    assert registry["named_is_it"] is True
    assert registry["replaced"] is True
    assert registry["checked"] == registry["settings"] == "acceptance_probe"


# ======================================================================= observability page


def test_default_reporter_logs_a_line_per_epoch(caplog: pytest.LogCaptureFixture) -> None:
    """observability: "``LoggingReporter`` (the default) ... one line per epoch on the
    ``"lamploop"`` logger"; logging_reporter.describe_epoch: "``epoch 3: train loss 0.1234,
    validation loss 0.2345 (smoothed 0.2400)``"; "The log line ... of each epoch end[s] with the
    shares (``per step 3.21 ms: data wait 4%, forward+backward 80%, ...``)"."""
    x, y = _data(30, seed=12)
    with caplog.at_level(logging.INFO, logger="lamploop"):
        state = lamploop.fit(
            model=lamploop.SupervisedModel(_module()),
            optimizer_factory=_sgd(0.2),
            train_batches=lamploop.tensor_batches(x[:20], y[:20], batch_size=10, shuffle=False),
            validation_batches=lamploop.tensor_batches(x[20:], y[20:], batch_size=10, shuffle=False),
            max_epochs=2,
            validation_loss_exponential_smoothing_factor=0.5,
            device="cpu",
        )
    lines = [record.getMessage() for record in caplog.records if record.name == "lamploop"]
    epoch_lines = [line for line in lines if line.startswith("epoch ")]
    assert len(epoch_lines) == 2
    shares = (
        r"per step [0-9.]+ ms: data wait \d+%, forward\+backward \d+%, communication wait \d+%, "
        r"optimizer \d+%, checkpoint \d+%, other \d+%"
    )
    last = state.learning_curve[1]
    smoothed, raw = last.validation_loss
    expected = (
        rf"epoch 1: train loss {last.training_loss:.4f}, validation loss {raw:.4f} "
        rf"\(smoothed {smoothed:.4f}\).*{shares}.*"
    )
    assert re.fullmatch(expected, epoch_lines[1]), epoch_lines[1]
    assert epoch_lines[0].startswith(f"epoch 0: train loss {state.learning_curve[0].training_loss:.4f}")


def test_logging_reporter_levels() -> None:
    """logging_reporter, LoggingReporter: "Logs a run's epochs, start and end at ``level`` ...
    Warnings (a lost rank) and errors (the run failed) keep their own levels; progress samples
    are not logged."""
    logger = logging.getLogger("acceptance.observability.levels")
    logger.propagate = False
    handler = ListHandler()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    reporter = LoggingReporter(logger=logger, level=logging.DEBUG)
    state = LoopState(epoch=1, learning_curve=[LearningCurveEntry(0, 0.5, validation_loss=(0.6, 0.7))])
    try:
        reporter.report(_sample(0, 1, 8, 1))
        assert handler.records == []  # progress samples are not logged
        reporter.report(RunStarted(nranks=2, epoch=0, max_epochs=1))
        reporter.report(EpochStarted(epoch=0, learning_rate_factor=1.0))
        reporter.report(_sample(0, 2, 16, 2))
        reporter.report(EpochFinished(state, seconds=1.0, steps=1, examples=8))
        reporter.report(PeerLost(rank=1, how="died", message="rank 1 died"))
        reporter.report(RunFailed(error="PeerLostError: rank 1 died"))
    finally:
        logger.removeHandler(handler)
    messages = [(record.levelno, record.getMessage()) for record in handler.records]
    assert any(level == logging.DEBUG and "epoch 0: train loss 0.5000" in text for level, text in messages)
    assert any(level == logging.WARNING for level, _ in messages)
    assert any(level == logging.ERROR for level, _ in messages)
    assert all(level == logging.DEBUG for level, _ in messages[:-2])  # start and epoch at ``level``
    assert len([1 for _, text in messages if "train loss" in text]) == 1


def test_describe_step_breakdown() -> None:
    """logging_reporter, describe_step_breakdown: the doctest: two steps of 0.01 s with 0.001
    data wait and 0.008 forward+backward give ``per step 5.00 ms: data wait 10%, forward+backward
    80%, communication wait 0%, optimizer 0%, checkpoint 0%, other 10%``."""
    two_steps = StepBreakdown(steps=2, seconds=0.01, data_wait=0.001, forward_backward=0.008)
    assert " ".join(describe_step_breakdown(two_steps).split()) == (
        "per step 5.00 ms: data wait 10%, forward+backward 80%, communication wait 0%, optimizer 0%, "
        "checkpoint 0%, other 10%"
    )
    assert two_steps.other == pytest.approx(0.001)


def test_progress_reporter_plain_lines() -> None:
    """observability: ProgressReporter "in a pipe or file: the same lines, no escape codes";
    progress (doctest): ``training on 1 rank(s) from epoch 0 to 1`` / ``epoch 0: train loss
    0.5000, validation loss 0.7000 (smoothed 0.6000) (2.0 s, 320 examples/s)`` / ``finished
    after epoch 0 (2.5 s)``."""
    out = io.StringIO()
    progress = ProgressReporter(out)
    state = LoopState(epoch=1, learning_curve=[LearningCurveEntry(0, 0.5, validation_loss=(0.6, 0.7))])
    progress.report(RunStarted(nranks=1, epoch=0, max_epochs=1, time=0.0))
    progress.report(EpochStarted(epoch=0, learning_rate_factor=1.0, time=0.1))
    progress.report(
        ProgressSampled(0, 1, 64, 0.5, 1, 0.1, 0.0, 640.0, total_steps=1, total_examples=64, time=0.2)
    )
    progress.report(EpochFinished(state, seconds=2.0, steps=10, examples=640, time=2.0))
    progress.report(RunFinished(state, time=2.5))
    progress.close()
    assert "\x1b" not in out.getvalue()
    assert out.getvalue().splitlines() == [
        "training on 1 rank(s) from epoch 0 to 1",
        "epoch 0: train loss 0.5000, validation loss 0.7000 (smoothed 0.6000) (2.0 s, 320 examples/s)",
        "finished after epoch 0 (2.5 s)",
    ]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_observed_run_events_and_samples(observed: dict[str, Any]) -> None:
    """observability: "Every 0.5 s (and after each epoch's first step) the sampler makes one
    ProgressSampled event"; events: the order RunStarted, EpochStarted, ProgressSampled, ...,
    ValidationFinished, EpochFinished, CheckpointWritten, RunFinished; ProgressSampled.loss: "the
    mean training loss per example over the steps since the previous sample"; custom-reporters:
    "``start()`` ... is called by ``fit`` on the root before training", "``close()`` ... once"."""
    events = observed["events"]
    kinds = [type(event) for event in events]
    assert kinds[0] is RunStarted
    assert kinds[-1] is RunFinished
    assert kinds.count(EpochFinished) == kinds.count(ValidationFinished) == EPOCHS
    assert observed["recorder"].started == observed["recorder"].closed == 1
    starts = [index for index, kind in enumerate(kinds) if kind is EpochStarted]
    first_samples = [events[index + 1] for index in starts]
    assert all(isinstance(sample, ProgressSampled) for sample in first_samples)
    reference = observed["reference"]["first_batch_losses"]
    for epoch, sample in enumerate(first_samples):
        assert (sample.epoch, sample.steps_done, sample.steps, sample.examples) == (epoch, 1, 1, BATCH)
        assert sample.total_steps == epoch * STEPS_PER_EPOCH + 1
        assert sample.total_examples == epoch * N_TRAIN + BATCH
        assert sample.loss == pytest.approx(reference[epoch], rel=1e-9)
    finished = [event for event in events if isinstance(event, EpochFinished)]
    assert [(event.steps, event.examples) for event in finished] == [(STEPS_PER_EPOCH, N_TRAIN)] * EPOCHS
    validations = [event for event in events if isinstance(event, ValidationFinished)]
    raw = [entry["validation"][1] for entry in observed["reference"]["curve"]]
    assert [event.loss for event in validations] == pytest.approx(raw, rel=1e-9)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_observed_step_breakdown(observed: dict[str, Any]) -> None:
    """observability: "the root's training pass splits the wall time of every optimizer step into
    five parts, summed per epoch, and ``EpochFinished.step_breakdown`` carries them"; step_timing:
    "each >= 0, together <= ``seconds``"."""
    for event in (event for event in observed["events"] if isinstance(event, EpochFinished)):
        breakdown = event.step_breakdown
        assert breakdown is not None
        assert breakdown.steps == STEPS_PER_EPOCH
        parts = breakdown.parts()
        assert list(parts) == [
            "data_wait",
            "forward_backward",
            "communication_wait",
            "optimizer",
            "checkpoint",
        ]
        assert all(value >= 0 for value in parts.values())
        assert sum(parts.values()) <= breakdown.seconds + 1e-9
        assert breakdown.other == pytest.approx(breakdown.seconds - sum(parts.values()), abs=1e-9)
        assert breakdown.communication_wait == 0.0  # one rank
        assert breakdown.forward_backward > 0


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_observed_metrics_file_csv(observed: dict[str, Any]) -> None:
    """observability: ``MetricsFileReporter`` "one CSV or JSONL row per epoch"; metrics_file:
    "``epoch``, ``training_loss``, ``validation_loss`` (raw), ``validation_loss_smoothed``,
    ``learning_rate_factor``, ``seconds``, ``steps``, ``examples``, the step breakdown's
    STEP_COLUMNS ..., then ``train_<metric>`` and ``validation_<metric>`` (raw)"."""
    with (observed["directory"] / "curve.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames
        rows = list(reader)
    assert header == [
        "epoch",
        "training_loss",
        "validation_loss",
        "validation_loss_smoothed",
        "learning_rate_factor",
        "seconds",
        "steps",
        "examples",
        "step_seconds",
        "data_wait_seconds",
        "forward_backward_seconds",
        "communication_wait_seconds",
        "optimizer_seconds",
        "checkpoint_seconds",
        "train_accuracy",
        "validation_accuracy",
    ]
    reference = observed["reference"]["curve"]
    assert [int(row["epoch"]) for row in rows] == list(range(EPOCHS))
    for row, expected, factor in zip(rows, reference, observed["factors"], strict=True):
        assert float(row["training_loss"]) == pytest.approx(expected["training_loss"], rel=1e-9)
        assert float(row["validation_loss"]) == pytest.approx(expected["validation"][1], rel=1e-9)
        assert float(row["validation_loss_smoothed"]) == pytest.approx(expected["validation"][0], rel=1e-9)
        assert float(row["train_accuracy"]) == pytest.approx(expected["training_accuracy"], rel=1e-9)
        assert float(row["validation_accuracy"]) == pytest.approx(
            expected["validation_accuracy"][1], rel=1e-9
        )
        assert float(row["learning_rate_factor"]) == pytest.approx(factor)
        assert (int(row["steps"]), int(row["examples"])) == (STEPS_PER_EPOCH, N_TRAIN)
        parts = sum(
            float(row[name])
            for name in (
                "data_wait_seconds",
                "forward_backward_seconds",
                "communication_wait_seconds",
                "optimizer_seconds",
                "checkpoint_seconds",
            )
        )
        assert parts <= float(row["step_seconds"]) + 1e-9


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_observed_metrics_file_jsonl(observed: dict[str, Any]) -> None:
    """metrics_file: "JSON lines: one object per row, with ``time`` (the event's) added"."""
    rows = [json.loads(line) for line in (observed["directory"] / "curve.jsonl").read_text().splitlines()]
    finished = [event for event in observed["events"] if isinstance(event, EpochFinished)]
    assert [row["epoch"] for row in rows] == list(range(EPOCHS))
    for row, event in zip(rows, finished, strict=True):
        assert row["time"] == pytest.approx(event.time)
        assert row["training_loss"] == pytest.approx(event.state.learning_curve[-1].training_loss, rel=1e-12)
        assert row["steps"] == STEPS_PER_EPOCH
        assert row["examples"] == N_TRAIN


def test_metrics_file_appends_on_resume(tmp_path: Path) -> None:
    """observability: MetricsFileReporter "one CSV or JSONL row per epoch, appended (a resumed run
    goes on in the same file)"; the global step: "(a resumed process counts from 0 again)"."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    x, y = _data(24, seed=13)  # 3 steps per epoch
    path = tmp_path / "curve.csv"
    for max_epochs in (2, 3):
        lamploop.fit(
            model=lamploop.SupervisedModel(_module()),
            optimizer_factory=_sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=8, shuffle=False),
            max_epochs=max_epochs,
            checkpoint_dir=tmp_path / "checkpoints",
            device="cpu",
            reporters=[MetricsFileReporter(path), TensorBoardReporter(tmp_path / f"board{max_epochs}")],
        )
    lines = path.read_text().splitlines()
    assert lines[0].startswith("epoch,training_loss,")
    assert sum(line.startswith("epoch,") for line in lines) == 1
    with path.open(newline="") as f:
        assert [int(row["epoch"]) for row in csv.DictReader(f)] == [0, 1, 2]
    resumed = EventAccumulator(str(tmp_path / "board3"))
    resumed.Reload()
    assert [(scalar.step, scalar.value) for scalar in resumed.Scalars("epoch") if scalar.step == 3] == [
        (3, 2.0)
    ]
    assert [scalar.step for scalar in resumed.Scalars("train/loss")] == [3]


def test_metrics_file_refuses_unknown_format(tmp_path: Path) -> None:
    """metrics_file, MetricsFileReporter: "format: ``"csv"`` or ``"jsonl"``; by default from the
    suffix (``.csv``, ``.jsonl`` or ``.ndjson``). Raises: ConfigurationError: an unknown
    ``format`` or suffix"."""
    with pytest.raises(ConfigurationError):
        MetricsFileReporter(tmp_path / "curve.txt")
    with pytest.raises(ConfigurationError, match="xml"):
        MetricsFileReporter(tmp_path / "curve.csv", format="xml")  # type: ignore[arg-type]
    MetricsFileReporter(tmp_path / "curve.ndjson").close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_observed_tensorboard_scalars(observed: dict[str, Any]) -> None:
    """observability: TensorBoard gets ``train/loss``, ``validation/loss`` (raw),
    ``validation/loss_smoothed``, ``schedule/learning_rate_factor``, ``perf/epoch_seconds`` per
    epoch; ``train/loss_sampled``, ``perf/examples_per_second``, ``perf/step_seconds``,
    ``perf/communication_seconds`` per sample; ``checkpoint/seconds``; "all against the global
    step (the epoch is the scalar ``epoch``)"; "at an epoch's end that count plus the steps
    after its last sample, so the epochs' points fall where their last step did"."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(observed["directory"] / "tensorboard"))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    per_epoch = {
        "train/loss",
        "validation/loss",
        "validation/loss_smoothed",
        "schedule/learning_rate_factor",
        "perf/epoch_seconds",
        "train/accuracy",
        "validation/accuracy",
        "validation/accuracy_smoothed",
    }
    per_sample = {
        "train/loss_sampled",
        "perf/examples_per_second",
        "perf/step_seconds",
        "perf/communication_seconds",
    }
    assert per_epoch | per_sample | {"checkpoint/seconds", "epoch"} <= tags

    def points(tag: str) -> list[tuple[int, float]]:
        return [(scalar.step, scalar.value) for scalar in accumulator.Scalars(tag)]

    ends = [STEPS_PER_EPOCH * (epoch + 1) for epoch in range(EPOCHS)]
    reference = observed["reference"]["curve"]
    assert [step for step, _ in points("train/loss")] == ends
    assert [value for _, value in points("train/loss")] == pytest.approx(
        [entry["training_loss"] for entry in reference], rel=1e-6
    )
    assert [value for _, value in points("validation/loss")] == pytest.approx(
        [entry["validation"][1] for entry in reference], rel=1e-6
    )
    assert [value for _, value in points("validation/loss_smoothed")] == pytest.approx(
        [entry["validation"][0] for entry in reference], rel=1e-6
    )
    assert [value for _, value in points("schedule/learning_rate_factor")] == pytest.approx(
        observed["factors"]
    )
    samples = [event for event in observed["events"] if isinstance(event, ProgressSampled)]
    assert [step for step, _ in points("train/loss_sampled")] == [sample.total_steps for sample in samples]
    epoch_points = points("epoch")
    assert [(step, value) for step, value in epoch_points if step in ends] == [
        (end, float(epoch)) for epoch, end in enumerate(ends)
    ]
    assert [step for step, _ in points("checkpoint/seconds")] == ends


def test_tensorboard_refuses_bad_flush_secs(tmp_path: Path) -> None:
    """tensorboard, TensorBoardReporter: "Raises: ... ConfigurationError: ``flush_secs`` is not
    positive."""
    for bad in (0, -1.0):
        with pytest.raises(ConfigurationError, match="flush_secs"):
            TensorBoardReporter(tmp_path, flush_secs=bad)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_observed_prometheus_scrapes(observed: dict[str, Any]) -> None:
    """observability: Prometheus "counters of steps, examples, epochs, checkpoints; gauges of
    loss, ... run state (a gauge appears once first measured)"; prometheus: "The counters are
    there from the start, at 0"; "``lamploop_epoch`` (the epoch in progress ..., then the next one
    after ``EpochFinished``)"; "``lamploop_run_state`` (... 0 running, 1 finished ...)"."""
    started = observed["scrapes"]["RunStarted"][0]
    for counter in ("steps", "examples", "epochs", "checkpoints"):
        assert started[f"lamploop_{counter}_total"] == 0.0
    for gauge in ("loss", "validation_loss", "epoch_training_loss", "step_seconds", "checkpoint_seconds"):
        assert f"lamploop_{gauge}" not in started
    assert started["lamploop_run_state"] == 0.0
    assert started["lamploop_ranks"] == 1.0
    finished = observed["scrapes"]["RunFinished"][0]
    reference = observed["reference"]["curve"]
    assert finished["lamploop_steps_total"] == EPOCHS * STEPS_PER_EPOCH
    assert finished["lamploop_examples_total"] == EPOCHS * N_TRAIN
    assert finished["lamploop_epochs_total"] == EPOCHS
    assert finished["lamploop_checkpoints_total"] == EPOCHS
    assert finished["lamploop_epoch"] == EPOCHS
    assert finished["lamploop_run_state"] == 1.0
    assert finished["lamploop_peers_alive"] == 1.0
    assert finished["lamploop_epoch_training_loss"] == pytest.approx(reference[-1]["training_loss"], rel=1e-9)
    assert finished["lamploop_validation_loss"] == pytest.approx(reference[-1]["validation"][1], rel=1e-9)
    assert finished["lamploop_learning_rate_factor"] == pytest.approx(observed["factors"][-1])
    assert finished['lamploop_metric{name="accuracy",split="validation"}'] == pytest.approx(
        reference[-1]["validation_accuracy"][1], rel=1e-9
    )


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_prometheus_port_free_after_fit(observed: dict[str, Any]) -> None:
    """observability: "fit closed the reporters when the run ended: the Prometheus port is free
    again"."""
    with pytest.raises(OSError, match=r"refused|reset|closed"):
        urllib.request.urlopen(observed["prometheus"].url, timeout=2)


def _sample(epoch: int, steps_done: int, examples: int, total_steps: int) -> ProgressSampled:
    return ProgressSampled(
        epoch=epoch,
        steps_done=steps_done,
        examples=examples,
        loss=0.5,
        steps=1,
        seconds_per_step=0.01,
        communication_seconds_per_step=0.002,
        examples_per_second=100.0,
        total_steps=total_steps,
        total_examples=examples,
    )


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_prometheus_counts_only_what_this_process_trained() -> None:
    """observability: "The step and example counters count exactly what this process trained: an
    epoch resumed from a step-boundary checkpoint does not count its earlier steps again";
    prometheus: "``lamploop_peers_alive`` (1 at ``RunStarted``, one more per ``PeerJoined``, one
    less per ``PeerLost``)"; run_state "3 failed"."""
    prometheus = PrometheusReporter(port=0)
    try:
        for event in (
            RunStarted(nranks=3, epoch=1, max_epochs=4),
            PeerJoined(rank=1, nranks=3),
            PeerJoined(rank=2, nranks=3),
            EpochStarted(epoch=1, learning_rate_factor=0.5, steps_done=2, examples_done=64),
            _sample(1, 4, 128, 2),
            EpochFinished(
                LoopState(epoch=2, learning_curve=[LearningCurveEntry(0, 0.5), LearningCurveEntry(1, 0.25)]),
                seconds=1.0,
                steps=6,
                examples=192,
            ),
            CheckpointWritten(epoch=2, steps_done=0, seconds=0.125),
            PeerLost(rank=2, how="died", message="rank 2 died"),
        ):
            prometheus.report(event)
        values = _scrape(prometheus.url)
        assert values["lamploop_steps_total"] == 4.0  # 6 steps, 2 of them before the checkpoint
        assert values["lamploop_examples_total"] == 128.0
        assert values["lamploop_epochs_total"] == values["lamploop_checkpoints_total"] == 1.0
        assert values["lamploop_ranks"] == 3.0
        assert values["lamploop_peers_alive"] == 2.0
        assert values["lamploop_epoch"] == 2.0
        assert values["lamploop_epoch_training_loss"] == 0.25
        assert values["lamploop_checkpoint_seconds"] == 0.125
        assert values["lamploop_learning_rate_factor"] == 0.5
        assert values["lamploop_communication_seconds"] == 0.002
        assert 0.0 <= values["lamploop_seconds_since_checkpoint"] < 30.0
        prometheus.report(RunFailed(error="PeerLostError: rank 2 died"))
        assert _scrape(prometheus.url)["lamploop_run_state"] == 3.0
    finally:
        prometheus.close()
    stopped = PrometheusReporter(port=0)
    try:
        stopped.report(RunStarted(nranks=1, epoch=0, max_epochs=1))
        stopped.report(RunStopped(reason="SIGTERM", message="stopped"))
        assert _scrape(stopped.url)["lamploop_run_state"] == 2.0
    finally:
        stopped.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_prometheus_bad_or_busy_port() -> None:
    """prometheus, PrometheusReporter: "Raises: ... ConfigurationError: the port is out of range
    or cannot be bound"; start: "Raises: ConfigurationError: the port cannot be bound"."""
    for bad in (-1, 70000):
        with pytest.raises(ConfigurationError, match="port"):
            PrometheusReporter(port=bad)
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        reporter = PrometheusReporter(port=busy.getsockname()[1])
        try:
            with pytest.raises(ConfigurationError, match=str(busy.getsockname()[1])):
                reporter.start()
        finally:
            reporter.close()


def test_global_step() -> None:
    """observability: "The **global step** is the count of optimizer steps the process trained,
    over every epoch: a sample's ``total_steps``, and at an epoch's end that count plus the steps
    after its last sample"; global_step (doctest): 0, 30, 40."""
    from lamploop.reporting.global_step import GlobalStep

    steps = GlobalStep()
    assert steps.see(EpochStarted(epoch=0, learning_rate_factor=1.0)) == 0
    assert steps.see(_sample(0, 30, 960, 30)) == 30
    assert (
        steps.see(EpochFinished(LoopState(epoch=1, learning_curve=[LearningCurveEntry(0, 0.5)]), steps=40))
        == 40
    )
    assert steps.see(EpochStarted(epoch=1, learning_rate_factor=1.0)) == 40
    assert steps.see(_sample(1, 5, 160, 45)) == 45
    assert steps.see(CheckpointWritten(epoch=1, steps_done=7)) == 47  # its step boundary
    two = LoopState(epoch=2, learning_curve=[LearningCurveEntry(0, 0.5), LearningCurveEntry(1, 0.4)])
    assert steps.see(EpochFinished(two, steps=40)) == 80


def test_step_breakdown_of_a_slow_stream() -> None:
    """observability: "The breakdown of a pass you run yourself (a stream that sleeps 20 ms before
    each batch shows as data wait)": ``breakdown.steps == 5`` and ``breakdown.data_wait >= 5 *
    0.02``."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)

    async def slow_batches() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(5):
            await anyio.sleep(0.02)
            x = torch.randn(16, 8)
            yield x, (x.sum(dim=1) > 0).long()

    times = StepTimes()
    anyio.run(
        lambda: lamploop.one_epoch(
            model=lamploop.SupervisedModel(module),
            batches=slow_batches(),
            step_optimizer=optimizer.step,
            step_times=times,
        )
    )
    breakdown = times.snapshot()
    assert breakdown.steps == 5
    assert breakdown.data_wait >= 5 * 0.02
    assert breakdown.data_wait + breakdown.forward_backward + breakdown.optimizer <= breakdown.seconds + 1e-9
    assert breakdown.other >= -1e-9


def test_profile_window_and_errors(tmp_path: Path) -> None:
    """observability: "A bad value is a ConfigurationError that names it (``Profile: active must
    be an int >= 1, got 0``)"; profiler: "skip_first steps, then ``repeat`` times: wait | warmup |
    active"; "out_dir ... must not be a file"; "``N`` counting from 0 at the first step"."""
    with pytest.raises(ConfigurationError) as raised:
        Profile(out_dir=tmp_path, active=0)
    assert str(raised.value) == "Profile: active must be an int >= 1, got 0"
    assert Profile(out_dir=tmp_path, wait=1, warmup=1, active=2).steps_in_all == 4
    assert Profile(out_dir=tmp_path, wait=1, warmup=1, active=3).recorded_steps() == [2, 3, 4]
    assert Profile(out_dir=tmp_path, wait=1, warmup=1, active=2, repeat=2).recorded_steps() == [2, 3, 6, 7]
    assert Profile(out_dir=tmp_path, wait=2, warmup=1, active=2, repeat=3, skip_first=1).steps_in_all == 16
    assert Profile(out_dir=tmp_path, repeat=0).steps_in_all is None
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigurationError, match="out_dir"):
        Profile(out_dir=a_file)
    with pytest.raises(ConfigurationError, match="wait"):
        Profile(out_dir=tmp_path, wait=-1)
    with pytest.raises(ConfigurationError, match="record_shapes"):
        Profile(out_dir=tmp_path, record_shapes=1)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_fit_profile_writes_the_window(tmp_path: Path) -> None:
    """observability: "After each window every rank writes ``<out_dir>/rank<R>.<number>.pt.trace.json``
    ... its ``ProfilerStep#N`` spans are the recorded steps (``N`` counts from 0 at the first
    step)"; "Steps are counted across epochs"."""
    x, y = _data(32, seed=14)
    lamploop.fit(
        model=lamploop.SupervisedModel(_module()),
        optimizer_factory=_sgd(0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=8, shuffle=False),  # 4 steps per epoch
        max_epochs=2,
        profile=Profile(out_dir=tmp_path / "traces", wait=2, warmup=1, active=3),  # steps 3, 4, 5
        device="cpu",
        reporters=[],
    )
    (trace,) = (tmp_path / "traces").glob("rank0.*.pt.trace.json")
    spans = {
        event["name"]
        for event in json.loads(trace.read_text())["traceEvents"]
        if event.get("name", "").startswith("ProfilerStep#")
    }
    assert spans == {"ProfilerStep#3", "ProfilerStep#4", "ProfilerStep#5"}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_local_loop_refuses_profile(tmp_path: Path) -> None:
    """observability: "``local_data_parallel_training_loop``, whose replicas are threads of one
    process, refuses ``profile`` with a ConfigurationError"."""
    x, y = _data(16, seed=1)
    batches = lamploop.tensor_batches(x, y, batch_size=8)
    replicas = [(lamploop.SupervisedModel(_module()), batches, None) for _ in range(2)]
    settings = TrainingSettings(max_epochs=1, profile=Profile(out_dir=tmp_path))
    with pytest.raises(ConfigurationError, match="profile"):
        anyio.run(
            lambda: lamploop.local_data_parallel_training_loop(replicas, _sgd(0.1), 1, settings=settings)
        )
    assert not list(tmp_path.glob("*.json"))


FIT_TWO_RANKS = r"""
import json, os, sys, threading
import torch
import lamploop
EXTRAS = {"rich", "tensorboard", "prometheus_client", "mlflow", "wandb"}
loaded = sorted({name.split(".")[0] for name in sys.modules} & EXTRAS)
from lamploop.reporting import LoggingReporter, MetricsFileReporter, PrometheusReporter

out, port = sys.argv[1], int(sys.argv[2])

class Recorder:
    def __init__(self):
        self.calls = []
    def start(self):
        self.calls.append({"call": "start"})
    def report(self, event):
        record = {"call": "report", "event": type(event).__name__, "thread": threading.get_ident()}
        for field in ("nranks", "rank", "epoch", "loss", "examples", "steps", "total_examples"):
            if hasattr(event, field):
                record[field] = getattr(event, field)
        self.calls.append(record)
    def close(self):
        self.calls.append({"call": "close"})
        with open(os.path.join(out, f"calls-{os.getpid()}.json"), "w") as f:
            json.dump({"rank": os.environ.get("LAMPLOOP_RANK"), "calls": self.calls, "loaded": loaded}, f)

torch.manual_seed(0)
x, y = torch.randn(52, 4, dtype=torch.float64), torch.randint(0, 2, (52,))
state = lamploop.fit(
    model=lamploop.SupervisedModel(torch.nn.Linear(4, 2).double()),
    optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.0),
    train_batches=lamploop.tensor_batches(x[:41], y[:41], batch_size=5, shuffle=False),
    validation_batches=lamploop.tensor_batches(x[41:], y[41:], batch_size=3, shuffle=False),
    max_epochs=2,
    world_size=2,
    device="cpu",
    reporters=[Recorder(), PrometheusReporter(port), MetricsFileReporter(os.path.join(out, "curve.csv")),
               LoggingReporter()],
    profile=lamploop.Profile(out_dir=os.path.join(out, "traces"), wait=1, warmup=1, active=2),
)
if state is not None:
    with open(os.path.join(out, "state.json"), "w") as f:
        json.dump(lamploop.state.converter.unstructure(state), f)
"""


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``fit(world_size=2)`` in a script of its own: rank 0 starts rank 1 by running it again."""
    directory = tmp_path_factory.mktemp("two_ranks")
    script = directory / "train.py"
    script.write_text(FIT_TWO_RANKS)
    environment = {key: value for key, value in os.environ.items() if not key.startswith("LAMPLOOP_")}
    environment["OMP_NUM_THREADS"] = "1"
    completed = subprocess.run(
        [sys.executable, str(script), str(directory), str(free_port())],
        capture_output=True,
        text=True,
        timeout=55,
        env=environment,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    calls = [json.loads(path.read_text()) for path in directory.glob("calls-*.json")]
    return {
        "directory": directory,
        "stderr": completed.stderr,
        "calls": calls,
        "state": converter.structure(json.loads((directory / "state.json").read_text()), LoopState),
    }


def _two_rank_reference() -> tuple[float, float]:
    torch.manual_seed(0)
    x, y = torch.randn(52, 4, dtype=F64), torch.randint(0, 2, (52,))
    module = torch.nn.Linear(4, 2).double()
    return _mean_ce(module, x[:41], y[:41]), _mean_ce(module, x[41:], y[41:])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_two_ranks_only_the_root_reports(two_ranks: dict[str, Any]) -> None:
    """observability: "Only the root rank reports; the other ranks make the same reporters (they
    run the same script) and only close them"; custom-reporters: "``fit`` also closes the
    reporters of the other ranks, which get no events"; "``start()`` ... is called by ``fit`` on
    the root before training"."""
    by_rank = {entry["rank"]: entry["calls"] for entry in two_ranks["calls"]}
    assert set(by_rank) == {None, "1"}  # the root runs without LAMPLOOP_RANK (distributed.md)
    assert by_rank["1"] == [{"call": "close"}]
    root = by_rank[None]
    assert root[0] == {"call": "start"}
    assert root[-1] == {"call": "close"}
    events = [call for call in root if call["call"] == "report"]
    assert events[0]["event"] == "RunStarted"
    assert events[0]["nranks"] == 2
    assert [call["rank"] for call in events if call["event"] == "PeerJoined"] == [1]
    assert events[-1]["event"] == "RunFinished"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_two_ranks_losses_and_counts_are_global(two_ranks: dict[str, Any]) -> None:
    """state, LearningCurveEntry: "training_loss: mean training loss over every example of every
    rank"; events, ValidationFinished: "the raw mean validation ``loss`` ... over every rank";
    EpochFinished: "the examples of every rank it trained on"; ProgressSampled.examples:
    "examples of every rank"; DESIGN.md 3: "a rank whose stream is exhausted contributes zero
    examples until every rank is exhausted; no example is dropped and nothing hangs"."""
    training, validation = _two_rank_reference()  # lr 0: the model never moves
    state = two_ranks["state"]
    for entry in state.learning_curve:
        assert entry.training_loss == pytest.approx(training, rel=1e-12)
        assert entry.validation_loss == pytest.approx((validation, validation), rel=1e-12)
    (root,) = [entry["calls"] for entry in two_ranks["calls"] if entry["rank"] is None]
    finished = [call for call in root if call.get("event") == "EpochFinished"]
    # 9 batches: 5 on rank 0, 4 on rank 1 (DESIGN.md 3, uneven streams: no example dropped)
    assert [(call["steps"], call["examples"]) for call in finished] == [(5, 41), (5, 41)]
    first_sample = next(call for call in root if call.get("event") == "ProgressSampled")
    assert first_sample["examples"] == 10  # the first step: a batch of 5 on each rank
    validated = [call["loss"] for call in root if call.get("event") == "ValidationFinished"]
    assert validated == pytest.approx([validation, validation], rel=1e-12)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_two_ranks_files_and_log_lines_once(two_ranks: dict[str, Any]) -> None:
    """observability: "a reporter that binds a port or opens a file does so on the root alone";
    LoggingReporter "with no logging set up, on stderr (``lamploop: epoch 3: train loss ...``)";
    reporting: optional dependencies "are imported when a reporter is made, never by ``import
    lamploop``"."""
    training, validation = _two_rank_reference()
    with (two_ranks["directory"] / "curve.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(row["epoch"]) for row in rows] == [0, 1]
    assert float(rows[0]["training_loss"]) == pytest.approx(training, rel=1e-12)
    epoch_lines = [line for line in two_ranks["stderr"].splitlines() if line.startswith("lamploop: epoch ")]
    assert len(epoch_lines) == 2
    assert epoch_lines[0].startswith(
        f"lamploop: epoch 0: train loss {training:.4f}, validation loss {validation:.4f}"
    )
    assert all(entry["loaded"] == [] for entry in two_ranks["calls"])


# ============================================================================ more, by page


def test_fit_keywords_are_the_settings_fields() -> None:
    """settings (module doc): "``fit`` takes every setting as a flat keyword and collects them into
    one TrainingSettings (... the field names are the keyword names)"; the lower-level entry
    points "take everything beyond lamp as one ``settings=`` object"."""
    import inspect

    fields = {field.name for field in attrs.fields(TrainingSettings)}
    assert fields <= set(inspect.signature(lamploop.fit).parameters)
    for entry in (
        lamploop.drive_distributed_training,
        lamploop.follow_distributed_training,
        lamploop.local_data_parallel_training_loop,
    ):
        assert "settings" in inspect.signature(entry).parameters, entry.__name__


def test_every_rank_fingerprint_numbers_by_value() -> None:
    """settings, every_rank_fingerprint: "The EVERY_RANK settings as one string that the ranks
    compare when they meet. Numbers, strings and frozen attrs values (schedules) by value"."""
    as_int = TrainingSettings(bucket_cap_mb=25, collective_timeout=1800, max_gradient_norm=1)
    as_float = TrainingSettings(bucket_cap_mb=25.0, collective_timeout=1800.0, max_gradient_norm=1.0)
    assert as_int == as_float  # the same values
    assert as_int.every_rank_fingerprint() == as_float.every_rank_fingerprint()


def test_every_rank_fingerprint_own_step_schedule_by_whether_set_and_type_name() -> None:
    """settings, every_rank_fingerprint: "anything else (an ``lr_scheduler`` factory, a step
    schedule of your own) by whether it is set and its type's name" (the page said "by whether
    it is set" alone; the code has always told the types apart, which catches ranks given
    different schedules, so the page changed)."""

    class Mine:
        def factor(self, epoch: int, step: int) -> float:
            return 1.0

    class Theirs:
        def factor(self, epoch: int, step: int) -> float:
            return 0.5

    mine = TrainingSettings(step_schedule=Mine())
    assert mine.every_rank_fingerprint() != TrainingSettings().every_rank_fingerprint()  # set vs not
    assert mine.every_rank_fingerprint() == TrainingSettings(step_schedule=Mine()).every_rank_fingerprint()
    assert mine.every_rank_fingerprint() != TrainingSettings(step_schedule=Theirs()).every_rank_fingerprint()


def test_sync_protocols_are_runtime_checkable() -> None:
    """sync.strategy: GradientSync, CountsStepExamples and SyncStrategy are ``runtime_checkable``
    protocols; CountsStepExamples: "(e.g. local SGD ...)"."""
    from lamploop.sync import CountsStepExamples, GradientSync, SyncStrategy

    assert isinstance(SingleProcessChannel().gradient_sync(_module()), GradientSync)
    assert all(isinstance(strategy_named(name), SyncStrategy) for name in strategy_names())
    assert not isinstance(object(), SyncStrategy)
    assert not isinstance(SingleProcessChannel().gradient_sync(_module()), CountsStepExamples)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_abort_signal() -> None:
    """sync, AbortSignal: "Set once, from any thread ... reason: why it was set (empty until it
    is)"; set: "Abort every wait that looks at this signal (the first reason is kept)";
    give_up_after: "``None`` (the default) ... Set by allow_giving_up"."""
    import threading

    from lamploop.sync import AbortSignal

    abort = AbortSignal()
    assert not abort.is_set()
    assert abort.reason == ""
    assert abort.give_up_after is None
    setter = threading.Thread(target=abort.set, args=("rank 1 died",))
    setter.start()
    setter.join(timeout=10)
    abort.set("a later reason")
    assert abort.is_set()
    assert abort.reason == "rank 1 died"
    abort.allow_giving_up(2.5)
    assert abort.give_up_after == 2.5


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_collectives_tensors_and_bytes(gloo: dict[int, dict[str, Any]]) -> None:
    """sync, Collectives: sum ``per_rank`` "A tensor is copied on its device"; broadcast_tensors:
    "Overwrite ``tensors`` on every rank with rank 0's"; broadcast_bytes: "Rank 0's ``payload``
    on every rank (the others' ``payload`` is ignored)"; gather_bytes_to_root: "Every rank's
    ``payload`` on the root, in rank order (``None`` elsewhere)"."""
    for rank in (0, 1):
        assert gloo[rank]["sum_tensor_slot"] == [2.0, 0.5, 1.5]
        assert gloo[rank]["broadcast_tensors"] == [[[0.0] * 3] * 2, [0.0, 1.0, 2.0, 3.0]]
        assert gloo[rank]["broadcast_bytes"] == "root"
    assert gloo[0]["gather_bytes"] == ["rrr", "rrrr"]
    assert gloo[1]["gather_bytes"] is None


def test_stream_exhausted_ends_the_run() -> None:
    """errors, StreamExhausted: "Raised by ``one_epoch`` ... when the streams are EndingBatchStream
    objects that say they ended ...; ``epochs`` ends the run there, without recording the empty
    epoch"; events, RunFinished: "``reason`` says why it ended before ``max_epochs`` (... the end
    of the streams ...)"."""
    x, y = _data(20, seed=15)

    class Ending:
        def __init__(self, epoch: int) -> None:
            self.epoch = epoch
            self.source_ended = False

        def __aiter__(self) -> AsyncIterator[Any]:
            return self.batches()

        async def batches(self) -> AsyncIterator[Any]:
            if self.epoch < 2:
                for start in (0, 10):
                    yield x[start : start + 10], y[start : start + 10]
            self.source_ended = True

    recorder = Recorder()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(_module()),
        optimizer_factory=_sgd(0.1),
        train_batches=lambda context: Ending(context.epoch),
        max_epochs=5,
        device="cpu",
        reporters=[recorder],
    )
    assert state.epoch == 2
    assert [entry.epoch for entry in state.learning_curve] == [0, 1]
    finished = recorder.events[-1]
    assert isinstance(finished, RunFinished)
    assert "2" in finished.reason
    assert finished.reason != ""


def test_stream_buffer_errors() -> None:
    """errors: "BufferClosedError: A sample was put into a stream buffer after it was closed";
    "DuplicateSampleError: A sample's ``seq`` is not after the last one put from its producer";
    "StreamEnded: A stream buffer is closed and nothing readable is left"."""
    from lamploop.streaming import FifoBuffer, Sample

    buffer = FifoBuffer(capacity=4, watermark=1)
    assert buffer.try_put(Sample("sim", 0, {"x": torch.zeros(1)}))
    with pytest.raises(errors.DuplicateSampleError) as duplicate:
        buffer.try_put(Sample("sim", 0, {"x": torch.zeros(1)}))
    assert isinstance(duplicate.value, ValueError)
    assert "sim" in str(duplicate.value)
    assert buffer.try_get().key == ("sim", 0)
    buffer.close()
    with pytest.raises(errors.BufferClosedError):
        buffer.try_put(Sample("sim", 1, {"x": torch.zeros(1)}))
    with pytest.raises(errors.StreamEnded):
        buffer.try_get()


def _mid_epoch_rates(checkpoint_dir: Path, max_epochs: int, stop: bool, **keywords: Any) -> list[float]:
    x, y = _data(40, seed=16)
    rates: list[float] = []

    def factory(params: Any) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(params, lr=0.8)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: rates.append(opt.param_groups[0]["lr"]))
        return optimizer

    def stop_at_epoch_1(event: Any) -> None:
        if stop and isinstance(event, ProgressSampled) and event.epoch == 1:
            signal.raise_signal(signal.SIGTERM)

    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda number, frame: None)
    try:
        lamploop.fit(
            model=lamploop.SupervisedModel(_module()),
            optimizer_factory=factory,
            train_batches=_slow(lamploop.tensor_batches(x, y, batch_size=10, shuffle=False), 0.025),
            max_epochs=max_epochs,
            checkpoint_dir=checkpoint_dir,
            device="cpu",
            reporters=[Recorder(stop_at_epoch_1)],
            **keywords,
        )
    except TrainingInterrupted:
        assert stop
    finally:
        signal.signal(signal.SIGTERM, previous)
    return rates


@pytest.mark.parametrize("kind", ["step_schedule", "lr_scheduler"])
def test_resumed_mid_epoch_asks_what_the_uninterrupted_run_asked(kind: str, tmp_path: Path) -> None:
    """step: "A step schedule is a pure function of ``(epoch, step)`` ..., so a resumed run (also
    one resumed mid-epoch) asks exactly what the uninterrupted run asked"; torch_scheduler: "so a
    resumed run, also one resumed mid-epoch, steps on exactly"."""
    if kind == "step_schedule":
        keywords: dict[str, Any] = {
            "step_schedule": warmup_cosine(warmup_steps=3, total_steps=12, steps_per_epoch=4)
        }
        expected = [0.8 * _warmup_then("cosine", g, 3, 12, 0.0) for g in range(12)]
    else:
        keywords = {
            "lr_scheduler": lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5),
            "lr_scheduler_interval": "step",
        }
        expected = _torch_rates(12, 3, 1)
    first = _mid_epoch_rates(tmp_path, 3, True, **keywords)
    assert 4 < len(first) < 8  # stopped inside epoch 1
    second = _mid_epoch_rates(tmp_path, 3, False, **keywords)
    assert first + second == pytest.approx(expected, abs=1e-12)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_observed_event_fields(observed: dict[str, Any]) -> None:
    """events: EpochStarted "``expected_steps`` is the previous epoch's step count (``None`` in the
    first epoch of a run)"; RunFinished ``reason`` "empty otherwise"; RunStarted ``model_summary``
    "computed once per run when anyone listens"; CheckpointWritten "at ``epoch`` after
    ``steps_done`` steps of it (0: the epoch's start). ``path`` is its directory"."""
    events = observed["events"]
    started = [event for event in events if isinstance(event, EpochStarted)]
    assert [event.expected_steps for event in started] == [None, STEPS_PER_EPOCH, STEPS_PER_EPOCH]
    assert [event.learning_rate_factor for event in started] == pytest.approx(observed["factors"])
    assert [(event.steps_done, event.examples_done) for event in started] == [(0, 0)] * EPOCHS
    assert events[0].model_summary is not None
    assert (events[0].nranks, events[0].epoch, events[0].max_epochs) == (1, 0, EPOCHS)
    assert events[-1].reason == ""
    assert events[-1].state == observed["state"]
    written = [event for event in events if isinstance(event, CheckpointWritten)]
    assert [(event.epoch, event.steps_done) for event in written] == [(1, 0), (2, 0), (3, 0)]
    assert all(Path(event.path).parent == observed["directory"] / "checkpoints" for event in written)
    now = time.time()
    assert all(now - 3600 < event.time <= now for event in events)


def test_metrics_file_header_rules(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """metrics_file: "the same columns, or more columns that include every one of the row's, are
    carried on (also one without STEP_COLUMNS, written before step breakdowns were: they are left
    out); other headers are refused" (raised by the first report; "the reporter then writes
    nothing"); "A later row with a column the header lacks is written without it, and the lost
    column logged (once)"; epoch_row: "Each training metric also has a ``validation_<m>`` column
    (empty in epochs that did not validate)"."""

    def finished(epoch: int, **entry: Any) -> EpochFinished:
        state = LoopState(epoch=epoch + 1, learning_curve=[LearningCurveEntry(epoch, 0.5, **entry)])
        return EpochFinished(
            state, seconds=1.0, steps=2, examples=3, step_breakdown=StepBreakdown(steps=2, seconds=0.5)
        )

    old = tmp_path / "old.csv"
    base = ",".join(
        [
            "epoch",
            "training_loss",
            "validation_loss",
            "validation_loss_smoothed",
            "learning_rate_factor",
            "seconds",
            "steps",
            "examples",
        ]
    )
    old.write_text(f"{base}\n0,0.5,,,,1.0,2,3\n")
    reporter = MetricsFileReporter(old)
    reporter.report(finished(1))
    reporter.close()
    assert old.read_text().splitlines() == [base, "0,0.5,,,,1.0,2,3", "1,0.5,,,,1.0,2,3"]

    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    reporter = MetricsFileReporter(other)
    with pytest.raises(ConfigurationError):
        reporter.report(finished(0))
    reporter.report(finished(1))
    reporter.close()
    assert other.read_text() == "a,b\n1,2\n"

    grow = tmp_path / "grow.csv"
    reporter = MetricsFileReporter(grow)
    with caplog.at_level(logging.DEBUG, logger="lamploop"):
        reporter.report(finished(0))
        reporter.report(finished(1, training_metrics={"accuracy": 0.5}))
        reporter.report(finished(2, training_metrics={"accuracy": 0.75}))
    reporter.close()
    with grow.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [row["epoch"] for row in rows] == ["0", "1", "2"]
    assert "train_accuracy" not in rows[0]
    lost = [record for record in caplog.records if "train_accuracy" in record.getMessage()]
    assert len(lost) == 1

    metric = tmp_path / "metric.csv"
    reporter = MetricsFileReporter(metric)
    reporter.report(finished(0, training_metrics={"accuracy": 0.5}))
    reporter.close()
    with metric.open(newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert (row["train_accuracy"], row["validation_accuracy"]) == ("0.5", "")


def test_metrics_file_jsonl_nulls_and_close(tmp_path: Path) -> None:
    """metrics_file: "Values a row does not have are empty in CSV and ``null`` in JSON";
    MetricsFileReporter: "path: the file; made (with its directory) when missing"; report:
    "nothing for other events, or after close"; close: "calling it again does nothing"."""
    path = tmp_path / "new" / "dir" / "curve.jsonl"
    reporter = MetricsFileReporter(path)
    state = LoopState(epoch=1, learning_curve=[LearningCurveEntry(0, 0.5)])
    reporter.report(RunStarted(nranks=1, epoch=0, max_epochs=2))
    reporter.report(EpochFinished(state, seconds=1.0, steps=2, examples=8))
    reporter.close()
    reporter.close()
    reporter.report(EpochFinished(state, seconds=1.0, steps=2, examples=8))
    (line,) = path.read_text().splitlines()
    row = json.loads(line)
    assert row["validation_loss"] is None
    assert row["validation_loss_smoothed"] is None
    assert row["learning_rate_factor"] is None
    assert (row["epoch"], row["training_loss"], row["steps"], row["examples"]) == (0, 0.5, 2, 8)


def test_logging_reporter_start_and_end_lines() -> None:
    """logging_reporter: describe_run_started: "a resumed run with no epoch left says so, and how
    to train on"; finished_line: "``"finished after epoch 3: early stopping: ..."``"."""
    logger = logging.getLogger("acceptance.observability.lines")
    logger.propagate = False
    handler = ListHandler()
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    reporter = LoggingReporter(logger=logger)
    curve = [LearningCurveEntry(epoch, 0.5) for epoch in range(4)]
    try:
        reporter.report(RunStarted(nranks=1, epoch=3, max_epochs=3))
        reporter.report(RunStarted(nranks=2, epoch=1, max_epochs=3))
        reporter.report(
            RunFinished(LoopState(epoch=4, learning_curve=curve), reason="early stopping: patience 2")
        )
    finally:
        logger.removeHandler(handler)
    nothing, start, end = (record.getMessage() for record in handler.records)
    assert "max_epochs" in nothing
    assert "3" in nothing
    assert start == "training on 2 rank(s) from epoch 1 to 3"
    assert end == "finished after epoch 3: early stopping: patience 2"
    assert all(record.levelno == logging.INFO for record in handler.records)


def test_progress_reporter_quiet_lines_inside_an_epoch() -> None:
    """progress: "Written to a file or a pipe it prints plain lines only: one when the run starts,
    one per epoch, one at the end (and one every 30 seconds at most inside a long epoch)";
    "``ProgressSampled`` prints nothing unless QUIET_LINE_SECONDS passed (by the events'
    ``time``)"."""
    out = io.StringIO()
    progress = ProgressReporter(out)
    progress.report(RunStarted(nranks=1, epoch=0, max_epochs=1, time=0.0))
    progress.report(EpochStarted(epoch=0, learning_rate_factor=1.0, time=0.0))
    for moment, steps in ((0.5, 1), (10.0, 2), (29.0, 3), (31.0, 4), (40.0, 5), (62.0, 6)):
        progress.report(
            ProgressSampled(0, steps, 64 * steps, 0.5, 1, 0.1, 0.0, 640.0, steps, 64 * steps, time=moment)
        )
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "training on 1 rank(s) from epoch 0 to 1"
    assert len(lines) == 3
    assert "step 4" in lines[1]
    assert "step 6" in lines[2]
    assert "\x1b" not in out.getvalue()


def _ingestion(rank: int, samples: int, fill: int) -> Any:
    from lamploop.reporting.events import IngestionSampled

    return IngestionSampled(
        rank=rank,
        samples=samples,
        samples_per_second=10.0 * (rank + 1),
        bytes_per_second=1000.0,
        put_seconds_mean=0.01,
        fill=fill,
        capacity=100,
        reads=7,
        evicted=0,
        duplicates=1,
        refusals=0,
        seen_histogram={0: 3, 2: 5},
    )


def test_tensorboard_ingestion_and_checkpoint_axes(tmp_path: Path) -> None:
    """tensorboard: "``IngestionSampled`` ..., on an x axis of its own, ``samples`` ...:
    ``ingest/samples_per_second``, ... ``ingest/buffer_fill`` (the fraction of the capacity
    held) and ``ingest/reads``; under ``ingest/rank<r>/`` for ranks other than 0";
    "``CheckpointWritten``: ``checkpoint/seconds``, at its step boundary's global step"; "the
    event file is made at the first event"."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = TensorBoardReporter(tmp_path / "board")
    assert not (tmp_path / "board").exists()
    for event in (
        RunStarted(nranks=2, epoch=0, max_epochs=1),
        EpochStarted(epoch=0, learning_rate_factor=1.0),
        _sample(0, 1, 8, 1),
        _ingestion(0, 50, 25),
        _ingestion(1, 60, 30),
        CheckpointWritten(epoch=0, steps_done=3, seconds=0.5),
        _sample(0, 4, 32, 4),
        _ingestion(0, 80, 40),
        EpochFinished(LoopState(epoch=1, learning_curve=[LearningCurveEntry(0, 0.5)]), seconds=1.0, steps=5),
        CheckpointWritten(epoch=1, steps_done=0, seconds=0.25),
    ):
        board.report(event)
    board.close()
    board.close()
    accumulator = EventAccumulator(str(tmp_path / "board"))
    accumulator.Reload()

    def points(tag: str) -> list[tuple[int, float]]:
        return [(scalar.step, round(scalar.value, 6)) for scalar in accumulator.Scalars(tag)]

    assert points("ingest/samples_per_second") == [(50, 10.0), (80, 10.0)]
    assert points("ingest/buffer_fill") == [(50, 0.25), (80, 0.4)]
    assert points("ingest/reads") == [(50, 7.0), (80, 7.0)]
    assert points("ingest/rank1/samples_per_second") == [(60, 20.0)]
    assert points("ingest/rank1/buffer_fill") == [(60, 0.3)]
    assert points("checkpoint/seconds") == [(3, 0.5), (5, 0.25)]
    assert points("train/loss") == [(5, 0.5)]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_prometheus_ingestion_namespace_and_registry() -> None:
    """prometheus: "A streamed run's ``IngestionSampled``, labelled by ``rank``:
    ``lamploop_ingest_samples``, ... ``lamploop_buffer_seen`` (resident samples by their ``reads``
    count)"; "namespace: the metric names' prefix"; "registry: the registry to put the metrics in
    (and serve)"; "from its own registry (two reporters in a process do not clash)"."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    named = PrometheusReporter(0, namespace="myrun", registry=registry)
    plain = PrometheusReporter(0)
    try:
        for reporter in (named, plain):
            reporter.report(RunStarted(nranks=2, epoch=0, max_epochs=1))
            reporter.report(_ingestion(0, 50, 25))
            reporter.report(_ingestion(1, 60, 30))
        values = _scrape(plain.url)
        assert values['lamploop_ingest_samples{rank="0"}'] == 50.0
        assert values['lamploop_ingest_samples{rank="1"}'] == 60.0
        assert values['lamploop_ingest_samples_per_second{rank="1"}'] == 20.0
        assert values['lamploop_ingest_put_seconds{rank="0"}'] == 0.01
        assert values['lamploop_buffer_fill{rank="1"}'] == 30.0
        assert values['lamploop_buffer_capacity{rank="0"}'] == 100.0
        assert values['lamploop_buffer_reads{rank="0"}'] == 7.0
        assert values['lamploop_buffer_seen{rank="0",reads="2"}'] == 5.0
        mine = _scrape(named.url)
        assert mine["myrun_steps_total"] == 0.0
        assert not any(name.startswith("lamploop_") for name in mine)
        assert any(metric.name.startswith("myrun_") for metric in registry.collect())
    finally:
        named.close()
        plain.close()
        plain.close()


def test_profile_run_ending_inside_a_window(tmp_path: Path) -> None:
    """observability: "a run that ends inside a window writes what the window recorded, and its
    last span then runs from the last step to the run's end"; profiler: "``N`` counting from 0 at
    the first step profiled"."""
    x, y = _data(32, seed=17)
    lamploop.fit(
        model=lamploop.SupervisedModel(_module()),
        optimizer_factory=_sgd(0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=8, shuffle=False),  # 4 steps
        max_epochs=1,
        profile=Profile(out_dir=tmp_path, wait=0, warmup=1, active=10),  # steps 1..10: cut at 4
        device="cpu",
        reporters=[],
    )
    (trace,) = tmp_path.glob("rank0.*.pt.trace.json")
    spans = {
        event["name"]
        for event in json.loads(trace.read_text())["traceEvents"]
        if event.get("name", "").startswith("ProfilerStep#")
    }
    assert {"ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"} <= spans
    assert spans <= {"ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_two_ranks_reporters_on_one_thread_and_every_rank_profiled(two_ranks: dict[str, Any]) -> None:
    """observability: "With several ranks, the epoch runs on a worker thread and the event is
    handed to the event loop, so reporters always run on one thread"; "``fit(world_size=n)`` and
    the drivers profile every rank"; "every rank writes ``<out_dir>/rank<R>.<number>.pt.trace.json``";
    ProgressSampled ``loss``: "the mean training loss per example over the steps since the
    previous sample (every rank's)"."""
    (root,) = [entry["calls"] for entry in two_ranks["calls"] if entry["rank"] is None]
    threads = {call["thread"] for call in root if call["call"] == "report"}
    assert len(threads) == 1
    traces = two_ranks["directory"] / "traces"
    assert len(list(traces.glob("rank0.*.pt.trace.json"))) == 1
    assert len(list(traces.glob("rank1.*.pt.trace.json"))) == 1
    torch.manual_seed(0)
    x, y = torch.randn(52, 4, dtype=F64), torch.randint(0, 2, (52,))
    module = torch.nn.Linear(4, 2).double()
    first_sample = next(call for call in root if call.get("event") == "ProgressSampled")
    assert first_sample["loss"] == pytest.approx(_mean_ce(module, x[:10], y[:10]), rel=1e-12)


def _trained(x: torch.Tensor, y: torch.Tensor, **keywords: Any) -> list[torch.Tensor]:
    """The parameters after one epoch of ``fit`` (batches of 10 in order, SGD lr 0.5, no validation)."""
    module = _module(seed=21)
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=_sgd(0.5),
        train_batches=lamploop.tensor_batches(x, y, batch_size=10, shuffle=False),
        max_epochs=1,
        device="cpu",
        reporters=[],
        **keywords,
    )
    return [parameter.detach() for parameter in module.parameters()]


def _plain_epoch(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    accumulate: int = 1,
    clip: float | None = None,
    skip: tuple[int, ...] = (),
) -> list[torch.Tensor]:
    """The same epoch in plain PyTorch: a step's gradient is that of the mean loss over its
    examples (DESIGN.md 3), an epoch ending inside a group still steps with what it has."""
    module = _module(seed=21)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    batches = [(x[start : start + 10], y[start : start + 10]) for start in range(0, len(x), 10)]
    for step, start in enumerate(range(0, len(batches), accumulate)):
        group = batches[start : start + accumulate]
        count = sum(len(target) for _, target in group)
        optimizer.zero_grad()
        for features, target in group:
            (torch.nn.functional.cross_entropy(module(features), target, reduction="sum") / count).backward()
        if step in skip:
            continue
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
    return [parameter.detach() for parameter in module.parameters()]


def test_setting_accumulate_gradient_over_n_batches() -> None:
    """settings: "accumulate_gradient_over_n_batches: batches per optimizer step on each rank";
    DESIGN.md 3: "one optimizer step uses the gradient of (sum of losses of every example in the
    step ...) / (number of those examples)"; "An epoch that ends in the middle of an accumulation
    group still steps with what it has"."""
    x, y = _data(45, seed=22)  # 5 batches: steps of 2, 2 and 1 batches (the last one of 5)
    got = _trained(x, y, accumulate_gradient_over_n_batches=2)
    for parameter, expected in zip(got, _plain_epoch(x, y, accumulate=2), strict=True):
        torch.testing.assert_close(parameter, expected, rtol=0, atol=1e-12)


def test_setting_max_gradient_norm() -> None:
    """settings: "max_gradient_norm: clip each step's summed gradient to this global L2 norm";
    fit: "as ``torch.nn.utils.clip_grad_norm_``"."""
    x, y = _data(40, seed=23)
    got = _trained(x, y, max_gradient_norm=0.05)
    for parameter, expected in zip(got, _plain_epoch(x, y, clip=0.05), strict=True):
        torch.testing.assert_close(parameter, expected, rtol=0, atol=1e-12)
    unclipped = _plain_epoch(x, y)
    assert max(float((a - b).abs().max()) for a, b in zip(got, unclipped, strict=True)) > 1e-3


def test_setting_on_non_finite_loss_skip_step() -> None:
    """settings: "on_non_finite_loss: ``"raise"`` or ``"skip_step"``"; fit: "``"skip_step"``
    skips that step on every rank and goes on"."""
    x, y = _data(40, seed=24)
    x[25] = math.nan  # in step 2
    got = _trained(x, y, on_non_finite_loss="skip_step")
    for parameter, expected in zip(got, _plain_epoch(x, y, skip=(2,)), strict=True):
        torch.testing.assert_close(parameter, expected, rtol=0, atol=1e-12)
        assert torch.isfinite(parameter).all()


def test_setting_early_stopping_patience() -> None:
    """settings: "early_stopping_patience: stop after this many validations without a new best";
    events, RunFinished: "``reason`` says why it ended before ``max_epochs``
    (``"early stopping: ..."``...)"."""
    x, y = _data(45, seed=25)
    recorder = Recorder()
    state = lamploop.fit(  # lr 0: every validation loss equals the first, never a new best
        model=lamploop.SupervisedModel(_module()),
        optimizer_factory=_sgd(0.0),
        train_batches=lamploop.tensor_batches(x[:30], y[:30], batch_size=10),
        validation_batches=lamploop.tensor_batches(x[30:], y[30:], batch_size=15),
        max_epochs=10,
        early_stopping_patience=2,
        device="cpu",
        reporters=[recorder],
    )
    assert state.epoch == 3
    assert state.min_validation_epoch == 0
    assert recorder.events[-1].reason.startswith("early stopping")


def test_setting_checkpoint_every_n_steps(tmp_path: Path) -> None:
    """settings: "checkpoint_every_n_steps, checkpoint_every_seconds: checkpoints inside epochs";
    events: "CheckpointWritten (inside the epoch, when a step-boundary checkpoint is written)",
    "at ``epoch`` after ``steps_done`` steps of it (0: the epoch's start)"."""
    x, y = _data(45, seed=26)  # 5 steps per epoch
    recorder = Recorder()
    lamploop.fit(
        model=lamploop.SupervisedModel(_module()),
        optimizer_factory=_sgd(0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=10),
        max_epochs=2,
        checkpoint_dir=tmp_path,
        checkpoint_every_n_steps=2,
        keep_last=None,
        device="cpu",
        reporters=[recorder],
    )
    written = [
        (event.epoch, event.steps_done) for event in recorder.events if isinstance(event, CheckpointWritten)
    ]
    assert written == [(0, 2), (0, 4), (1, 0), (1, 2), (1, 4), (2, 0)]
    kinds = [type(event) for event in recorder.events]
    first_end = kinds.index(EpochFinished)
    assert kinds[:first_end].count(CheckpointWritten) == 2  # inside epoch 0, before its end


@pytest.mark.timeout(60)
def test_progress_samples_every_half_second() -> None:
    """observability: "Every 0.5 s (and after each epoch's first step) the sampler makes one
    ProgressSampled event"; ProgressSampled: "loss: the mean training loss per example over the
    steps since the previous sample", "steps: the steps since the previous sample",
    "seconds_per_step: mean wall-clock seconds per step since the previous sample"."""
    x, y = _data(48, seed=27)
    module = _module()
    reference = torch.nn.Linear(4, 2).double()
    reference.load_state_dict(_clone(module))

    def slow(context: Any) -> AsyncIterator[Any]:
        async def batches() -> AsyncIterator[Any]:
            for start in range(0, 48, 4):
                await anyio.sleep(0.1)
                yield x[start : start + 4], y[start : start + 4]

        return batches()

    recorder = Recorder()
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=_sgd(0.0),  # the model stays the reference
        train_batches=slow,
        max_epochs=1,
        device="cpu",
        reporters=[recorder],
    )
    samples = [event for event in recorder.events if isinstance(event, ProgressSampled)]
    assert samples[0].steps_done == 1
    assert len(samples) >= 2  # 12 steps of >= 0.1 s: one at the first step, then each 0.5 s
    previous = 0
    for earlier, sample in zip([None, *samples], samples, strict=False):
        assert sample.steps == sample.steps_done - previous
        assert sample.examples == 4 * sample.steps_done
        expected = _mean_ce(
            reference, x[4 * previous : 4 * sample.steps_done], y[4 * previous : 4 * sample.steps_done]
        )
        assert sample.loss == pytest.approx(expected, rel=1e-12)
        assert sample.seconds_per_step >= 0.09
        if earlier is not None:
            assert sample.time - earlier.time >= 0.45
        previous = sample.steps_done


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_observed_log_records(observed: dict[str, Any]) -> None:
    """logging_reporter: "Logs a run's epochs, start and end at ``level``"; "The start is
    followed by the model's summary (a record of its own ...) when the run made one"; observability:
    "one line per epoch"."""
    at_level = [record for record in observed["records"] if record.levelno == logging.INFO]
    messages = [record.getMessage() for record in at_level]
    assert messages[0] == f"training on 1 rank(s) from epoch 0 to {EPOCHS}"
    assert "Linear" in messages[1]
    assert [message.split(":")[0] for message in messages if message.startswith("epoch ")] == [
        f"epoch {epoch}" for epoch in range(EPOCHS)
    ]
    assert messages[-1] == f"finished after epoch {EPOCHS - 1}"
    assert all(record.levelno <= logging.INFO for record in observed["records"])  # nothing went wrong
    with (observed["directory"] / "curve.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(row["training_loss"]) for row in rows] == [
        entry.training_loss for entry in observed["state"].learning_curve
    ]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_prometheus_seconds_since_checkpoint_is_computed_when_scraped() -> None:
    """prometheus: "``lamploop_seconds_since_checkpoint`` (computed when scraped: since the last
    checkpoint, else since ``RunStarted``)"."""
    prometheus = PrometheusReporter(port=0)
    try:
        prometheus.report(RunStarted(nranks=1, epoch=0, max_epochs=1))
        first = _scrape(prometheus.url)["lamploop_seconds_since_checkpoint"]
        time.sleep(0.3)
        second = _scrape(prometheus.url)["lamploop_seconds_since_checkpoint"]
        assert second - first >= 0.25
        prometheus.report(CheckpointWritten(epoch=0, steps_done=1, seconds=0.1))
        assert _scrape(prometheus.url)["lamploop_seconds_since_checkpoint"] < second
    finally:
        prometheus.close()
