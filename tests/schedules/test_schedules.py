"""Learning-rate schedules: formulas, validation, early stopping, plateau counting, JSON state.

Expected factors come from independent formulations of each docstring
(``numpy.interp`` for the piecewise-linear ones, repeated multiplication for
``decrement``, ``torch.optim.lr_scheduler.ReduceLROnPlateau`` for the plateau rule).
"""

from __future__ import annotations

import json
import math
from fractions import Fraction
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lamploop
from lamploop import schedules
from lamploop.errors import ConfigurationError

EPOCHS = range(60)


def factors(schedule: schedules.LearningRateSchedule[Any], epochs: range = EPOCHS) -> list[float]:
    """Ask a (stateless) schedule for each epoch in turn, threading its state."""
    state = schedule.init()
    out = []
    for epoch in epochs:
        state, factor = schedule.learning_rate_factor(state, epoch, None)
        out.append(factor)
    return out


# --------------------------------------------------------------------------- formulas


def test_noop_is_one_everywhere() -> None:
    assert factors(schedules.noop()) == [1.0] * len(EPOCHS)
    assert schedules.noop().needs_validation_loss is False


@pytest.mark.parametrize(("every", "fraction"), [(1, 0.5), (3, 0.9), (7, 0.25), (2, 1.0), (4, 0.0)])
def test_decrement(every: int, fraction: float) -> None:
    expected = []
    value = 1.0
    for epoch in EPOCHS:
        if epoch > 0 and epoch % every == 0:
            value *= fraction
        expected.append(value)
    assert factors(schedules.decrement(every=every, fraction=fraction)) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("start", "end", "max_steps"), [(1.0, 0.0, 4), (0.1, 1.0, 10), (2.0, 0.5, 1), (1.0, -1.0, 7)]
)
def test_linear(start: float, end: float, max_steps: int) -> None:
    expected = np.interp(list(EPOCHS), [0, max_steps], [start, end])  # clamps to `end` after max_steps
    assert factors(schedules.linear(start=start, end=end, max_steps=max_steps)) == pytest.approx(
        expected.tolist(), rel=1e-12, abs=1e-15
    )


@given(
    start=st.floats(1e-6, 1e3, allow_nan=False),
    end=st.floats(-1e3, 1e3, allow_nan=False),
    max_steps=st.integers(1, 50),
)
def test_linear_is_exactly_start_and_end_at_its_ends(start: float, end: float, max_steps: int) -> None:
    # A hypothesis run of test_loop found linear(0.99999, 0, 9) giving 1.1e-16 at epoch 9,
    # so training went on past the epoch where the docs say it stops.
    schedule = schedules.linear(start=start, end=end, max_steps=max_steps)
    state = schedule.init()
    assert schedule.learning_rate_factor(state, 0, None)[1] == start
    assert schedule.learning_rate_factor(state, max_steps, None)[1] == end
    assert schedule.learning_rate_factor(state, max_steps + 3, None)[1] == end


