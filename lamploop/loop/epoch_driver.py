"""``epochs``: the epoch driver.

The driver owns the logic between epochs (learning-rate schedule, validation
frequency, smoothing of the validation loss, model selection, checkpoints) and
nothing else: training and validation are awaited effects handed in by the
caller.  In pseudocode::

    state = init_state or LoopState(epoch=0)
    while True:
        schedule_state, factor = schedule(schedule_state, state.epoch, state.last_validation_loss)
        if state.epoch >= max_epochs or factor <= 0: return state
        train_loss = await train_epoch(factor)  # StreamExhausted (no samples left anywhere): return state
        if validating this epoch:
            raw = await validation_epoch()
            smoothed = raw * a + previous_smoothed * (1 - a)
            if epoch is eligible and smoothed < min: await save_min_validation_loss_model()
        state = next state (epoch + 1)
        await checkpoint_state(state, schedule_state)
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable, Container
from typing import Any, Final, TypeVar

import attrs

from lamploop.checks import check_callable, check_epochs_container, check_int, check_schedule, check_smoothing
from lamploop.errors import ConfigurationError, NonFiniteLossError, StreamExhausted
from lamploop.loop.selection import ModelSelection, SelectionMode, smoothed_metrics, validations_since_best
from lamploop.metrics import metrics_of
from lamploop.schedules import LearningRateSchedule, noop
from lamploop.state import LearningCurveEntry, LoopState, check_loop_state

__all__ = ["ALL_EPOCHS", "AllEpochs", "epochs"]

S = TypeVar("S")


class AllEpochs(Container[int]):
    """A container holding every epoch: pass :data:`ALL_EPOCHS` as
    ``return_min_validation_loss_model`` to let any epoch become the best one."""

    def __contains__(self, epoch: object) -> bool:
        return isinstance(epoch, int)

    def __repr__(self) -> str:
        return "ALL_EPOCHS"


ALL_EPOCHS: Final = AllEpochs()


def _validate(
    max_epochs: int,
    validation_frequency: int,
    smoothing: float,
    schedule: LearningRateSchedule[Any],
    has_validation: bool,
    init_state: LoopState | None,
) -> None:
    try:
        check_int("max_epochs", max_epochs, 0)
        check_int("validation_frequency", validation_frequency, 1)
        check_smoothing(smoothing)
        check_schedule("learning_rate_schedule", schedule)
    except ConfigurationError as exc:
        msg = f"epochs: {exc}"
        raise ConfigurationError(msg) from None
    if getattr(schedule, "needs_validation_loss", False) and not has_validation:
        msg = (
            f"epochs: the learning-rate schedule {type(schedule).__name__} needs a validation loss, "
            "but validation_epoch is None (no validation stream was given)"
        )
        raise ConfigurationError(msg)
    expected_frequency = getattr(schedule, "validation_frequency", validation_frequency)
    if expected_frequency != validation_frequency:
        msg = (
            f"epochs: the learning-rate schedule {type(schedule).__name__} was made for "
            f"validation_frequency={expected_frequency}, but epochs runs with validation_frequency="
            f"{validation_frequency}; pass the same value to both"
        )
        raise ConfigurationError(msg)
    if init_state is not None and not isinstance(init_state, LoopState):
        hint = "; pass its .loop_state" if hasattr(init_state, "loop_state") else ""
        kind = type(init_state).__name__
        msg = f"epochs: init_state must be a lamploop.LoopState or None, got {kind}{hint}"
        raise ConfigurationError(msg)
    if init_state is not None:
        check_loop_state("epochs: init_state", init_state)


def _check_effects(
    train_epoch: object,
    validation_epoch: object,
    save_min_validation_loss_model: object,
    checkpoint_state: object,
    on_end: object,
    return_min_validation_loss_model: object,
) -> None:
    """The callbacks are callable and the eligible epochs a container, before the first epoch."""
    try:
        check_callable("train_epoch", train_epoch)
        check_callable("validation_epoch", validation_epoch, optional=True)
        check_callable("save_min_validation_loss_model", save_min_validation_loss_model)
        check_callable("checkpoint_state", checkpoint_state, optional=True)
        check_callable("on_end", on_end, optional=True)
        check_epochs_container("return_min_validation_loss_model", return_min_validation_loss_model)
    except ConfigurationError as exc:
        msg = f"epochs: {exc}"
        raise ConfigurationError(msg) from None


def _check_schedule_state(schedule: object, state: object) -> None:
    """A schedule state to resume from is of the schedule's state type (where it names one)."""
    expected = getattr(schedule, "state_type", None)
    if state is None or not isinstance(expected, type) or isinstance(state, expected):
        return
    msg = (
        f"epochs: learning_rate_schedule_init_state is {type(state).__name__}, but the schedule "
        f"{type(schedule).__name__} keeps a {expected.__name__}; pass the schedule state a checkpoint "
        "of this schedule saved, or None to start it afresh"
    )
    raise ConfigurationError(msg)


