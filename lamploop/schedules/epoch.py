"""Pure learning-rate schedules.

A schedule is a pair of pure functions over a plain state value, like an optax
transformation: ``init() -> S`` and
``learning_rate_factor(state, epoch, last_validation_loss) -> (next_state, factor)``.
The epoch loop asks for epoch ``e``'s factor just before epoch ``e`` runs and
multiplies every parameter group's base learning rate by it.  **A factor <= 0
ends training** (this is how a schedule stops early).

The state is plain data (``None`` or a frozen attrs class of numbers) so that a
checkpoint can store it as JSON and a resumed run asks the schedule exactly what
an uninterrupted run would have asked.

>>> from lamploop import schedules
>>> s = schedules.linear(start=1.0, end=0.0, max_steps=4)
>>> state = s.init()
>>> [round(s.learning_rate_factor(state, e, None)[1], 2) for e in range(5)]
[1.0, 0.75, 0.5, 0.25, 0.0]
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import attrs

from lamploop.checks import check_finite, check_int
from lamploop.errors import ConfigurationError, LamploopError

__all__ = [
    "LearningRateSchedule",
    "PlateauState",
    "cyclic",
    "decrement",
    "from_epoch_count",
    "linear",
    "noop",
    "reduce_lr_on_plateau",
    "step_after",
]

S = TypeVar("S")


class LearningRateSchedule(Protocol[S]):
    """A pure learning-rate schedule with state of type ``S``.

    Attributes:
        needs_validation_loss: ``True`` when the schedule reads
            ``last_validation_loss``; the loop then refuses to run without a
            validation stream.
        state_type: the type of the state, used to read it back from JSON.
    """

    @property
    def needs_validation_loss(self) -> bool: ...

    @property
    def state_type(self) -> Any: ...

    def init(self) -> S:
        """The state before epoch 0."""
        ...

    def learning_rate_factor(
        self, state: S, epoch: int, last_validation_loss: float | None
    ) -> tuple[S, float]:
        """The factor for ``epoch`` and the state to pass when asking for the next epoch."""
        ...


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigurationError(message)


@attrs.frozen
class _Stateless(abc.ABC):
    """Base of the schedules whose factor is a function of the epoch alone."""

    needs_validation_loss = False
    state_type = type(None)

    def init(self) -> None:
        return None

    def learning_rate_factor(
        self, state: None, epoch: int, last_validation_loss: float | None
    ) -> tuple[None, float]:
        return None, self.factor(epoch)

    @abc.abstractmethod
    def factor(self, epoch: int) -> float:
        """The factor of ``epoch``."""


@attrs.frozen
class Noop(_Stateless):
    """Factor 1 in every epoch."""

    def factor(self, epoch: int) -> float:
        return 1.0


@attrs.frozen
class Decrement(_Stateless):
    """``factor(e) = fraction ** (e // every)``."""

    every: int
    fraction: float

    def factor(self, epoch: int) -> float:
        return float(self.fraction ** (epoch // self.every))


@attrs.frozen
class Linear(_Stateless):
    """``factor(e) = start + (end - start) * min(e, max_steps) / max_steps``."""

    start: float
    end: float
    max_steps: int

    def factor(self, epoch: int) -> float:
        if epoch >= self.max_steps:
            # Exactly ``end``: the formula can miss it (0.99999 + -0.99999 * 9 / 9 is
            # 1.1e-16), and with end=0 training would not stop where the docs say.
            return self.end
        return self.start + (self.end - self.start) * epoch / self.max_steps


@attrs.frozen
class StepAfter(_Stateless):
    """``factor(e) = factor if e >= steps else 1``."""

    steps: int
    step_factor: float

    def factor(self, epoch: int) -> float:
        return self.step_factor if epoch >= self.steps else 1.0


@attrs.frozen
class Cyclic(_Stateless):
    """A triangle wave: 1 at the start of each period, ``max_factor`` half-way through.

    With ``p = e % period_length`` and ``h = period_length / 2``:
    ``factor(e) = 1 + (max_factor - 1) * (1 - |p - h| / h)``.
    """

    max_factor: float
    period_length: int

    def factor(self, epoch: int) -> float:
        half = self.period_length / 2
        position = epoch % self.period_length
        return 1.0 + (self.max_factor - 1.0) * (1.0 - abs(position - half) / half)


@attrs.frozen
class FromEpochCount(_Stateless):
    """``factor(e) = f(e)`` for a user function ``f``."""

    f: Callable[[int], float]

    def factor(self, epoch: int) -> float:
        try:
            value = self.f(epoch)
        except LamploopError:
            raise
        except Exception as exc:  # a user's function: say which, and for which epoch
            raised = f"{type(exc).__name__}: {exc}"
            msg = (
                f"from_epoch_count: {self._name()}({epoch}) raised {raised}; f is asked for "
                "every epoch from 0 to max_epochs, the last time at the stop (a table of factors "
                "needs max_epochs + 1 entries)"
            )
            raise ConfigurationError(msg) from exc
        if isinstance(value, bool) or not isinstance(value, (int, float)):  # e.g. a function without `return`
            msg = (
                f"from_epoch_count: {self._name()}({epoch}) returned {value!r:.60} for epoch {epoch}, "
                "not a number; "
                "a factor must be a finite number (<= 0 ends training)"
            )
            raise ConfigurationError(msg)
        return float(value)

    def _name(self) -> str:
        return str(getattr(self.f, "__qualname__", type(self.f).__name__))


def noop() -> Noop:
    """Factor 1 in every epoch: train with the optimizer's own learning rate."""
    return Noop()


def decrement(every: int, fraction: float) -> Decrement:
    """Multiply the factor by ``fraction`` every ``every`` epochs: ``fraction ** (epoch // every)``.

    Raises:
        ConfigurationError: ``every < 1`` or ``fraction`` not in ``[0, 1]``.
    """
    check_int("decrement: every", every, 1)
    _require(
        0.0 <= check_finite("decrement: fraction", fraction) <= 1.0,
        f"decrement: fraction must be in [0, 1], got {fraction}",
    )
    return Decrement(every, fraction)


def linear(start: float, end: float, max_steps: int) -> Linear:
    """Go linearly from ``start`` (epoch 0) to ``end`` (epoch ``max_steps`` and after).

    ``start + (end - start) * min(epoch, max_steps) / max_steps``; with
    ``end == 0`` training stops at epoch ``max_steps``, with ``end < 0`` at the
    first epoch whose factor is <= 0.

    Raises:
        ConfigurationError: ``start`` or ``end`` not a finite number, or ``max_steps < 1``.
    """
    check_finite("linear: start", start)
    check_finite("linear: end", end)
    check_int("linear: max_steps", max_steps, 1)
    return Linear(start, end, max_steps)


def step_after(steps: int, factor: float) -> StepAfter:
    """Factor 1 before epoch ``steps``, ``factor`` from then on.

    Raises:
        ConfigurationError: ``steps < 0``, or ``factor`` not a finite number.
    """
    check_int("step_after: steps", steps, 0)
    check_finite("step_after: factor", factor)
    return StepAfter(steps, factor)


def cyclic(max_factor: float, period_length: int) -> Cyclic:
    """A triangle wave between 1 and ``max_factor`` with the given period (in epochs).

    ``1 + (max_factor - 1) * (1 - |p - h| / h)`` with ``p = epoch % period_length``,
    ``h = period_length / 2``.

    Raises:
        ConfigurationError: ``period_length < 2`` or ``max_factor <= 0``.
    """
    check_int("cyclic: period_length", period_length, 2)
    _require(
        check_finite("cyclic: max_factor", max_factor) > 0,
        f"cyclic: max_factor must be > 0, got {max_factor}",
    )
    return Cyclic(max_factor, period_length)


def from_epoch_count(f: Callable[[int], float]) -> FromEpochCount:
    """The factor is ``f(epoch)``; ``f`` must be a pure function of the epoch.

    ``f`` is asked for every epoch from 0 to ``max_epochs``: the last time at the stop, as every
    schedule is (DESIGN.md: "also once more at the stop"), where a factor <= 0 would end the run.

    Raises:
        ConfigurationError: (when asked) ``f`` raised, naming the epoch, or returned no number.
    """
    _require(callable(f), f"from_epoch_count: f must be callable, got {f!r}")
    return FromEpochCount(f)


@attrs.frozen
class PlateauState:
    """The state of :func:`reduce_lr_on_plateau`.

    Attributes:
        factor: the current factor.
        best: the best validation loss seen so far.
        bad_validations: validations since ``best`` last improved.
    """

    factor: float
    best: float | None = None
    bad_validations: int = 0


@attrs.frozen
class ReduceLrOnPlateau:
    """See :func:`reduce_lr_on_plateau`."""

    start_factor: float
    reduce_factor: float
    patience: int
    threshold: float
    min_factor: float
    validation_frequency: int
    needs_validation_loss = True
    state_type = PlateauState

    def init(self) -> PlateauState:
        return PlateauState(factor=self.start_factor)

    def learning_rate_factor(
        self, state: PlateauState, epoch: int, last_validation_loss: float | None
    ) -> tuple[PlateauState, float]:
        if not isinstance(state, PlateauState):
            msg = (
                f"reduce_lr_on_plateau: the state must be a PlateauState (from init() or the "
                f"previous call), got {type(state).__name__}"
            )
            raise ConfigurationError(msg)
        # A loss carried over an epoch without validation is no new observation;
        # validation ran in epoch e - 1 exactly when (e - 1) % frequency == 0.
        loss = last_validation_loss
        if loss is None or epoch < 1 or (epoch - 1) % self.validation_frequency != 0:
            return state, state.factor
        if state.best is None or loss < state.best - self.threshold * abs(state.best):
            return attrs.evolve(state, best=loss, bad_validations=0), state.factor
        bad = state.bad_validations + 1
        if bad > self.patience:
            factor = max(state.factor * self.reduce_factor, self.min_factor)
            return attrs.evolve(state, factor=factor, bad_validations=0), factor
        return attrs.evolve(state, bad_validations=bad), state.factor


def reduce_lr_on_plateau(
    *,
    start_factor: float = 1.0,
    reduce_factor: float = 0.5,
    patience: int = 10,
    threshold: float = 1e-4,
    min_factor: float = 0.0,
    validation_frequency: int = 1,
) -> ReduceLrOnPlateau:
    """Multiply the factor by ``reduce_factor`` when validation stops improving.

    A validation loss ``v`` improves when ``v < best - threshold * |best|``.
    After more than ``patience`` validations without improvement the factor
    becomes ``max(factor * reduce_factor, min_factor)`` and the count restarts.
    Patience counts validations, not epochs: pass the ``validation_frequency``
    given to :func:`lamploop.epochs` (which checks that they agree), so that a
    loss carried over an epoch without validation is not counted again while a
    truly flat loss is.  ``min_factor = 0`` lets the factor shrink forever; it
    never reaches 0 by itself, so this schedule does not stop training.

    Raises:
        ConfigurationError: a value out of range.
    """
    where = "reduce_lr_on_plateau"
    _require(
        check_finite(f"{where}: start_factor", start_factor) > 0,
        f"{where}: start_factor must be > 0, got {start_factor}",
    )
    _require(
        0 < check_finite(f"{where}: reduce_factor", reduce_factor) < 1,
        f"{where}: reduce_factor must be in (0, 1), got {reduce_factor}",
    )
    check_int(f"{where}: patience (a count of validations)", patience, 0)
    _require(
        check_finite(f"{where}: threshold", threshold) >= 0,
        f"{where}: threshold must be >= 0, got {threshold}",
    )
    _require(
        check_finite(f"{where}: min_factor", min_factor) >= 0,
        f"{where}: min_factor must be >= 0, got {min_factor}",
    )
    check_int(f"{where}: validation_frequency", validation_frequency, 1)
    return ReduceLrOnPlateau(
        start_factor, reduce_factor, patience, threshold, min_factor, validation_frequency
    )