def test_linear_docstring_example() -> None:
    assert factors(schedules.linear(start=1.0, end=0.0, max_steps=4), range(6)) == pytest.approx(
        [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    )


@pytest.mark.parametrize(("steps", "factor"), [(0, 0.1), (5, 0.5), (30, 2.0)])
def test_step_after(steps: int, factor: float) -> None:
    assert factors(schedules.step_after(steps=steps, factor=factor)) == [
        1.0 if epoch < steps else factor for epoch in EPOCHS
    ]


@pytest.mark.parametrize(("max_factor", "period"), [(4.0, 2), (3.0, 4), (0.5, 5), (10.0, 8), (2.0, 7)])
def test_cyclic_is_a_triangle_wave(max_factor: float, period: int) -> None:
    half = period / 2
    expected = [
        float(np.interp(epoch % period, [0, half, period], [1.0, max_factor, 1.0])) for epoch in EPOCHS
    ]
    got = factors(schedules.cyclic(max_factor=max_factor, period_length=period))
    assert got == pytest.approx(expected, rel=1e-12)
    assert got[0] == 1.0
    assert got[period] == 1.0
    if period % 2 == 0:
        assert got[period // 2] == pytest.approx(max_factor)


def test_from_epoch_count() -> None:
    schedule = schedules.from_epoch_count(lambda e: 1 / (1 + e))
    assert factors(schedule) == [1 / (1 + e) for e in EPOCHS]
    assert all(isinstance(f, float) for f in factors(schedules.from_epoch_count(lambda e: e)))


@pytest.mark.parametrize(
    "schedule",
    [
        schedules.noop(),
        schedules.decrement(every=2, fraction=0.5),
        schedules.linear(1.0, 0.0, 5),
        schedules.step_after(3, 0.1),
        schedules.cyclic(3.0, 4),
        schedules.from_epoch_count(lambda e: e + 1.0),
    ],
)
def test_stateless_schedules_ignore_validation_loss_and_order(
    schedule: schedules.LearningRateSchedule[Any],
) -> None:
    assert schedule.needs_validation_loss is False
    state = schedule.init()
    forward = [schedule.learning_rate_factor(state, e, None)[1] for e in range(20)]
    backward = [schedule.learning_rate_factor(state, e, 123.0)[1] for e in reversed(range(20))]
    assert forward == backward[::-1]


# --------------------------------------------------------------------------- argument validation


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: schedules.decrement(every=0, fraction=0.5), "every"),
        (lambda: schedules.decrement(every=2, fraction=1.5), "fraction"),
        (lambda: schedules.decrement(every=2, fraction=-0.1), "fraction"),
        (lambda: schedules.linear(start=1.0, end=0.0, max_steps=0), "max_steps"),
        (lambda: schedules.step_after(steps=-1, factor=0.5), "steps"),
        (lambda: schedules.cyclic(max_factor=2.0, period_length=1), "period_length"),
        (lambda: schedules.cyclic(max_factor=0.0, period_length=4), "max_factor"),
        (lambda: schedules.from_epoch_count(3), "f"),  # type: ignore[arg-type]
        (lambda: schedules.reduce_lr_on_plateau(start_factor=0.0), "start_factor"),
        (lambda: schedules.reduce_lr_on_plateau(reduce_factor=1.0), "reduce_factor"),
        (lambda: schedules.reduce_lr_on_plateau(reduce_factor=0.0), "reduce_factor"),
        (lambda: schedules.reduce_lr_on_plateau(patience=-1), "patience"),
        (lambda: schedules.reduce_lr_on_plateau(threshold=-0.1), "threshold"),
        (lambda: schedules.reduce_lr_on_plateau(min_factor=-1.0), "min_factor"),
        (lambda: schedules.reduce_lr_on_plateau(validation_frequency=0), "validation_frequency"),
    ],
)
def test_bad_arguments(make: Any, name: str) -> None:
    with pytest.raises(ConfigurationError, match=rf"\b{name}\b"):
        make()


# --------------------------------------------------------------------------- early stopping


def run_with(schedule: schedules.LearningRateSchedule[Any], max_epochs: int = 50) -> tuple[int, list[float]]:
    seen: list[float] = []

    async def train(factor: float) -> float:
        seen.append(factor)
        return 1.0

    async def valid() -> float:
        return 1.0

    async def save() -> None:
        return None

    async def main() -> lamploop.LoopState:
        return await lamploop.epochs(
            max_epochs=max_epochs,
            train_epoch=train,
            validation_epoch=valid,
            save_min_validation_loss_model=save,
            learning_rate_schedule=schedule,
        )

    state = anyio.run(main, backend="asyncio")
    return state.epoch, seen


def _linear_stop(start: Fraction, end: Fraction, max_steps: int) -> int:
    # first e with start + (end - start) * e / max_steps <= 0, i.e. e >= start * max_steps / (start - end)
    return min(max_steps, math.ceil(start * max_steps / (start - end)))


@pytest.mark.parametrize(
    ("schedule", "stop"),
    [
        (schedules.decrement(every=3, fraction=0.0), 3),
        (schedules.linear(start=1.0, end=0.0, max_steps=4), 4),
        (schedules.linear(start=1.0, end=-1.0, max_steps=8), _linear_stop(Fraction(1), Fraction(-1), 8)),
        (schedules.linear(start=3.0, end=-1.0, max_steps=10), _linear_stop(Fraction(3), Fraction(-1), 10)),
        (schedules.step_after(steps=6, factor=0.0), 6),
        (schedules.step_after(steps=2, factor=-1.0), 2),
        (schedules.from_epoch_count(lambda e: 1.0 if e < 9 else -0.5), 9),
        (schedules.from_epoch_count(lambda e: 0.0), 0),
    ],
)
def test_non_positive_factor_stops_training(schedule: schedules.LearningRateSchedule[Any], stop: int) -> None:
    epochs_run, seen = run_with(schedule)
    assert epochs_run == stop
    assert len(seen) == stop
    assert all(f > 0 for f in seen)


