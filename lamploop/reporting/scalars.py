"""The scalar names and values that the TensorBoard, MLflow and W&B reporters log.

The three reporters log the same names (their docstrings list them); each decides the x axis
and how the values leave.  Kept here once so that a new metric reaches all three alike.
"""

from __future__ import annotations

from lamploop.reporting.events import EpochFinished, ProgressSampled

__all__ = ["epoch_scalars", "progress_scalars"]


def progress_scalars(event: ProgressSampled) -> dict[str, float]:
    """``train/loss_sampled`` (when sampled), ``perf/examples_per_second`` and, when the sample
    holds steps, ``perf/step_seconds`` and ``perf/communication_seconds``."""
    values: dict[str, float] = {}
    if event.loss is not None:
        values["train/loss_sampled"] = event.loss
    values["perf/examples_per_second"] = event.examples_per_second
    if event.steps > 0:
        values["perf/step_seconds"] = event.seconds_per_step
        values["perf/communication_seconds"] = event.communication_seconds_per_step
    return values


def epoch_scalars(event: EpochFinished) -> dict[str, float]:
    """The finished epoch's ``train/loss``, ``validation/loss`` (raw) and
    ``validation/loss_smoothed`` (when it validated), ``train/<metric>``,
    ``validation/<metric>`` and ``validation/<metric>_smoothed``,
    ``schedule/learning_rate_factor`` (when recorded) and ``perf/epoch_seconds``."""
    entry = event.state.learning_curve[-1]
    values = {"train/loss": entry.training_loss}
    if entry.validation_loss is not None:
        smoothed, raw = entry.validation_loss
        values["validation/loss"] = raw
        values["validation/loss_smoothed"] = smoothed
    for name, value in entry.training_metrics.items():
        values[f"train/{name}"] = value
    for name, (smoothed, raw) in entry.validation_metrics.items():
        values[f"validation/{name}"] = raw
        values[f"validation/{name}_smoothed"] = smoothed
    if entry.learning_rate_factor is not None:
        values["schedule/learning_rate_factor"] = entry.learning_rate_factor
    values["perf/epoch_seconds"] = event.seconds
    return values
