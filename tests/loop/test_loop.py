"""Property tests of ``lamploop.epochs`` against an independent reference model.

The reference (``reference_run``) is a plain synchronous transcription of
DESIGN.md section 3 and of the schedules' docstrings; it shares no code with
``lamploop.loop`` or ``lamploop.schedules``.  The tests drive ``epochs`` with
scripted losses and compare every observable effect, in order: the lr factor
passed to ``train_epoch``, the validation calls, the ``save_min_validation_loss_model``
calls, the ``checkpoint_state`` calls (loop state and schedule state), what the
schedule is asked, and the returned ``LoopState``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Container
from typing import Any

import anyio
import attrs
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import lamploop
from lamploop import ALL_EPOCHS, LearningCurveEntry, LoopState, schedules
from lamploop.errors import ConfigurationError, NonFiniteLossError

MAX_EPOCHS = 12
PROPERTY_SETTINGS = settings(
    deadline=None,
    max_examples=250,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)

# --------------------------------------------------------------------------- scenarios


@attrs.frozen
class CountSpec:
    """``from_epoch_count``: ``values[e]`` before ``stop``, ``stop_value`` (<= 0) from then on."""

    values: tuple[float, ...]
    stop: int
    stop_value: float


@attrs.frozen
class LinearSpec:
    """``linear(start, 0, max_steps)``: stops at ``max_steps``."""

    start: float
    max_steps: int


@attrs.frozen
class PlateauSpec:
    start_factor: float
    reduce_factor: float
    patience: int
    threshold: float
    min_factor: float


@attrs.frozen
class NoopSpec:
    pass


@attrs.frozen
class Scenario:
    train: tuple[float, ...]
    valid: tuple[float, ...]
    has_validation: bool
    frequency: int
    smoothing: float
    eligible: Container[int]
    schedule: Any
    # True when every number is a small dyadic fraction: then all arithmetic is
    # exact and any formula equal to DESIGN's gives bit-identical results.
    exact: bool


def make_schedule(spec: Any, frequency: int = 1) -> schedules.LearningRateSchedule[Any]:
    if isinstance(spec, NoopSpec):
        return schedules.noop()
    if isinstance(spec, CountSpec):
        return schedules.from_epoch_count(lambda e: spec.values[e] if e < spec.stop else spec.stop_value)
    if isinstance(spec, LinearSpec):
        return schedules.linear(start=spec.start, end=0.0, max_steps=spec.max_steps)
    if isinstance(spec, PlateauSpec):
        return schedules.reduce_lr_on_plateau(
            start_factor=spec.start_factor,
            reduce_factor=spec.reduce_factor,
            patience=spec.patience,
            threshold=spec.threshold,
            min_factor=spec.min_factor,
            validation_frequency=frequency,
        )
    raise AssertionError(spec)


@st.composite
def scenarios(draw: st.DrawFn, *, plateau_only: bool = False, min_frequency: int = 1) -> Scenario:
    exact = draw(st.booleans())
    if exact:
        loss = st.integers(0, 64).map(lambda i: i / 8)
        positive = st.integers(1, 32).map(lambda i: i / 8)
        smoothing = draw(st.sampled_from([1.0, 0.5, 0.25, 0.75, 0.125, 0.875]))
    else:
        loss = st.floats(0.01, 100.0)
        positive = st.floats(0.01, 4.0)
        smoothing = draw(st.floats(0.01, 1.0))
    train = tuple(draw(st.lists(loss, min_size=MAX_EPOCHS, max_size=MAX_EPOCHS)))
    valid = tuple(draw(st.lists(loss, min_size=MAX_EPOCHS, max_size=MAX_EPOCHS)))
    plateau = st.builds(
        PlateauSpec,
        start_factor=positive,
        reduce_factor=st.sampled_from([0.5, 0.25, 0.75]),
        patience=st.integers(0, 3),
        threshold=st.sampled_from([0.0, 0.0625, 0.25]),
        min_factor=st.sampled_from([0.0, 0.125]),
    )
    if plateau_only:
        spec: Any = draw(plateau)
        has_validation = True
    else:
        has_validation = draw(st.booleans())
        stateless = st.one_of(
            st.just(NoopSpec()),
            st.builds(
                CountSpec,
                values=st.lists(positive, min_size=MAX_EPOCHS + 1, max_size=MAX_EPOCHS + 1).map(tuple),
                stop=st.integers(0, MAX_EPOCHS + 1),
                stop_value=st.sampled_from([0.0, -0.5, -1.0]),
            ),
            st.builds(LinearSpec, start=positive, max_steps=st.integers(1, MAX_EPOCHS + 1)),
        )
        spec = draw(st.one_of(stateless, plateau) if has_validation else stateless)
    eligible = draw(
        st.one_of(
            st.just(ALL_EPOCHS),
            st.just(()),
            st.frozensets(st.integers(0, MAX_EPOCHS - 1)),
        )
    )
    return Scenario(
        train=train,
        valid=valid,
        has_validation=has_validation,
        frequency=draw(st.integers(min_frequency, 4)),
        smoothing=smoothing,
        eligible=eligible,
        schedule=spec,
        exact=exact,
    )


# --------------------------------------------------------------------------- reference


class ReferencePlateau:
    """The plateau rule of the docstring, fed one value per validation that ran."""

    def __init__(self, spec: PlateauSpec) -> None:
        self.spec = spec
        self.factor = spec.start_factor
        self.best: float | None = None
        self.bad = 0

    def observe(self, value: float) -> None:
        if self.best is None or value < self.best - self.spec.threshold * abs(self.best):
            self.best, self.bad = value, 0
            return
        self.bad += 1
        if self.bad > self.spec.patience:
            self.factor = max(self.factor * self.spec.reduce_factor, self.spec.min_factor)
            self.bad = 0


def reference_factor(spec: Any, plateau: ReferencePlateau | None, epoch: int) -> float:
    if isinstance(spec, NoopSpec):
        return 1.0
    if isinstance(spec, CountSpec):
        return spec.values[epoch] if epoch < spec.stop else spec.stop_value
    if isinstance(spec, LinearSpec):
        return spec.start * (spec.max_steps - min(epoch, spec.max_steps)) / spec.max_steps
    assert plateau is not None
    return plateau.factor


@attrs.define
class Reference:
    final: LoopState
    events: list[tuple[Any, ...]]
    asks: list[tuple[int, float | None]]
    fragile: bool  # a comparison too close to call across float formula orderings


def reference_run(sc: Scenario, *, max_epochs: int) -> Reference:
    a = sc.smoothing
    plateau = ReferencePlateau(sc.schedule) if isinstance(sc.schedule, PlateauSpec) else None
    events: list[tuple[Any, ...]] = []
    asks: list[tuple[int, float | None]] = []
    fragile = False
    last = best = None
    best_epoch = None
    curve: list[LearningCurveEntry] = []
    observed: float | None = None  # smoothed loss of the validation that ran in the previous epoch

    def near(x: float, y: float) -> bool:
        return not sc.exact and abs(x - y) <= 1e-9 * max(1.0, abs(x), abs(y))

    epoch = 0
    while True:
        if plateau is not None and observed is not None:
            if plateau.best is not None:
                bound = plateau.best - plateau.spec.threshold * abs(plateau.best)
                fragile |= near(observed, bound)
            plateau.observe(observed)
        factor = reference_factor(sc.schedule, plateau, epoch)
        asks.append((epoch, last))
        schedule_state = None if plateau is None else (plateau.factor, plateau.best, plateau.bad)
        if epoch >= max_epochs or factor <= 0:
            break
        events.append(("train", epoch, factor))
        validation = None
        if sc.has_validation and epoch % sc.frequency == 0:
            events.append(("valid", epoch))
            raw = sc.valid[epoch]
            previous = last if last is not None else raw
            smoothed = raw * a + previous * (1 - a)
            validation = (smoothed, raw)
            last = smoothed
            eligible = sc.eligible is ALL_EPOCHS or epoch in sc.eligible
            if eligible and best is not None:
                fragile |= near(smoothed, best)
            if eligible and (best is None or smoothed < best):
                best, best_epoch = smoothed, epoch
                events.append(("save", epoch))
        observed = None if validation is None else validation[0]
        curve.append(LearningCurveEntry(epoch, sc.train[epoch], validation, learning_rate_factor=factor))
        state = LoopState(epoch + 1, last, best, best_epoch, tuple(curve))
        events.append(("checkpoint", state, schedule_state))
        epoch += 1
    final = LoopState(epoch, last, best, best_epoch, tuple(curve))
    return Reference(final, events, asks, fragile)


# --------------------------------------------------------------------------- driving epochs


class RecordingSchedule:
    """Wraps a schedule and records what it is asked."""

    def __init__(self, inner: schedules.LearningRateSchedule[Any]) -> None:
        self.inner = inner
        self.asks: list[tuple[int, float | None]] = []

    @property
    def needs_validation_loss(self) -> bool:
        return self.inner.needs_validation_loss

    @property
    def state_type(self) -> Any:
        return self.inner.state_type

    def init(self) -> Any:
        return self.inner.init()

    def learning_rate_factor(
        self, state: Any, epoch: int, last_validation_loss: float | None
    ) -> tuple[Any, float]:
        self.asks.append((epoch, last_validation_loss))
        return self.inner.learning_rate_factor(state, epoch, last_validation_loss)

    def __getattr__(self, name: str) -> Any:  # e.g. the plateau schedule's validation_frequency
        return getattr(self.inner, name)


@attrs.define
class Run:
    final: LoopState
    events: list[tuple[Any, ...]]
    asks: list[tuple[int, float | None]]


def run_epochs(
    sc: Scenario,
    *,
    max_epochs: int,
    init_state: LoopState | None = None,
    schedule_init_state: Any = None,
) -> Run:
    events: list[tuple[Any, ...]] = []
    schedule = RecordingSchedule(make_schedule(sc.schedule, sc.frequency))
    next_epoch = [init_state.epoch if init_state is not None else 0]
    current = [-1]

    async def train_epoch(factor: float) -> float:
        current[0] = next_epoch[0]
        next_epoch[0] += 1
        events.append(("train", current[0], factor))
        return sc.train[current[0]]

    async def validation_epoch() -> float:
        events.append(("valid", current[0]))
        return sc.valid[current[0]]

    async def save() -> None:
        events.append(("save", current[0]))

    async def checkpoint(state: LoopState, schedule_state: Any) -> None:
        events.append(("checkpoint", state, schedule_state))

    async def main() -> LoopState:
        return await lamploop.epochs(
            max_epochs=max_epochs,
            train_epoch=train_epoch,
            validation_epoch=validation_epoch if sc.has_validation else None,
            save_min_validation_loss_model=save,
            checkpoint_state=checkpoint,
            validation_frequency=sc.frequency,
            return_min_validation_loss_model=sc.eligible,
            learning_rate_schedule=schedule,
            init_state=init_state,
            learning_rate_schedule_init_state=schedule_init_state,
            validation_loss_exponential_smoothing_factor=sc.smoothing,
        )

    final = anyio.run(main, backend="asyncio")
    return Run(final, events, schedule.asks)


# --------------------------------------------------------------------------- comparison


def _close(actual: Any, expected: Any, path: str) -> None:
    if isinstance(expected, float) and not isinstance(actual, bool) and isinstance(actual, (int, float)):
        assert math.isclose(actual, expected, rel_tol=1e-12, abs_tol=1e-12), (
            f"{path}: {actual!r} != {expected!r}"
        )
    elif isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)), f"{path}: {actual!r} is not a sequence"
        assert len(actual) == len(expected), f"{path}: length {len(actual)} != {len(expected)}"
        for i, (x, y) in enumerate(zip(actual, expected, strict=True)):
            _close(x, y, f"{path}[{i}]")
    elif attrs.has(type(expected)):
        assert type(actual) is type(expected), f"{path}: {type(actual).__name__} != {type(expected).__name__}"
        for field in attrs.fields(type(expected)):
            _close(getattr(actual, field.name), getattr(expected, field.name), f"{path}.{field.name}")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


def schedule_state_view(state: Any) -> Any:
    """The documented attributes of a schedule state, comparable to the reference's."""
    if isinstance(state, schedules.PlateauState):
        return (state.factor, state.best, state.bad_validations)
    return state


