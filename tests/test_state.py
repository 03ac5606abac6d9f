"""The loop's plain data: JSON round trips through ``lamploop.state.converter`` and immutability."""

from __future__ import annotations

import json
import math

import attrs
import cattrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lamploop
from lamploop import LearningCurveEntry, LoopState, LoopStateWithModelAndOptimizerData

# JSON numbers: every finite double survives json.dumps/json.loads exactly (repr is shortest
# round-trip); infinities are written as Infinity, which Python's json reads back.
losses = st.floats(allow_nan=False)
epochs = st.integers(0, 10**6)

entries = st.builds(
    LearningCurveEntry,
    epoch=epochs,
    training_loss=losses,
    validation_loss=st.one_of(st.none(), st.tuples(losses, losses)),
)

loop_states = st.builds(
    LoopState,
    epoch=epochs,
    last_validation_loss=st.one_of(st.none(), losses),
    min_validation_loss=st.one_of(st.none(), losses),
    min_validation_epoch=st.one_of(st.none(), epochs),
    learning_curve=st.lists(entries, max_size=8).map(tuple),
)


def through_json(value: object, cls: type) -> object:
    text = json.dumps(lamploop.state.converter.unstructure(value))
    return lamploop.state.converter.structure(json.loads(text), cls)


@settings(deadline=None, max_examples=200)
@given(entries)
def test_learning_curve_entry_round_trips(entry: LearningCurveEntry) -> None:
    back = through_json(entry, LearningCurveEntry)
    assert back == entry
    assert type(back) is LearningCurveEntry
    if entry.validation_loss is not None:
        assert isinstance(back.validation_loss, tuple)  # JSON gives a list; the class holds a pair


@settings(deadline=None, max_examples=200)
@given(loop_states)
def test_loop_state_round_trips(state: LoopState) -> None:
    back = through_json(state, LoopState)
    assert back == state
    assert isinstance(back.learning_curve, tuple)
    assert all(type(e) is LearningCurveEntry for e in back.learning_curve)
    assert hash(back) == hash(state)  # frozen and made of hashable parts


def test_unstructured_state_is_plain_json_data() -> None:
    state = LoopState(
        epoch=2,
        last_validation_loss=0.25,
        min_validation_loss=0.5,
        min_validation_epoch=0,
        learning_curve=(LearningCurveEntry(0, 1.5, (0.5, 0.75)), LearningCurveEntry(1, 1.25, None)),
    )
    data = json.loads(json.dumps(lamploop.state.converter.unstructure(state)))
    assert data == {
        "epoch": 2,
        "last_validation_loss": 0.25,
        "min_validation_loss": 0.5,
        "min_validation_epoch": 0,
        "learning_curve": [
            {"epoch": 0, "training_loss": 1.5, "validation_loss": [0.5, 0.75]},
            {"epoch": 1, "training_loss": 1.25, "validation_loss": None},
        ],
    }


def test_infinite_values_round_trip() -> None:
    state = LoopState(epoch=1, last_validation_loss=math.inf, min_validation_loss=-math.inf)
    assert through_json(state, LoopState) == state


def test_unknown_keys_are_refused() -> None:
    data = lamploop.state.converter.unstructure(LoopState(epoch=3))
    data["epochs"] = 4  # a typo in a hand-edited checkpoint must not be silently ignored
    with pytest.raises(cattrs.errors.ClassValidationError):
        lamploop.state.converter.structure(data, LoopState)


def test_learning_curve_is_a_tuple_even_from_a_list() -> None:
    state = LoopState(learning_curve=[LearningCurveEntry(0, 1.0)])
    assert state.learning_curve == (LearningCurveEntry(0, 1.0),)
    assert LearningCurveEntry(0, 1.0, [1, 2]).validation_loss == (1.0, 2.0)


def test_defaults_describe_a_fresh_run() -> None:
    state = LoopState()
    assert (
        state.epoch,
        state.last_validation_loss,
        state.min_validation_loss,
        state.min_validation_epoch,
    ) == (
        0,
        None,
        None,
        None,
    )
    assert state.learning_curve == ()


@pytest.mark.parametrize(
    ("value", "field"),
    [
        (LoopState(), "epoch"),
        (LoopState(), "learning_curve"),
        (LoopState(), "min_validation_loss"),
        (LearningCurveEntry(0, 1.0), "training_loss"),
        (LearningCurveEntry(0, 1.0), "validation_loss"),
        (LoopStateWithModelAndOptimizerData(LoopState(), {}, {}), "loop_state"),
        (LoopStateWithModelAndOptimizerData(LoopState(), {}, {}), "best_model"),
    ],
)
def test_frozen(value: object, field: str) -> None:
    before = getattr(value, field)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(value, field, 7)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        delattr(value, field)
    assert getattr(value, field) == before


def test_evolve_makes_a_new_value_and_leaves_the_old_one() -> None:
    old = LoopState(epoch=1, learning_curve=(LearningCurveEntry(0, 2.0),))
    new = attrs.evolve(old, epoch=2, learning_curve=(*old.learning_curve, LearningCurveEntry(1, 1.0)))
    assert old.epoch == 1
    assert len(old.learning_curve) == 1
    assert new.epoch == 2
    assert len(new.learning_curve) == 2


def test_best_model_defaults_to_a_fresh_empty_mapping() -> None:
    a = LoopStateWithModelAndOptimizerData(LoopState(), {"w": torch.zeros(1)}, {})
    b = LoopStateWithModelAndOptimizerData(LoopState(), {"w": torch.zeros(1)}, {})
    assert a.best_model == {}
    assert a.best_model is not b.best_model
