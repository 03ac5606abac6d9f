"""``TrainingSettings``: one checked description of how a run trains, shared by every entry point.

``fit`` takes every setting as a flat keyword and collects them into one
:class:`TrainingSettings` (:meth:`TrainingSettings.from_arguments`: the field names are
the keyword names).  The lower-level entry points (``drive_distributed_training``,
``follow_distributed_training``, ``local_data_parallel_training_loop``) keep the design
contract's keywords (lamp's) and take everything beyond lamp as one ``settings=`` object;
the settings keywords they took before it are still accepted, declared once here
(:class:`SettingKeywords` and its two smaller bases, frozen: a new setting is a field and a
keyword of ``fit``, never a new keyword here), and merged by :func:`merged_settings`.

>>> from lamploop.settings import TrainingSettings
>>> TrainingSettings(max_epochs=3, accumulate_gradient_over_n_batches=2).strategy
'auto'
>>> TrainingSettings(max_epochs=-1)
Traceback (most recent call last):
...
lamploop.errors.ConfigurationError: max_epochs must be an int >= 0, got -1
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import sys
from collections.abc import Callable, Container, Mapping
from typing import Any, ClassVar, TypedDict

import attrs

from lamploop.averaging import EMA, SWA, Averaging
from lamploop.checks import (
    check_epochs_container,
    check_int,
    check_positive,
    check_schedule,
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
from lamploop.loop.profiler import Profile
from lamploop.loop.selection import ModelSelection, SelectionMode
from lamploop.schedules import LearningRateSchedule, Noop, noop
from lamploop.schedules.step import StepSchedule, check_step_schedule
from lamploop.schedules.torch_scheduler import LrSchedulerFactory, SchedulerInterval, check_interval
from lamploop.sync.buckets import DEFAULT_BUCKET_CAP_MB
from lamploop.sync.collectives import DEFAULT_COLLECTIVE_TIMEOUT_S
from lamploop.sync.strategy import check_strategy_name

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover - CI runs 3.11; torch depends on typing_extensions
    from typing_extensions import Unpack

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_COLLECTIVE_TIMEOUT_S",
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "LocalSettingKeywords",
    "RankSettingKeywords",
    "SettingKeywords",
    "TrainingSettings",
    "Unpack",
    "check_int",
    "check_positive",
    "check_seconds",
    "check_smoothing",
    "merged_settings",
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
    check_schedule("learning_rate_schedule", value)


def _non_finite_policy(_: object, __: attrs.Attribute[str], value: str) -> None:
    check_policy(value)


def _optional_positive(_: object, attribute: attrs.Attribute[float | None], value: float | None) -> None:
    if value is not None:
        check_positive(attribute.name, value)


def _precision(_: object, __: attrs.Attribute[str], value: str) -> None:
    check_precision(value)


def _step_schedule(_: object, __: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        check_step_schedule("step_schedule", value)


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
    check_epochs_container("return_min_validation_loss_model", value)


def _profile(_: object, __: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, Profile):
        msg = f"profile must be a lamploop.Profile or None, got {value!r}"
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
            (see :mod:`lamploop.schedules.step`).
        averaging: keep an EMA or SWA of the weights on the root (see :mod:`lamploop.averaging`).
        lr_scheduler, lr_scheduler_interval: a ``torch.optim.lr_scheduler`` factory, stepped
            per ``"epoch"`` or per ``"step"`` (see :mod:`lamploop.schedules.torch_scheduler`).
        model_selection_metric, model_selection_mode: select the best model by a validation
            metric's smallest or largest smoothed value (see :func:`lamploop.epochs`).
        early_stopping_patience: stop after this many validations without a new best.
        profile: a :class:`~lamploop.loop.profiler.Profile`, torch.profiler over a window of
            steps on every rank (``None``: no profiler).

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
    profile: Profile | None = attrs.field(default=None, validator=_profile)

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

        Numbers (``25`` and ``25.0`` alike), strings and frozen attrs values (schedules) by
        value; anything else (an ``lr_scheduler`` factory, a step schedule of your own) by
        whether it is set and its type's name.
        """

        def shown(value: Any) -> Any:
            if value is None or isinstance(value, bool | str):
                return value
            if isinstance(value, int | float):  # 25 and 25.0 compare equal: so do their fingerprints
                return float(value)
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


# --------------------------------------------------------------------------------------------
# The settings keywords of the lower-level entry points, kept for the code written before
# ``settings=``.  Frozen: a new setting is a TrainingSettings field and a keyword of ``fit``
# only; these three stay as they are (tests/test_settings_object.py checks that every
# TrainingSettings field is a keyword of fit).