def assert_matches(run: Run, ref: Reference) -> None:
    _close(run.final, ref.final, "final")
    actual_kinds = [(e[0], e[1].epoch if e[0] == "checkpoint" else e[1]) for e in run.events]
    expected_kinds = [(e[0], e[1].epoch if e[0] == "checkpoint" else e[1]) for e in ref.events]
    assert actual_kinds == expected_kinds
    for i, (actual, expected) in enumerate(zip(run.events, ref.events, strict=True)):
        if actual[0] == "train":
            _close(actual[2], expected[2], f"factor of epoch {actual[1]}")
        elif actual[0] == "checkpoint":
            _close(actual[1], expected[1], f"checkpoint {i} loop state")
            _close(schedule_state_view(actual[2]), expected[2], f"checkpoint {i} schedule state")
    _close(run.asks, ref.asks, "schedule asks")


# --------------------------------------------------------------------------- properties


@PROPERTY_SETTINGS
@given(sc=scenarios(), max_epochs=st.integers(0, MAX_EPOCHS))
def test_epochs_matches_reference(sc: Scenario, max_epochs: int) -> None:
    ref = reference_run(sc, max_epochs=max_epochs)
    assume(not ref.fragile)
    assert_matches(run_epochs(sc, max_epochs=max_epochs), ref)