def test_schedule_that_never_stops_runs_max_epochs() -> None:
    epochs_run, seen = run_with(schedules.cyclic(max_factor=3.0, period_length=4), max_epochs=9)
    assert epochs_run == 9
    assert seen == pytest.approx([1.0, 2.0, 3.0, 2.0, 1.0, 2.0, 3.0, 2.0, 1.0])


# --------------------------------------------------------------------------- plateau


def plateau_factors_through_epochs(
    schedule: schedules.ReduceLrOnPlateau, losses: list[float], frequency: int = 1
) -> list[float]:
    """The factors `epochs` passes to train_epoch when validation returns `losses` in turn."""
    seen: list[float] = []
    it = iter(losses)

    async def train(factor: float) -> float:
        seen.append(factor)
        return 1.0

    async def valid() -> float:
        return next(it, 0.0)  # epochs after the last scripted validation

    async def save() -> None:
        return None

    async def main() -> lamploop.LoopState:
        return await lamploop.epochs(
            max_epochs=(len(losses) - 1) * frequency + 2,
            train_epoch=train,
            validation_epoch=valid,
            save_min_validation_loss_model=save,
            validation_frequency=frequency,
            learning_rate_schedule=schedule,
        )

    anyio.run(main, backend="asyncio")
    return seen


def torch_plateau_factors(
    losses: list[float], *, start: float, reduce: float, patience: int, threshold: float, min_factor: float
) -> list[float]:
    """PyTorch's ReduceLROnPlateau as the reference: the lr of epoch e after stepping on losses[:e]."""
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=start)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer,
        mode="min",
        factor=reduce,
        patience=patience,
        threshold=threshold,
        threshold_mode="rel",
        min_lr=min_factor,
        eps=0.0,
    )
    out = [optimizer.param_groups[0]["lr"]]
    for loss in losses:
        optimizer.step()
        scheduler.step(loss)
        out.append(optimizer.param_groups[0]["lr"])
    return out


@settings(deadline=None, max_examples=60)
@given(
    losses=st.lists(st.integers(1, 40).map(lambda i: i / 8), min_size=1, max_size=14),
    reduce=st.sampled_from([0.5, 0.25]),
    patience=st.integers(0, 3),
    threshold=st.sampled_from([0.0, 0.25, 0.0625]),
    min_factor=st.sampled_from([0.0, 0.125]),
)
def test_plateau_matches_torch(
    losses: list[float], reduce: float, patience: int, threshold: float, min_factor: float
) -> None:
    schedule = schedules.reduce_lr_on_plateau(
        start_factor=1.0, reduce_factor=reduce, patience=patience, threshold=threshold, min_factor=min_factor
    )
    expected = torch_plateau_factors(
        losses, start=1.0, reduce=reduce, patience=patience, threshold=threshold, min_factor=min_factor
    )
    assert plateau_factors_through_epochs(schedule, losses) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("frequency", [1, 2])
def test_plateau_reduces_on_a_perfectly_flat_validation_loss(frequency: int) -> None:
    """A constant validation loss is the plainest plateau: each validation after the
    first is one without improvement, so after `patience + 1` of them the factor drops.

    (An earlier version took a loss equal to the last one seen for a carried-over
    value and never counted an exactly flat loss.)
    """
    losses = [1.0] * 6
    schedule = schedules.reduce_lr_on_plateau(
        start_factor=1.0, reduce_factor=0.5, patience=1, threshold=0.0, validation_frequency=frequency
    )
    expected = torch_plateau_factors(losses, start=1.0, reduce=0.5, patience=1, threshold=0.0, min_factor=0.0)
    assert expected == [1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25]  # worked out by hand from the docstring
    seen = plateau_factors_through_epochs(schedule, losses, frequency=frequency)
    # the factor of the epoch after each validation
    after_validation = [seen[0]] + [seen[i * frequency + 1] for i in range(len(losses))]
    assert after_validation == expected


