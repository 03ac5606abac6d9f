"""Which epoch's model is the best: the smallest smoothed validation loss, or a metric's min or max.

>>> choice = ModelSelection(metric="accuracy", mode="max")
>>> choice.improves(0.91, best=0.90), choice.improves(0.90, best=0.90)
(True, False)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, TypeAlias

import attrs

from lamploop.errors import ConfigurationError
from lamploop.state import LearningCurveEntry, LoopState

__all__ = [
    "ModelSelection",
    "SelectionMode",
    "check_selection_metric",
    "smoothed_metrics",
    "validations_since_best",
]

SelectionMode: TypeAlias = Literal["min", "max"]


def _mode(_: object, __: attrs.Attribute[str], value: str) -> None:
    if value not in ("min", "max"):
        msg = f"model_selection_mode must be 'min' or 'max', got {value!r}"
        raise ConfigurationError(msg)


def _metric(_: object, __: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        msg = f"model_selection_metric must be a metric's name or None (the validation loss), got {value!r}"
        raise ConfigurationError(msg)


@attrs.frozen
class ModelSelection:
    """Select by the smoothed validation loss (``metric=None``) or by a smoothed validation metric.

    The best value so far is what :attr:`LoopState.min_validation_loss` holds (for a metric
    selected by its maximum, that is the largest smoothed value: the field keeps the
    contract's name).  Ties keep the earlier epoch.
    """

    metric: str | None = attrs.field(default=None, validator=_metric)
    mode: SelectionMode = attrs.field(default="min", validator=_mode)

    def value(
        self, loss: tuple[float, float], metrics: Mapping[str, tuple[float, float]], epoch: int
    ) -> float:
        """The smoothed value this epoch is judged by."""
        if self.metric is None:
            return loss[0]
        if self.metric not in metrics:
            msg = (
                f"epochs: model_selection_metric {self.metric!r} is not among epoch {epoch}'s "
                f"validation metrics {sorted(metrics)} (give the model that metric: "
                "SupervisedModel(..., metrics={...}))"
            )
            raise ConfigurationError(msg)
        return metrics[self.metric][0]

    def improves(self, value: float, best: float | None) -> bool:
        """Whether ``value`` is strictly better than ``best``."""
        if best is None:
            return True
        return value < best if self.mode == "min" else value > best


def check_selection_metric(where: str, metric: str | None, model: object) -> None:
    """Before training: a ConfigurationError if ``metric`` is not among ``model``'s metrics.

    ``model.metrics`` (a :class:`~lamploop.model.SupervisedModel`'s) names what every
    validation reports; a model without that mapping is judged at the first validation.
    """
    names = getattr(model, "metrics", None)
    if metric is None or not isinstance(names, Mapping) or metric in names:
        return
    msg = (
        f"{where}: model_selection_metric {metric!r} is not among the model's metrics {sorted(names)} "
        "(give the model that metric: SupervisedModel(..., metrics={...}))"
    )
    raise ConfigurationError(msg)


def validations_since_best(
    state: LoopState, selection: ModelSelection | None = None
) -> tuple[int, int | None]:
    """How many validations came after the best one so far, and the best one's epoch.

    Every validation counts, whether or not its epoch may become the best model
    (``return_min_validation_loss_model`` says which models are kept, not which validations
    improve); judged as ``selection`` says (default: the smoothed validation loss).  ``(0,
    None)`` before the first validation.  A pure function of the state, so early stopping
    needs nothing more in checkpoints.
    """
    selection = selection if selection is not None else ModelSelection()
    best: float | None = None
    best_epoch: int | None = None
    since = 0
    for entry in state.learning_curve:
        if entry.validation_loss is None:
            continue
        value = selection.value(entry.validation_loss, entry.validation_metrics, entry.epoch)
        if selection.improves(value, best):
            best, best_epoch, since = value, entry.epoch, 0
        else:
            since += 1
    return since, best_epoch


def smoothed_metrics(
    raw: Mapping[str, float], curve: Sequence[LearningCurveEntry], factor: float
) -> dict[str, tuple[float, float]]:
    """Each metric's ``(smoothed, raw)``: smoothed like the loss, from its latest smoothed value."""
    previous: dict[str, float] = {}
    for entry in reversed(curve):
        for name, (smoothed, _) in entry.validation_metrics.items():
            previous.setdefault(name, smoothed)
        if len(previous) >= len(raw):
            break
    return {
        name: (value * factor + previous.get(name, value) * (1.0 - factor), value)
        for name, value in raw.items()
    }