@PROPERTY_SETTINGS
@given(sc=scenarios(), max_epochs=st.integers(0, MAX_EPOCHS))
def test_returned_state_is_last_checkpoint_and_curve_is_consistent(sc: Scenario, max_epochs: int) -> None:
    run = run_epochs(sc, max_epochs=max_epochs)
    final = run.final
    checkpoints = [e for e in run.events if e[0] == "checkpoint"]
    trained = [e[1] for e in run.events if e[0] == "train"]
    assert trained == list(range(final.epoch))
    assert [c[1].epoch for c in checkpoints] == [e + 1 for e in trained]
    if checkpoints:
        assert checkpoints[-1][1] == final
    else:
        assert final == LoopState()
    assert [entry.epoch for entry in final.learning_curve] == trained
    assert [entry.training_loss for entry in final.learning_curve] == [sc.train[e] for e in trained]
    for entry in final.learning_curve:
        ran = sc.has_validation and entry.epoch % sc.frequency == 0
        assert (entry.validation_loss is not None) == ran
        if entry.validation_loss is not None:
            assert entry.validation_loss[1] == sc.valid[entry.epoch]
    # min_validation_loss is the minimum smoothed loss over the eligible validated epochs.
    eligible = [
        e.validation_loss[0]
        for e in final.learning_curve
        if e.validation_loss is not None and (sc.eligible is ALL_EPOCHS or e.epoch in sc.eligible)
    ]
    assert final.min_validation_loss == (min(eligible) if eligible else None)
    saves = [e[1] for e in run.events if e[0] == "save"]
    assert final.min_validation_epoch == (saves[-1] if saves else None)


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(plateau_only=True, min_frequency=2), data=st.data())
def test_resume_from_checkpoint_equals_uninterrupted_run(sc: Scenario, data: st.DataObject) -> None:
    max_epochs = data.draw(st.integers(2, MAX_EPOCHS), label="max_epochs")
    stop = data.draw(st.integers(1, max_epochs - 1), label="interrupt at")
    whole = run_epochs(sc, max_epochs=max_epochs)

    first = run_epochs(sc, max_epochs=stop)
    checkpoints = [e for e in first.events if e[0] == "checkpoint"]
    assert checkpoints[-1][1].epoch == stop
    assert first.final == checkpoints[-1][1]
    _, loop_state, schedule_state = checkpoints[-1]
    # A checkpoint stores both as JSON.
    schedule_type = make_schedule(sc.schedule, sc.frequency).state_type
    loop_state = lamploop.state.converter.structure(
        json.loads(json.dumps(lamploop.state.converter.unstructure(loop_state))), LoopState
    )
    schedule_state = lamploop.state.converter.structure(
        json.loads(json.dumps(lamploop.state.converter.unstructure(schedule_state))), schedule_type
    )
    second = run_epochs(sc, max_epochs=max_epochs, init_state=loop_state, schedule_init_state=schedule_state)

    assert second.final == whole.final
    assert first.events + second.events == whole.events
    # The resumed run asks the schedule exactly what the uninterrupted one asked.
    assert [ask for ask in whole.asks if ask[0] >= stop] == second.asks