def test_plateau_patience_counts_validations_not_epochs() -> None:
    # validations at epochs 0, 3, 6, 9 with losses 4, 5, 6, 7 and patience 1:
    # 4 is the best; 5 is bad #1; 6 is bad #2 > patience -> factor halves from epoch 7.
    seen = plateau_factors_through_epochs(
        schedules.reduce_lr_on_plateau(reduce_factor=0.5, patience=1, threshold=0.0, validation_frequency=3),
        [4.0, 5.0, 6.0, 7.0],
        3,
    )
    assert seen == [1.0] * 7 + [0.5] * 4


def test_plateau_ignores_asks_after_epochs_without_validation() -> None:
    # validation_frequency 3: validation runs in epochs 0, 3, 6, ...; only the asks for
    # epochs 1, 4, 7, ... see a new loss, whatever value the others are handed.
    s = schedules.reduce_lr_on_plateau(reduce_factor=0.5, patience=0, threshold=0.0, validation_frequency=3)
    state = s.init()
    state, f = s.learning_rate_factor(state, 1, 2.0)
    assert (f, state.best, state.bad_validations) == (1.0, 2.0, 0)
    for epoch in (2, 3):
        state, f = s.learning_rate_factor(state, epoch, 5.0)  # not a validation: no change
        assert (f, state.best, state.bad_validations) == (1.0, 2.0, 0)
    state, f = s.learning_rate_factor(state, 4, 2.0)  # a flat validation counts
    assert (f, state.best) == (0.5, 2.0)


def test_plateau_rule_directly() -> None:
    s = schedules.reduce_lr_on_plateau(
        start_factor=1.0, reduce_factor=0.5, patience=0, threshold=0.1, min_factor=0.3
    )
    state = s.init()
    assert state.factor == 1.0
    state, f = s.learning_rate_factor(state, 0, None)  # nothing observed yet
    assert (f, state) == (1.0, s.init())
    state, f = s.learning_rate_factor(state, 1, 1.0)  # first value: the best
    assert (f, state.best, state.bad_validations) == (1.0, 1.0, 0)
    state, f = s.learning_rate_factor(state, 2, 0.95)  # not below 1.0 - 0.1 * 1.0: bad, patience 0 -> reduce
    assert (f, state.best) == (0.5, 1.0)
    state, f = s.learning_rate_factor(state, 3, 0.85)  # below 0.9: improvement
    assert (f, state.best, state.bad_validations) == (0.5, 0.85, 0)
    state, f = s.learning_rate_factor(state, 4, 2.0)
    assert f == pytest.approx(0.3)  # max(0.25, min_factor)
    state, f = s.learning_rate_factor(state, 5, 3.0)
    assert f == pytest.approx(0.3)
    assert s.needs_validation_loss is True


# --------------------------------------------------------------------------- JSON state


def json_round_trip(state: Any, state_type: Any) -> Any:
    text = json.dumps(lamploop.state.converter.unstructure(state))
    return lamploop.state.converter.structure(json.loads(text), state_type)


@pytest.mark.parametrize(
    "schedule",
    [
        schedules.noop(),
        schedules.decrement(every=2, fraction=0.5),
        schedules.linear(1.0, 0.0, 5),
        schedules.step_after(3, 0.1),
        schedules.cyclic(3.0, 4),
        schedules.from_epoch_count(lambda e: 1.0),
    ],
    ids=["noop", "decrement", "linear", "step_after", "cyclic", "from_epoch_count"],
)
def test_stateless_schedule_state_round_trips_through_json(
    schedule: schedules.LearningRateSchedule[Any],
) -> None:
    state = schedule.init()
    for epoch in range(5):
        state, _ = schedule.learning_rate_factor(state, epoch, 1.0)
    assert json_round_trip(state, schedule.state_type) == state


@settings(deadline=None, max_examples=40)
@given(losses=st.lists(st.one_of(st.none(), st.floats(0.0, 1e6)), max_size=12))
def test_plateau_state_round_trips_through_json(losses: list[float | None]) -> None:
    schedule = schedules.reduce_lr_on_plateau(reduce_factor=0.5, patience=1)
    state = schedule.init()
    states = [state]
    for epoch, loss in enumerate(losses):
        state, _ = schedule.learning_rate_factor(state, epoch, loss)
        states.append(state)
    for s in states:
        back = json_round_trip(s, schedule.state_type)
        assert back == s
        assert type(back) is schedules.PlateauState
        # and the restored state drives the schedule identically
        assert schedule.learning_rate_factor(back, 99, 0.5) == schedule.learning_rate_factor(s, 99, 0.5)


