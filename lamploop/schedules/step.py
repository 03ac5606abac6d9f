"""Per-step learning-rate factors: warm-up, cosine and linear decay, as pure functions of the step.

The epoch schedules (:mod:`lamploop.schedules`) give one factor per epoch; a step schedule
gives one per optimizer step, and the learning rate of a step is
``base_lr * epoch_factor * step_factor``.  A step schedule is a pure function of
``(epoch, step)``, ``step`` being the step's index within its epoch, so a resumed run (also
one resumed mid-epoch) asks exactly what the uninterrupted run asked, and nothing needs to
be checkpointed.  Schedules count a global step ``epoch * steps_per_epoch + step``;
``steps_per_epoch`` is the number of optimizer steps of a full epoch (with several ranks,
of the rank with the most batches, divided by the accumulation and rounded up: 5 batches
with 2 per step are 3 steps).

>>> schedule = warmup_linear(warmup_steps=2, total_steps=6, steps_per_epoch=3)
>>> [round(schedule.factor(e, s), 3) for e in range(3) for s in range(3)]
[0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

import inspect
import math
from typing import Protocol, runtime_checkable

import attrs

from lamploop.checks import check_int
from lamploop.errors import ConfigurationError

__all__ = [
    "StepSchedule",
    "WarmupCosine",
    "WarmupLinear",
    "check_step_factor",
    "check_step_schedule",
    "warmup_cosine",
    "warmup_linear",
]


@runtime_checkable
class StepSchedule(Protocol):
    """``factor(epoch, step) -> float``: the learning-rate factor of step ``step`` of epoch ``epoch``."""

    def factor(self, epoch: int, step: int) -> float: ...


def _global(epoch: int, step: int, steps_per_epoch: int) -> int:
    return epoch * steps_per_epoch + step


@attrs.frozen
class _WarmupThenDecay:
    """Linear warm-up over ``warmup_steps``, then :meth:`decay` from 1 to ``final`` at ``total_steps``."""

    warmup_steps: int
    total_steps: int
    steps_per_epoch: int
    final: float = 0.0

    def factor(self, epoch: int, step: int) -> float:
        t = _global(epoch, step, self.steps_per_epoch)
        if t < self.warmup_steps:
            return (t + 1) / self.warmup_steps
        span = self.total_steps - self.warmup_steps
        progress = (
            1.0 if span == 0 else min(1.0, (t - self.warmup_steps) / span)
        )  # all warm-up: final at once
        return self.final + (1.0 - self.final) * self.decay(progress)

    def decay(self, progress: float) -> float:
        """From 1 at progress 0 to 0 at progress 1."""
        raise NotImplementedError


@attrs.frozen
class WarmupCosine(_WarmupThenDecay):
    """Linear warm-up, then a half cosine from 1 down to ``final`` at ``total_steps`` (and after)."""

    def decay(self, progress: float) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * progress))


@attrs.frozen
class WarmupLinear(_WarmupThenDecay):
    """Linear warm-up, then a straight line from 1 down to ``final`` at ``total_steps`` (and after)."""

    def decay(self, progress: float) -> float:
        return 1.0 - progress


def _checked(warmup_steps: int, total_steps: int, steps_per_epoch: int, final: float, name: str) -> None:
    try:
        check_int("warmup_steps", warmup_steps, 0)
        check_int("total_steps", total_steps, 1)
        check_int("steps_per_epoch", steps_per_epoch, 1)
    except ConfigurationError as exc:
        msg = f"{name}: {exc}"
        raise ConfigurationError(msg) from None
    if warmup_steps > total_steps or not math.isfinite(final) or final < 0:
        msg = (
            f"{name}: needs warmup_steps <= total_steps and a finite final >= 0, got "
            f"warmup_steps={warmup_steps}, total_steps={total_steps}, final={final}"
        )
        raise ConfigurationError(msg)


def warmup_cosine(
    *, warmup_steps: int, total_steps: int, steps_per_epoch: int, final: float = 0.0
) -> WarmupCosine:
    """Warm up linearly over ``warmup_steps`` steps, then decay along a half cosine to ``final``.

    Raises:
        ConfigurationError: a count out of range or ``warmup_steps > total_steps``.
    """
    _checked(warmup_steps, total_steps, steps_per_epoch, final, "warmup_cosine")
    return WarmupCosine(warmup_steps, total_steps, steps_per_epoch, final)


def warmup_linear(
    *, warmup_steps: int, total_steps: int, steps_per_epoch: int, final: float = 0.0
) -> WarmupLinear:
    """Warm up linearly over ``warmup_steps`` steps, then decay linearly to ``final``.

    Raises:
        ConfigurationError: a count out of range or ``warmup_steps > total_steps``.
    """
    _checked(warmup_steps, total_steps, steps_per_epoch, final, "warmup_linear")
    return WarmupLinear(warmup_steps, total_steps, steps_per_epoch, final)


def check_step_schedule(name: str, value: object) -> None:
    """ConfigurationError naming ``name`` unless ``value`` has ``factor(epoch, step)``.

    An epoch schedule (``factor(epoch)``) passed as a step schedule is named as one, before
    training starts rather than at its first step.
    """
    factor = getattr(value, "factor", None)
    takes_two = callable(factor)
    if factor is not None and takes_two:
        try:
            inspect.signature(factor).bind(0, 0)
        except TypeError:
            takes_two = False
        except ValueError:  # no signature to read (a builtin): its first call tells
            pass
    if takes_two:
        return
    kind = type(value).__name__
    if callable(getattr(value, "learning_rate_factor", None)):
        msg = (
            f"{name}: {kind} is an epoch schedule (one factor per epoch): pass it as "
            "learning_rate_schedule; a step schedule has factor(epoch, step) (see lamploop.schedules.step)"
        )
    else:
        msg = f"{name} must have factor(epoch, step) (see lamploop.schedules.step), got {kind}"
    raise ConfigurationError(msg)


def check_step_factor(schedule: StepSchedule, epoch: int, step: int) -> float:
    """``schedule``'s factor for the step, which must be a finite number >= 0."""
    factor = schedule.factor(epoch, step)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 <= factor < math.inf:
        msg = (
            f"the step schedule {type(schedule).__name__} gave the factor {factor!r} for epoch "
            f"{epoch}, step {step}; a step factor must be a finite number >= 0"
        )
        raise ConfigurationError(msg)
    return float(factor)