# --------------------------------------------------------------------------- targeted examples


def test_smoothing_carries_over_epochs_without_validation() -> None:
    sc = Scenario(
        train=(1.0,) * MAX_EPOCHS,
        valid=(8.0, 0, 0, 4.0, 0, 0, 2.0, 0, 0, 0, 0, 0),
        has_validation=True,
        frequency=3,
        smoothing=0.5,
        eligible=ALL_EPOCHS,
        schedule=NoopSpec(),
        exact=True,
    )
    run = run_epochs(sc, max_epochs=7)
    curve = run.final.learning_curve
    # 8 -> 4*0.5 + 8*0.5 = 6 -> 2*0.5 + 6*0.5 = 4
    assert [e.validation_loss for e in curve] == [(8.0, 8.0), None, None, (6.0, 4.0), None, None, (4.0, 2.0)]
    assert run.final.last_validation_loss == 4.0
    # What the schedule saw before each epoch: the carried smoothed loss, never None after epoch 0.
    assert run.asks == [(0, None), (1, 8.0), (2, 8.0), (3, 8.0), (4, 6.0), (5, 6.0), (6, 6.0), (7, 4.0)]
    assert [e[1] for e in run.events if e[0] == "save"] == [0, 3, 6]


def test_only_eligible_epochs_become_best() -> None:
    sc = Scenario(
        train=(1.0,) * MAX_EPOCHS,
        valid=(5.0, 1.0, 3.0, 2.0, 0.5) + (9.0,) * 7,
        has_validation=True,
        frequency=1,
        smoothing=1.0,
        eligible=frozenset({0, 2, 3}),
        schedule=NoopSpec(),
        exact=True,
    )
    run = run_epochs(sc, max_epochs=5)
    # epoch 1 (1.0) and 4 (0.5) are lower but not eligible; 3 (2.0) beats 2 (3.0).
    assert [e[1] for e in run.events if e[0] == "save"] == [0, 2, 3]
    assert (run.final.min_validation_loss, run.final.min_validation_epoch) == (2.0, 3)
    assert run.final.last_validation_loss == 0.5