BUILDERS = {
    "decrement": (schedules.decrement, {"every": 1, "fraction": 0.5}),
    "linear": (schedules.linear, {"start": 1.0, "end": 0.0, "max_steps": 3}),
    "step_after": (schedules.step_after, {"steps": 2, "factor": 0.1}),
    "cyclic": (schedules.cyclic, {"max_factor": 2.0, "period_length": 4}),
    "reduce_lr_on_plateau": (schedules.reduce_lr_on_plateau, {"patience": 1}),
}


@pytest.mark.parametrize(
    ("builder", "argument"),
    [
        (name, argument)
        for name, (_, good) in BUILDERS.items()
        for argument in (
            good
            if name != "reduce_lr_on_plateau"
            else (
                "start_factor",
                "reduce_factor",
                "patience",
                "threshold",
                "min_factor",
                "validation_frequency",
            )
        )
    ],
)
@pytest.mark.parametrize("bad", ["x", None, math.nan, True], ids=["str", "None", "nan", "bool"])
def test_a_schedule_argument_that_is_not_a_number_is_named_in_a_configuration_error(
    builder: str, argument: str, bad: object
) -> None:
    """Not a raw TypeError from a comparison deep inside (or, for linear's start, no check at all)."""
    make, good = BUILDERS[builder]
    with pytest.raises(ConfigurationError, match=rf"{builder}: {argument}"):
        make(**{**good, argument: bad})


def test_an_epoch_function_that_returns_no_number_is_named() -> None:
    def forgot_to_return(epoch: int) -> float:
        epoch * 0.5  # the mistake under test: no return

    schedule = schedules.from_epoch_count(forgot_to_return)
    returned = r"forgot_to_return\(3\) returned None for epoch 3, not a number"
    with pytest.raises(ConfigurationError, match=returned):
        schedule.learning_rate_factor(schedule.init(), 3, None)


def test_an_epoch_function_that_raises_is_named_with_its_epoch_and_the_stops_call() -> None:
    """A table of one factor per epoch misses the call at the stop (epoch ``max_epochs``,
    DESIGN.md: "also once more at the stop"): a raw IndexError from the user's lambda before."""
    factors = [1.0, 0.5]

    async def train(_factor: float) -> float:
        return 1.0

    async def save() -> None:
        return None

    async def main() -> lamploop.LoopState:
        return await lamploop.epochs(
            max_epochs=2,
            train_epoch=train,
            validation_epoch=None,
            save_min_validation_loss_model=save,
            learning_rate_schedule=schedules.from_epoch_count(lambda epoch: factors[epoch]),
        )

    with pytest.raises(ConfigurationError, match=r"<lambda>\(2\) raised IndexError: list index") as info:
        anyio.run(main)
    assert "max_epochs + 1 entries" in str(info.value)
    assert isinstance(info.value.__cause__, IndexError)


@pytest.mark.parametrize("make", [schedules.warmup_cosine, schedules.warmup_linear])
def test_a_schedule_that_is_all_warm_up_is_at_final_from_total_steps_on(make: Any) -> None:
    schedule = make(warmup_steps=3, total_steps=3, steps_per_epoch=3, final=0.25)
    assert [schedule.factor(e, s) for e in range(2) for s in range(3)] == [
        1 / 3,
        2 / 3,
        1.0,
        0.25,
        0.25,
        0.25,
    ]


def test_an_epoch_schedule_given_as_the_step_schedule_is_refused_before_training() -> None:
    from lamploop.schedules.step import check_step_schedule

    with pytest.raises(
        ConfigurationError, match=r"Linear is an epoch schedule .*pass it as learning_rate_schedule"
    ):
        check_step_schedule("step_schedule", schedules.linear(1.0, 0.5, 2))
    check_step_schedule(
        "step_schedule", schedules.warmup_cosine(warmup_steps=1, total_steps=4, steps_per_epoch=2)
    )
