"""The plain data a training loop threads from epoch to epoch.

All three classes are frozen attrs classes: a new epoch makes a new value
instead of changing the old one.  :data:`converter` turns the tensor-free parts
into JSON-ready dicts and back (checkpoints store tensors in safetensors files
beside that JSON).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import cattrs
import cattrs.gen
import torch

from lamploop.checks import check_int
from lamploop.errors import ConfigurationError

__all__ = [
    "LearningCurveEntry",
    "LoopState",
    "LoopStateWithModelAndOptimizerData",
    "converter",
]


def _optional_pair(value: Any) -> tuple[float, float] | None:
    if value is None:
        return None
    smoothed, raw = value
    return (float(smoothed), float(raw))


def _floats(value: Any) -> dict[str, float]:
    return {str(name): float(v) for name, v in dict(value).items()}


def _pairs(value: Any) -> dict[str, tuple[float, float]]:
    return {str(name): (float(smoothed), float(raw)) for name, (smoothed, raw) in dict(value).items()}


def _curve(entries: Iterable[LearningCurveEntry]) -> tuple[LearningCurveEntry, ...]:
    return tuple(entries)


@attrs.frozen
class LearningCurveEntry:
    """What one epoch measured.

    Attributes:
        epoch: the 0-based epoch.
        training_loss: mean training loss over every example of every rank.
        validation_loss: ``(smoothed, raw)`` validation loss, or ``None`` when
            validation did not run in this epoch.
        training_metrics: each metric's mean over the epoch's training examples (see
            :mod:`lamploop.metrics`); empty without metrics.
        validation_metrics: each metric's ``(smoothed, raw)`` validation value, smoothed
            like the loss; empty when validation did not run or without metrics.
        learning_rate_factor: the learning-rate schedule's factor the epoch trained with
            (``None`` in entries written before lamploop 0.3); informational, so left out
            of ``==``.
    """

    epoch: int
    training_loss: float
    validation_loss: tuple[float, float] | None = attrs.field(default=None, converter=_optional_pair)
    training_metrics: Mapping[str, float] = attrs.field(factory=dict, converter=_floats, hash=False)
    validation_metrics: Mapping[str, tuple[float, float]] = attrs.field(
        factory=dict, converter=_pairs, hash=False
    )
    # Not compared: two curves that measured the same losses are equal whatever they record beside.
    learning_rate_factor: float | None = attrs.field(
        default=None, converter=attrs.converters.optional(float), eq=False
    )


@attrs.frozen
class LoopState:
    """Where the epoch loop stands; enough to resume it.

    Attributes:
        epoch: the next epoch to run (0 for a fresh run).
        last_validation_loss: the latest smoothed validation loss, carried over
            epochs in which validation does not run.
        min_validation_loss: the smallest smoothed validation loss seen in an
            epoch eligible for model selection.
        min_validation_epoch: the epoch of ``min_validation_loss``.
        learning_curve: one entry per finished epoch, oldest first.
    """

    epoch: int = 0
    last_validation_loss: float | None = None
    min_validation_loss: float | None = None
    min_validation_epoch: int | None = None
    learning_curve: tuple[LearningCurveEntry, ...] = attrs.field(default=(), converter=_curve)


@attrs.frozen
class LoopStateWithModelAndOptimizerData:
    """A :class:`LoopState` with the tensors needed to resume training.

    Attributes:
        loop_state: the epoch loop's state.
        model: the live model's ``state_dict()``.
        optimizer: ``optimizer.state_dict()`` (tensors and plain values).
        best_model: the ``state_dict()`` at the minimum smoothed validation
            loss; empty when no eligible epoch has validated yet.
        averaged_model: the weight average's ``state_dict()`` (see
            :mod:`lamploop.averaging`); empty without averaging.
        averaged_count: how many updates the average has had.
    """

    loop_state: LoopState
    model: Mapping[str, torch.Tensor]
    optimizer: Mapping[str, Any]
    best_model: Mapping[str, torch.Tensor] = attrs.field(factory=dict)
    averaged_model: Mapping[str, torch.Tensor] = attrs.field(factory=dict)
    averaged_count: int = 0


def check_loop_state(where: str, state: object) -> None:
    """Refuse a :class:`LoopState` whose fields are not of their documented types, naming the field.

    The class takes what it is given (DESIGN.md's constructors stay as they are); a run calls
    this before it starts, so that a bad ``init_state`` is named there and not deep inside.
    ``where`` names the argument, e.g. ``"epochs: init_state"``.
    """
    if not isinstance(state, LoopState):
        msg = f"{where} must be a lamploop.LoopState, got {type(state).__name__}"
        raise ConfigurationError(msg)

    def refuse(field: str, wanted: str, value: object) -> None:
        msg = f"{where}.{field} must be {wanted}, got {value!r}"
        raise ConfigurationError(msg)

    check_int(f"{where}.epoch", state.epoch, 0)
    for field in ("last_validation_loss", "min_validation_loss"):
        value = getattr(state, field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            refuse(field, "a float or None", value)
    if state.min_validation_epoch is not None:
        check_int(f"{where}.min_validation_epoch", state.min_validation_epoch, 0)
    for i, entry in enumerate(state.learning_curve):
        if not isinstance(entry, LearningCurveEntry):
            refuse(f"learning_curve[{i}]", "a lamploop.LearningCurveEntry", entry)


def _structure_none(value: object, _: object) -> None:
    if value is not None:
        msg = f"expected null, got {value!r}"
        raise ValueError(msg)


converter = cattrs.Converter(forbid_extra_keys=True)
"""A cattrs converter for lamploop's plain data (JSON-ready dicts, no tensors).

``converter.unstructure(loop_state)`` gives a dict for ``json.dumps``;
``converter.structure(d, LoopState)`` reads it back.
"""

# The state of a stateless schedule is None, and its state_type is NoneType.
converter.register_structure_hook(type(None), _structure_none)

# A run without metrics writes the learning curve as before: empty metric maps are left out.
converter.register_unstructure_hook(
    LearningCurveEntry,
    cattrs.gen.make_dict_unstructure_fn(
        LearningCurveEntry,
        converter,
        training_metrics=cattrs.gen.override(omit_if_default=True),
        validation_metrics=cattrs.gen.override(omit_if_default=True),
        learning_rate_factor=cattrs.gen.override(omit_if_default=True),
    ),
)