def test_equal_loss_is_not_an_improvement() -> None:
    sc = Scenario(
        train=(1.0,) * MAX_EPOCHS,
        valid=(2.0, 2.0, 1.0, 1.0) + (9.0,) * 8,
        has_validation=True,
        frequency=1,
        smoothing=1.0,
        eligible=ALL_EPOCHS,
        schedule=NoopSpec(),
        exact=True,
    )
    run = run_epochs(sc, max_epochs=4)
    assert [e[1] for e in run.events if e[0] == "save"] == [0, 2]
    assert run.final.min_validation_epoch == 2


# --------------------------------------------------------------------------- errors


async def _train(factor: float) -> float:
    return 1.0


async def _valid() -> float:
    return 1.0


async def _save() -> None:
    return None


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"max_epochs": -1}, "max_epochs"),
        ({"validation_frequency": 0}, "validation_frequency"),
        (
            {"validation_loss_exponential_smoothing_factor": 0.0},
            "validation_loss_exponential_smoothing_factor",
        ),
        (
            {"validation_loss_exponential_smoothing_factor": 1.5},
            "validation_loss_exponential_smoothing_factor",
        ),
        (
            {"validation_loss_exponential_smoothing_factor": float("nan")},
            "validation_loss_exponential_smoothing_factor",
        ),
        ({"init_state": LoopState(epoch=-1)}, "init_state"),
    ],
)
async def test_bad_arguments_are_refused_before_any_epoch(overrides: dict[str, Any], name: str) -> None:
    calls: list[float] = []

    async def train(factor: float) -> float:
        calls.append(factor)
        return 1.0

    kwargs: dict[str, Any] = {
        "max_epochs": 3,
        "train_epoch": train,
        "validation_epoch": _valid,
        "save_min_validation_loss_model": _save,
    }
    kwargs.update(overrides)
    with pytest.raises(ConfigurationError, match=name):
        await lamploop.epochs(**kwargs)
    assert calls == []


