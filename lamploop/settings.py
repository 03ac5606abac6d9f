"""``TrainingSettings``: one checked description of how a run trains, shared by every entry point.

``drive_distributed_training``, ``follow_distributed_training``,
``local_data_parallel_training_loop`` and ``fit`` keep the keyword arguments of the
design contract; each turns them into one :class:`TrainingSettings` first, so that the
checks (and, for a new setting, the plumbing) live here and nowhere else.  The field
names are the keyword names, which is what :meth:`TrainingSettings.from_arguments` relies on.

>>> from lamploop.settings import TrainingSettings
>>> TrainingSettings(max_epochs=3, accumulate_gradient_over_n_batches=2).strategy
'auto'
>>> TrainingSettings(max_epochs=-1)
Traceback (most recent call last):
...
lamploop.errors.ConfigurationError: max_epochs must be an int >= 0, got -1
"""

from __future__ import annotations

import json
import math
from collections.abc import Container, Mapping
from typing import Any, ClassVar

import attrs

from lamploop.averaging import EMA, SWA, Averaging
from lamploop.checks import (
    check_int,
    check_positive,
    check_seconds,
    check_smoothing,
    int_at_least,
    optional_int_at_least,
    optional_seconds,
    seconds,
)
from lamploop.control import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_HEARTBEAT_TIMEOUT_S
from lamploop.errors import ConfigurationError
from lamploop.loop.non_finite import NonFiniteLossPolicy, check_policy
from lamploop.loop.precision import Precision, check_precision
from lamploop.loop.selection import ModelSelection
from lamploop.schedules import LearningRateSchedule, Noop, noop
from lamploop.step_schedules import StepSchedule
from lamploop.sync.buckets import DEFAULT_BUCKET_CAP_MB
from lamploop.sync.collectives import DEFAULT_COLLECTIVE_TIMEOUT_S
from lamploop.sync.strategy import check_strategy_name
from lamploop.torch_schedulers import LrSchedulerFactory, check_interval

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "TrainingSettings",
    "check_int",
    "check_positive",
    "check_seconds",
    "check_smoothing",
]


def _smoothing(_: object, __: attrs.Attribute[float], value: float) -> None:
    check_smoothing(value)


def _strategy(_: object, __: attrs.Attribute[str], value: str) -> None:
    check_strategy_name(value)