async def _awaited(result: object, name: str, epoch: int) -> Any:
    """``await result``; a callback that returned a value instead of an awaitable is named."""
    if not inspect.isawaitable(result):
        msg = (
            f"epochs: {name} returned {type(result).__name__} in epoch {epoch}, not an awaitable; "
            f"make it an async function (async def {name}(...))"
        )
        raise ConfigurationError(msg)
    return await result


def _state_and_factor(returned: Any, schedule: object, epoch: int) -> tuple[Any, Any]:
    """``learning_rate_factor``'s ``(next_state, factor)``, else ConfigurationError naming the schedule."""
    if not isinstance(returned, tuple | list) or len(returned) != 2:
        msg = (
            f"epochs: the learning-rate schedule {type(schedule).__name__}.learning_rate_factor "
            f"returned {returned!r:.60} for epoch {epoch}; it returns a pair (next_state, factor)"
        )
        raise ConfigurationError(msg)
    return returned[0], returned[1]


def _check_factor(factor: object, schedule: object, epoch: int) -> None:
    """A factor is a finite number: a NaN would reach the optimizer and show as a NaN loss."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
        msg = (
            f"epochs: the learning-rate schedule {type(schedule).__name__} gave the factor {factor!r} "
            f"for epoch {epoch}; a factor must be a finite number (<= 0 ends training)"
        )
        raise ConfigurationError(msg)


def _finite(value: float, what: str, epoch: int) -> float:
    try:
        if isinstance(value, str | bytes):
            raise TypeError
        value = float(value)
    except (TypeError, ValueError):
        described = f"a tensor of shape {tuple(value.shape)}" if hasattr(value, "shape") else f"{value!r:.60}"
        msg = f"epochs: the {what} of epoch {epoch} is {described}, not a number (a float)"
        raise ConfigurationError(msg) from None
    if not math.isfinite(value):
        msg = f"the {what} of epoch {epoch} is {value}"
        raise NonFiniteLossError(msg, epoch=epoch, batch=None)
    return value


async def epochs(
    *,
    max_epochs: int,
    train_epoch: Callable[[float], Awaitable[float]],
    validation_epoch: Callable[[], Awaitable[float]] | None,
    save_min_validation_loss_model: Callable[[], Awaitable[None]],
    checkpoint_state: Callable[[LoopState, S], Awaitable[None]] | None = None,
    validation_frequency: int = 1,
    return_min_validation_loss_model: Container[int] = (),
    learning_rate_schedule: LearningRateSchedule[S] = noop(),  # type: ignore[assignment]
    init_state: LoopState | None = None,
    learning_rate_schedule_init_state: S | None = None,
    validation_loss_exponential_smoothing_factor: float = 1.0,
    model_selection_metric: str | None = None,
    model_selection_mode: SelectionMode = "min",
    early_stopping_patience: int | None = None,
    on_end: Callable[[str], object] | None = None,
) -> LoopState:
    """Run epochs until ``max_epochs`` or until the schedule's factor is <= 0.

    Args:
        max_epochs: the epoch count at which to stop (epochs ``0 .. max_epochs-1``
            run, minus those already in ``init_state``).
        train_epoch: trains one epoch with the given learning-rate factor and
            returns the mean training loss.
        validation_epoch: returns the mean validation loss, or ``None`` for no
            validation.
        save_min_validation_loss_model: called when an eligible epoch's smoothed
            validation loss is strictly below every earlier one.
        checkpoint_state: called after every epoch ``e`` with ``LoopState`` at
            epoch ``e + 1`` and the schedule state that epoch ``e + 1`` will use:
            pass both back as ``init_state`` and
            ``learning_rate_schedule_init_state`` to resume.
        validation_frequency: validate in epochs ``e`` with ``e % frequency == 0``.
        return_min_validation_loss_model: the epochs that may become the best
            model (:data:`ALL_EPOCHS` for all).
        learning_rate_schedule: asked for epoch ``e``'s factor before epoch
            ``e`` runs, and once more when the loop stops.
        init_state: resume from this state (default: a fresh ``LoopState``).
        learning_rate_schedule_init_state: resume the schedule from this state
            (default: ``learning_rate_schedule.init()``).
        validation_loss_exponential_smoothing_factor: ``a`` in
            ``smoothed = raw * a + previous_smoothed * (1 - a)``; the first
            smoothed value is the raw one.  The last smoothed value carries over
            epochs without validation.  Metrics are smoothed alike.
        model_selection_metric, model_selection_mode: select the best model by the
            smoothed validation metric of that name (see :mod:`lamploop.metrics`), the
            smallest (``"min"``) or the largest (``"max"``); ``None`` (default): by the
            smoothed validation loss.  The best value is in ``min_validation_loss``.
        early_stopping_patience: stop once this many validations in a row have not
            improved on the best one (as ``model_selection_*`` judges); ``None``: never.
        on_end: called once, as the loop ends, with why it ended before ``max_epochs`` in
            words (``"early stopping: ..."``, the schedule's factor, the end of the streams;
            ``""`` at ``max_epochs``): the events' ``RunFinished.reason``.

    A ``train_epoch`` that raises :class:`~lamploop.errors.StreamExhausted` (no rank had
    a batch: every stream of samples ended) also ends the loop; that epoch is not recorded.

    Returns:
        The final ``LoopState``; its ``epoch`` is the number of epochs run in all.

    Raises:
        ConfigurationError: an argument is out of range or of the wrong kind (a callback
            that is not callable or returns no awaitable, an ``init_state`` that is not a
            ``LoopState``, a schedule state of another type than the schedule's
            ``state_type``, a loss that is not a number), or the schedule needs a validation
            loss but ``validation_epoch`` is ``None``.
        NonFiniteLossError: a training or validation loss is NaN or infinite.
    """
    schedule = learning_rate_schedule
    a = validation_loss_exponential_smoothing_factor
    _validate(max_epochs, validation_frequency, a, schedule, validation_epoch is not None, init_state)
    _check_effects(
        train_epoch,
        validation_epoch,
        save_min_validation_loss_model,
        checkpoint_state,
        on_end,
        return_min_validation_loss_model,
    )
    _check_schedule_state(schedule, learning_rate_schedule_init_state)
    selection = ModelSelection(model_selection_metric, model_selection_mode)
    if early_stopping_patience is not None:
        check_int("epochs: early_stopping_patience", early_stopping_patience, 1)
    state = init_state if init_state is not None else LoopState()
    schedule_state: S = (
        learning_rate_schedule_init_state
        if learning_rate_schedule_init_state is not None
        else schedule.init()
    )
    while True:
        epoch = state.epoch
        schedule_state, factor = _state_and_factor(
            schedule.learning_rate_factor(schedule_state, epoch, state.last_validation_loss), schedule, epoch
        )
        _check_factor(factor, schedule, epoch)
        reason = _end_reason(state, max_epochs, factor, early_stopping_patience, selection)
        if reason is None:
            try:
                trained = await _awaited(train_epoch(factor), "train_epoch", epoch)
            except StreamExhausted:  # the stream of samples is over: the run ends, the empty epoch unrecorded
                reason = f"every stream of samples ended (no rank had a batch in epoch {epoch})"
        if reason is not None:
            if on_end is not None:
                on_end(reason)
            return state
        training_loss = _finite(trained, "training loss", epoch)
        validation: tuple[float, float] | None = None
        validation_metrics: dict[str, tuple[float, float]] = {}
        if validation_epoch is not None and epoch % validation_frequency == 0:
            validated = await _awaited(validation_epoch(), "validation_epoch", epoch)
            raw = _finite(validated, "validation loss", epoch)
            previous = state.last_validation_loss if state.last_validation_loss is not None else raw
            validation = (raw * a + previous * (1.0 - a), raw)
            validation_metrics = smoothed_metrics(metrics_of(validated), state.learning_curve, a)
        last, best, best_epoch = (
            state.last_validation_loss,
            state.min_validation_loss,
            state.min_validation_epoch,
        )
        if validation is not None:
            last = validation[0]
            value = selection.value(validation, validation_metrics, epoch)
            if epoch in return_min_validation_loss_model and selection.improves(value, best):
                best, best_epoch = value, epoch
                await _awaited(save_min_validation_loss_model(), "save_min_validation_loss_model", epoch)
        state = attrs.evolve(
            state,
            epoch=epoch + 1,
            last_validation_loss=last,
            min_validation_loss=best,
            min_validation_epoch=best_epoch,
            learning_curve=(
                *state.learning_curve,
                LearningCurveEntry(
                    epoch,
                    training_loss,
                    validation,
                    metrics_of(trained),
                    validation_metrics,
                    learning_rate_factor=factor,
                ),
            ),
        )
        if checkpoint_state is not None:
            await _awaited(checkpoint_state(state, schedule_state), "checkpoint_state", epoch)


def _end_reason(
    state: LoopState, max_epochs: int, factor: float, patience: int | None, selection: ModelSelection
) -> str | None:
    """Why the loop ends before epoch ``state.epoch``: ``""`` at ``max_epochs``, ``None`` if it goes on."""
    if state.epoch >= max_epochs:
        return ""
    if factor <= 0:
        return f"the learning-rate schedule gave factor {factor:g} for epoch {state.epoch} (<= 0 ends it)"
    if patience is not None:
        since, best_epoch = validations_since_best(state, selection)
        if since >= patience:
            return (
                f"early stopping: {since} validations without a new best since "
                f"epoch {best_epoch} (early_stopping_patience={patience})"
            )
    return None