@pytest.mark.anyio
async def test_plateau_schedule_without_validation_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"(?i)validation[_ ]epoch") as info:
        await lamploop.epochs(
            max_epochs=3,
            train_epoch=_train,
            validation_epoch=None,
            save_min_validation_loss_model=_save,
            learning_rate_schedule=schedules.reduce_lr_on_plateau(),
        )
    assert "ReduceLrOnPlateau" in str(info.value) or "schedule" in str(info.value)


@pytest.mark.anyio
async def test_plateau_schedule_made_for_another_validation_frequency_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="validation_frequency"):
        await lamploop.epochs(
            max_epochs=3,
            train_epoch=_train,
            validation_epoch=_valid,
            save_min_validation_loss_model=_save,
            validation_frequency=2,
            learning_rate_schedule=schedules.reduce_lr_on_plateau(validation_frequency=3),
        )


@pytest.mark.anyio
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
async def test_non_finite_training_loss_names_the_epoch(bad: float) -> None:
    losses = iter([1.0, 0.5, bad, 0.25])
    validated: list[int] = []

    async def train(factor: float) -> float:
        return next(losses)

    async def valid() -> float:
        validated.append(1)
        return 1.0

    with pytest.raises(NonFiniteLossError, match=r"epoch 2\b") as info:
        await lamploop.epochs(
            max_epochs=4, train_epoch=train, validation_epoch=valid, save_min_validation_loss_model=_save
        )
    assert info.value.epoch == 2
    assert len(validated) == 2  # the bad epoch is not validated


@pytest.mark.anyio
async def test_nan_validation_loss_names_the_epoch() -> None:
    losses = iter([1.0, 0.5, float("nan")])
    checkpoints: list[int] = []

    async def valid() -> float:
        return next(losses)

    async def checkpoint(state: LoopState, schedule_state: Any) -> None:
        checkpoints.append(state.epoch)

    with pytest.raises(NonFiniteLossError, match=r"epoch 4\b") as info:
        await lamploop.epochs(
            max_epochs=6,
            train_epoch=_train,
            validation_epoch=valid,
            save_min_validation_loss_model=_save,
            checkpoint_state=checkpoint,
            validation_frequency=2,
        )
    assert info.value.epoch == 4
    assert checkpoints == [1, 2, 3, 4]  # epoch 4 never completes