def _positive_megabytes(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        msg = f"{attribute.name} must be a positive number of MiB, got {value!r}"
        raise ConfigurationError(msg)


def _schedule(_: object, __: attrs.Attribute[Any], value: Any) -> None:
    if not callable(getattr(value, "init", None)) or not callable(
        getattr(value, "learning_rate_factor", None)
    ):
        msg = (
            "learning_rate_schedule must have init() and learning_rate_factor(state, epoch, "
            f"last_validation_loss) (see lamploop.schedules), got {type(value).__name__}"
        )
        raise ConfigurationError(msg)


def _non_finite_policy(_: object, __: attrs.Attribute[str], value: str) -> None:
    check_policy(value)


def _optional_positive(_: object, attribute: attrs.Attribute[float | None], value: float | None) -> None:
    if value is not None:
        check_positive(attribute.name, value)


def _precision(_: object, __: attrs.Attribute[str], value: str) -> None:
    check_precision(value)


def _step_schedule(_: object, __: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not callable(getattr(value, "factor", None)):
        msg = (
            "step_schedule must have factor(epoch, step) (see lamploop.step_schedules), "
            f"got {type(value).__name__}"
        )
        raise ConfigurationError(msg)


def _averaging(_: object, __: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, (EMA, SWA)):
        msg = f"averaging must be lamploop.averaging.ema(...) or swa(...), got {type(value).__name__}"
        raise ConfigurationError(msg)


def _lr_scheduler(_: object, __: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not callable(value):
        msg = (
            "lr_scheduler must be a factory optimizer -> torch.optim.lr_scheduler scheduler "
            f"(e.g. lambda optimizer: StepLR(optimizer, 10)), got {type(value).__name__}"
        )
        raise ConfigurationError(msg)


def _interval(_: object, __: attrs.Attribute[str], value: str) -> None:
    check_interval(value)


def _container(_: object, __: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, Container):
        msg = (
            "return_min_validation_loss_model must be a container of epochs "
            f"(a tuple, a set, range(...) or lamploop.ALL_EPOCHS), got {type(value).__name__}"
        )
        raise ConfigurationError(msg)


@attrs.frozen(kw_only=True)
class TrainingSettings:
    """How a run trains: the epoch loop's settings and the step's, checked on construction.

    Attributes:
        max_epochs: the number of epochs in all (a resumed run counts those done).
        validation_frequency: validate in epochs ``e`` with ``e % frequency == 0``.
        return_min_validation_loss_model: the epochs that may become the best model.
        learning_rate_schedule: the pure schedule of the learning-rate factor.
        validation_loss_exponential_smoothing_factor: ``a`` in
            ``smoothed = raw * a + previous * (1 - a)``.
        accumulate_gradient_over_n_batches: batches per optimizer step on each rank.
        strategy: the gradient-sync strategy's registered name
            (:func:`lamploop.sync.strategy_names`), or ``"auto"``: ``"all_reduce"`` when
            every rank has an optimizer factory, else lamp's ``"reduce_to_root"``.
        bucket_cap_mb: the gradient bucket size in MiB.
        collective_timeout: seconds before a collective whose peers are alive but never
            arrive fails (see :data:`DEFAULT_COLLECTIVE_TIMEOUT_S`).
        checkpoint_every_n_steps, checkpoint_every_seconds: checkpoints inside epochs.
        on_non_finite_loss: ``"raise"`` or ``"skip_step"`` (see :mod:`lamploop.loop.non_finite`).
        max_gradient_norm: clip each step's summed gradient to this global L2 norm (``None``: no clipping).
        precision: ``"32"``, ``"bf16"`` or ``"fp16"`` (see :mod:`lamploop.loop.precision`).
        step_schedule: a per-step learning-rate factor, times the epoch schedule's
            (see :mod:`lamploop.step_schedules`).
        averaging: keep an EMA or SWA of the weights on the root (see :mod:`lamploop.averaging`).
        lr_scheduler, lr_scheduler_interval: a ``torch.optim.lr_scheduler`` factory, stepped
            per ``"epoch"`` or per ``"step"`` (see :mod:`lamploop.torch_schedulers`).
        model_selection_metric, model_selection_mode: select the best model by a validation
            metric's smallest or largest smoothed value (see :func:`lamploop.epochs`).
        early_stopping_patience: stop after this many validations without a new best.

    Raises:
        ConfigurationError: a value is out of range; the message names the argument.
    """

    max_epochs: int = attrs.field(default=0, validator=int_at_least(None, 0))
    validation_frequency: int = attrs.field(default=1, validator=int_at_least(None, 1))
    return_min_validation_loss_model: Container[int] = attrs.field(default=(), validator=_container)
    learning_rate_schedule: LearningRateSchedule[Any] = attrs.field(factory=noop, validator=_schedule)
    validation_loss_exponential_smoothing_factor: float = attrs.field(default=1.0, validator=_smoothing)
    accumulate_gradient_over_n_batches: int = attrs.field(default=1, validator=int_at_least(None, 1))
    strategy: str = attrs.field(default="auto", validator=_strategy)
    bucket_cap_mb: float = attrs.field(default=DEFAULT_BUCKET_CAP_MB, validator=_positive_megabytes)
    collective_timeout: float = attrs.field(default=DEFAULT_COLLECTIVE_TIMEOUT_S, validator=seconds)
    checkpoint_every_n_steps: int | None = attrs.field(default=None, validator=optional_int_at_least(1))
    checkpoint_every_seconds: float | None = attrs.field(default=None, validator=optional_seconds)
    on_non_finite_loss: NonFiniteLossPolicy = attrs.field(default="raise", validator=_non_finite_policy)
    max_gradient_norm: float | None = attrs.field(default=None, validator=_optional_positive)
    precision: Precision = attrs.field(default="32", validator=_precision)
    step_schedule: StepSchedule | None = attrs.field(default=None, validator=_step_schedule)
    averaging: Averaging | None = attrs.field(default=None, validator=_averaging)
    lr_scheduler: LrSchedulerFactory | None = attrs.field(default=None, validator=_lr_scheduler)
    lr_scheduler_interval: str = attrs.field(default="epoch", validator=_interval)
    model_selection_metric: str | None = None
    model_selection_mode: str = "min"
    early_stopping_patience: int | None = attrs.field(default=None, validator=optional_int_at_least(1))

    def __attrs_post_init__(self) -> None:
        ModelSelection(self.model_selection_metric, self.model_selection_mode)  # type: ignore[arg-type]
        if self.lr_scheduler is not None and (
            self.step_schedule is not None or not isinstance(self.learning_rate_schedule, Noop)
        ):
            msg = (
                "lr_scheduler owns the learning rates: leave learning_rate_schedule at noop() and "
                f"step_schedule at None (got {type(self.learning_rate_schedule).__name__} and "
                f"{type(self.step_schedule).__name__})"
            )
            raise ConfigurationError(msg)

    EVERY_RANK: ClassVar[tuple[str, ...]] = (
        "accumulate_gradient_over_n_batches",
        "strategy",
        "bucket_cap_mb",
        "collective_timeout",
        "on_non_finite_loss",
        "max_gradient_norm",
        "precision",
        "step_schedule",
        "lr_scheduler",
        "lr_scheduler_interval",
    )
    """The settings every rank must hold alike (followers take only these)."""

    def every_rank_fingerprint(self) -> str:
        """The :attr:`EVERY_RANK` settings as one string that the ranks compare when they meet.

        Numbers, strings and frozen attrs values (schedules) by value; a function (an
        ``lr_scheduler`` factory, a step schedule of your own) by whether it is set.
        """

        def shown(value: Any) -> Any:
            if value is None or isinstance(value, bool | int | float | str):
                return value
            if attrs.has(type(value)):
                return repr(value)
            return f"a {type(value).__name__}"

        return json.dumps({name: shown(getattr(self, name)) for name in self.EVERY_RANK}, sort_keys=True)

    def for_every_rank(self) -> dict[str, Any]:
        """The :attr:`EVERY_RANK` settings as keyword arguments (for ``follow_distributed_training``)."""
        return {name: getattr(self, name) for name in self.EVERY_RANK}

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> TrainingSettings:
        """The settings among a public function's arguments (``locals()``), picked by name."""
        names = {field.name for field in attrs.fields(cls)}
        return cls(**{name: value for name, value in arguments.items() if name in names})