class RankSettingKeywords(TypedDict, total=False):
    """``follow_distributed_training``'s settings keywords: :attr:`TrainingSettings.EVERY_RANK`."""

    strategy: str
    bucket_cap_mb: float
    collective_timeout: float
    on_non_finite_loss: NonFiniteLossPolicy
    max_gradient_norm: float | None
    precision: Precision
    step_schedule: StepSchedule | None
    lr_scheduler: LrSchedulerFactory | None
    lr_scheduler_interval: SchedulerInterval


class LocalSettingKeywords(RankSettingKeywords, total=False):
    """``local_data_parallel_training_loop``'s settings keywords: every rank's and the root's choices."""

    averaging: Averaging | None
    model_selection_metric: str | None
    model_selection_mode: SelectionMode
    early_stopping_patience: int | None


class SettingKeywords(LocalSettingKeywords, total=False):
    """``drive_distributed_training``'s settings keywords: all of the above and the checkpoint cadence."""

    checkpoint_every_n_steps: int | None
    checkpoint_every_seconds: float | None


@functools.cache
def _lamp_parameters(function: Callable[..., Any]) -> dict[str, Any]:
    """The function's parameters that are settings too (lamp's keywords), with their defaults."""
    fields = attrs.fields_dict(TrainingSettings)
    return {
        name: parameter.default
        for name, parameter in inspect.signature(function).parameters.items()
        if name in fields
    }


def merged_settings(
    function: Callable[..., Any], arguments: Mapping[str, Any], accepted: type[Mapping[str, Any]]
) -> TrainingSettings:
    """The one :class:`TrainingSettings` of a call of a lower-level entry point.

    Args:
        function: the entry point: its name goes into the messages, and its parameters that
            are :class:`TrainingSettings` fields are lamp's (``max_epochs``,
            ``validation_frequency``...).
        arguments: its arguments (``locals()``): ``settings`` (its ``settings=``),
            ``keywords`` (its ``**keywords``, settings given the older way) and lamp's.
        accepted: the TypedDict of the settings keywords it takes (:class:`SettingKeywords`...).

    A lamp keyword counts as given when it differs from the function's default (a required
    one always does); with ``settings=`` it must then agree with the settings' value unless
    that is :class:`TrainingSettings`' default, and one left at its default takes the
    settings' value.

    Raises:
        ConfigurationError: an unknown keyword (named, with the function), a setting given
            both as a keyword and in ``settings=``, ``settings`` not a :class:`TrainingSettings`,
            or a value out of range.
    """
    settings: TrainingSettings | None = arguments["settings"]
    keywords: Mapping[str, Any] = arguments["keywords"]
    parameters = _lamp_parameters(function)
    lamp = {name: arguments[name] for name in parameters}
    where = function.__name__
    known = accepted.__required_keys__ | accepted.__optional_keys__  # type: ignore[attr-defined]
    unknown = sorted(set(keywords) - known)
    if unknown:
        msg = (
            f"{where}: unknown keyword argument {', '.join(map(repr, unknown))} (its settings keywords: "
            f"{', '.join(sorted(known))}; any setting fits in settings=TrainingSettings(...))"
        )
        raise ConfigurationError(msg)
    if settings is None:
        return TrainingSettings(**lamp, **keywords)
    if not isinstance(settings, TrainingSettings):
        msg = f"{where}: settings must be a lamploop.TrainingSettings, got {type(settings).__name__}"
        raise ConfigurationError(msg)
    if keywords:
        msg = (
            f"{where}: {', '.join(sorted(keywords))} given both as a keyword and in settings=: pass each "
            "setting one way (e.g. settings=attrs.evolve(settings, ...))"
        )
        raise ConfigurationError(msg)
    fields = attrs.fields_dict(TrainingSettings)
    given = {name: value for name, value in lamp.items() if _differ(value, parameters[name])}
    both = sorted(
        name
        for name, value in given.items()
        if _differ(getattr(settings, name), _field_default(fields[name]))
        and _differ(getattr(settings, name), value)
    )
    if both:
        shown = "; ".join(
            f"{name}={given[name]!r} and settings.{name}={getattr(settings, name)!r}" for name in both
        )
        msg = f"{where}: {shown}: given both ways and different; pass each setting one way"
        raise ConfigurationError(msg)
    return attrs.evolve(settings, **given) if given else settings


def _differ(a: object, b: object) -> bool:
    """Whether two setting values differ; values that cannot say (arrays...) differ unless identical."""
    if a is b:
        return False
    try:
        return bool(a != b)
    except Exception:  # an array's != is no bool: such values are compared by identity
        return True


def _field_default(field: attrs.Attribute[Any]) -> Any:
    default: Any = field.default
    return default.factory() if isinstance(default, attrs.Factory) else default  # type: ignore[arg-type]
