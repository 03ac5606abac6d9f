"""The training plan: what every node trains in a round, as plain data, and its canonical hash.

A plan says which model (an architecture the node builds from its own registry, its options,
and the names, shapes and dtypes of its tensors), which optimizer and loss, how long a node
trains per round (``local_epochs`` or ``local_steps``), whether a node's optimizer state is
kept from one round to the next or reset, and what the aggregator averages.  No code travels:
a node builds the model itself (:mod:`lamploop.federated.models`) and refuses a plan whose
tensors do not match what it built.

The plan's hash is the sha256 of its canonical JSON (cattrs, sorted keys, no whitespace): two
plans that would train differently have different hashes, and a node operator approves a
hash (:mod:`lamploop.federated.approval`).

>>> plan = TrainingPlan(
...     name="demo",
...     model=ModelDescription("mlp", {"sizes": [4, 3]}, model_spec({"0.weight": torch.zeros(3, 4)})),
...     optimizer=OptimizerConfig("sgd", learning_rate=0.1),
... )
>>> len(plan_hash(plan))
64
>>> plan_from_json(plan_to_json(plan)) == plan
True

.. versionadded:: 0.3
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import attrs
import cattrs
import torch

from lamploop.checkpoint.files import read_json_object
from lamploop.errors import ConfigurationError
from lamploop.modelspec import ModelSpec, model_spec, register_model_spec_json
from lamploop.strict_json import field_errors, strict_converter, write_atomically

__all__ = [
    "AVERAGE_CHOICES",
    "LOSSES",
    "METRICS",
    "OPTIMIZERS",
    "OPTIMIZER_STATE_CHOICES",
    "ModelDescription",
    "OptimizerConfig",
    "TrainingPlan",
    "canonical_json",
    "describe_model",
    "load_plan",
    "plan_from_json",
    "plan_hash",
    "plan_to_json",
    "save_plan",
]

OPTIMIZERS: Final = ("sgd", "adam", "adamw")
"""The optimizers a plan may name (``torch.optim``'s SGD, Adam and AdamW)."""

LOSSES: Final = ("cross_entropy", "mse")
"""The losses a plan may name (summed, as :func:`lamploop.summed` makes them)."""

METRICS: Final = ("accuracy",)
"""The validation metrics a plan may ask for."""

OPTIMIZER_STATE_CHOICES: Final = ("keep", "reset")
"""``keep``: a node's optimizer state carries over to its next round; ``reset``: a new one each round."""

AVERAGE_CHOICES: Final = ("parameters", "parameters_and_buffers")
"""What the aggregator averages; what is not averaged keeps the global model's value."""


def _one_of(choices: tuple[str, ...]) -> Any:
    def check(_: object, attribute: attrs.Attribute[str], value: str) -> None:
        if value not in choices:
            msg = f"{attribute.name} must be one of {', '.join(choices)}; got {value!r}"
            raise ConfigurationError(msg)

    return check


def _instance_of(kind: type) -> Any:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, kind):
            msg = f"{attribute.name} must be a {kind.__name__}, got {type(value).__name__}"
            raise ConfigurationError(msg)

    return check


def _finite_at_least(low: float) -> Any:
    def check(_: object, attribute: attrs.Attribute[float], value: float) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            msg = f"{attribute.name} must be a finite number, got {value!r}"
            raise ConfigurationError(msg)
        if value < low:
            msg = f"{attribute.name} must be >= {low}, got {value!r}"
            raise ConfigurationError(msg)

    return check


def _json_value(value: object, where: str) -> None:
    """Refuse what canonical JSON cannot hold exactly (objects, NaN, non-str keys)."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            msg = f"{where} must be finite, got {value!r}"
            raise ConfigurationError(msg)
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _json_value(item, f"{where}[{i}]")
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                msg = f"{where} has a key {key!r} that is not a str"
                raise ConfigurationError(msg)
            _json_value(item, f"{where}.{key}")
        return
    msg = f"{where} must be plain JSON (None, bool, int, float, str, list, dict), got {type(value).__name__}"
    raise ConfigurationError(msg)


def _plain(value: Any) -> Any:
    """Tuples as lists and mappings as dicts, so that equal options compare and hash equal."""
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _options(value: Any) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        msg = f"model options must be a mapping of str to JSON values, got {type(value).__name__}"
        raise ConfigurationError(msg)
    _json_value(value, "model options")
    plain: dict[str, Any] = _plain(value)
    return plain


@attrs.frozen
class OptimizerConfig:
    """The optimizer each node makes for its local training.

    Attributes:
        name: ``"sgd"``, ``"adam"`` or ``"adamw"``.
        learning_rate: the learning rate (> 0).
        momentum: SGD's momentum (0 for plain SGD).
        weight_decay: L2 penalty (SGD, Adam) or decoupled decay (AdamW).
        betas: Adam's and AdamW's ``(beta1, beta2)``.
        eps: Adam's and AdamW's epsilon.
    """

    name: str = attrs.field(validator=_one_of(OPTIMIZERS))
    learning_rate: float = attrs.field(validator=_finite_at_least(0.0))
    momentum: float = attrs.field(default=0.0, validator=_finite_at_least(0.0))
    weight_decay: float = attrs.field(default=0.0, validator=_finite_at_least(0.0))
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = attrs.field(default=1e-8, validator=_finite_at_least(0.0))

    def __attrs_post_init__(self) -> None:
        if self.learning_rate <= 0:
            msg = f"learning_rate must be > 0, got {self.learning_rate!r}"
            raise ConfigurationError(msg)
        if (
            not isinstance(self.betas, tuple | list)
            or len(self.betas) != 2
            or not all(isinstance(b, int | float) and 0.0 <= b < 1.0 for b in self.betas)
        ):
            msg = f"betas must be two numbers in [0, 1), got {self.betas!r}"
            raise ConfigurationError(msg)


@attrs.frozen
class ModelDescription:
    """The model a plan trains, described as data.

    Attributes:
        architecture: the name a node's builder registry knows (``"mlp"`` is built in).
        options: the architecture's options, plain JSON (e.g. ``{"sizes": [64, 32, 10]}``).
        tensors: the names, shapes and dtypes of the model's ``state_dict``; a node refuses a
            plan when the model it builds does not match.
    """

    architecture: str
    options: Mapping[str, Any] = attrs.field(converter=_options)
    tensors: ModelSpec

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.architecture, str) or not self.architecture:
            msg = f"architecture must be a non-empty str, got {self.architecture!r}"
            raise ConfigurationError(msg)


def _positive_or_none(_: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        msg = f"{attribute.name} must be None or an int >= 1, got {value!r}"
        raise ConfigurationError(msg)


def _non_negative_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        msg = f"{attribute.name} must be an int >= 0, got {value!r}"
        raise ConfigurationError(msg)


@attrs.frozen(kw_only=True)
class TrainingPlan:
    """Everything a node needs to know to train one round, and nothing about any node's data.

    Exactly one of ``local_epochs`` and ``local_steps`` is set.

    Attributes:
        name: a label for people (it is part of the hash too).
        model: the model (:class:`ModelDescription`).
        optimizer: the optimizer (:class:`OptimizerConfig`).
        loss: ``"cross_entropy"`` or ``"mse"``.
        metrics: validation metrics besides the loss (``"accuracy"``).
        local_epochs: passes over the node's training stream per round.
        local_steps: or optimizer steps per round (the stream's epochs are chained).
        optimizer_state: ``"keep"`` (a node's optimizer state carries over) or ``"reset"``.
        average: ``"parameters"`` or ``"parameters_and_buffers"``.
        seed: seeds each node's RNG per round (dropout...), mixed with the round and node name.
        format_version: the plan format (1).

    Raises:
        ConfigurationError: a field out of range, or not exactly one of local_epochs/local_steps.
    """

    name: str
    model: ModelDescription = attrs.field(validator=_instance_of(ModelDescription))
    optimizer: OptimizerConfig = attrs.field(validator=_instance_of(OptimizerConfig))
    loss: str = attrs.field(default="cross_entropy", validator=_one_of(LOSSES))
    metrics: tuple[str, ...] = attrs.field(default=("accuracy",), converter=tuple)
    local_epochs: int | None = attrs.field(default=1, validator=_positive_or_none)
    local_steps: int | None = attrs.field(default=None, validator=_positive_or_none)
    optimizer_state: str = attrs.field(default="reset", validator=_one_of(OPTIMIZER_STATE_CHOICES))
    average: str = attrs.field(default="parameters", validator=_one_of(AVERAGE_CHOICES))
    seed: int = attrs.field(default=0, validator=_non_negative_int)
    format_version: int = 1

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            msg = f"a plan's name is a non-empty str (a label for people), got {self.name!r:.60}"
            raise ConfigurationError(msg)
        if (self.local_epochs is None) == (self.local_steps is None):
            msg = (
                "a plan sets exactly one of local_epochs and local_steps, got "
                f"local_epochs={self.local_epochs!r}, local_steps={self.local_steps!r}"
            )
            raise ConfigurationError(msg)
        for metric in self.metrics:
            if metric not in METRICS:
                msg = f"metrics may name {', '.join(METRICS)}; got {metric!r}"
                raise ConfigurationError(msg)
        if self.format_version != 1:
            msg = f"this lamploop reads plan format_version 1, got {self.format_version!r}"
            raise ConfigurationError(msg)


def _structure_options(value: Any, _type: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        msg = f"expected an object, got {type(value).__name__}"
        raise TypeError(msg)
    return value


def _makestrict_converter() -> cattrs.Converter:
    converter = strict_converter()
    register_model_spec_json(converter)
    converter.register_structure_hook_func(lambda t: t == Mapping[str, Any], _structure_options)
    return converter


PLAN_CONVERTER: Final = _makestrict_converter()


def plan_to_json(plan: TrainingPlan) -> dict[str, Any]:
    """The plan as a JSON object (what travels to the nodes and what is hashed)."""
    obj: dict[str, Any] = _plain(PLAN_CONVERTER.unstructure(plan))  # tuples as JSON lists
    return obj


def plan_from_json(obj: object, *, where: str = "plan") -> TrainingPlan:
    """The plan in a JSON object, checked strictly (no unknown keys, no strings for numbers).

    Raises:
        ConfigurationError: naming ``where`` and the field at fault.
    """
    if not isinstance(obj, dict):
        msg = f"{where}: expected a JSON object, got {type(obj).__name__}"
        raise ConfigurationError(msg)
    try:
        return PLAN_CONVERTER.structure(obj, TrainingPlan)
    except ConfigurationError as exc:
        msg = f"{where}: {exc}"
        raise ConfigurationError(msg) from exc
    except (cattrs.BaseValidationError, TypeError, ValueError, KeyError) as exc:
        details = field_errors(exc) if isinstance(exc, cattrs.BaseValidationError) else [str(exc)]
        msg = f"{where}: {'; '.join(details)}"
        raise ConfigurationError(msg) from exc


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, no NaN: the one byte string a JSON value hashes as."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def plan_hash(plan: TrainingPlan) -> str:
    """The sha256 hex digest of the plan's canonical JSON: what a node operator approves."""
    return hashlib.sha256(canonical_json(plan_to_json(plan))).hexdigest()


def save_plan(plan: TrainingPlan, path: str | os.PathLike[str]) -> Path:
    """Write the plan as JSON to ``path`` (atomically); returns the path."""
    if not isinstance(plan, TrainingPlan):
        msg = f"save_plan: plan must be a TrainingPlan, got {type(plan).__name__}"
        raise ConfigurationError(msg)
    target = Path(path)
    text = json.dumps(plan_to_json(plan), sort_keys=True, indent=2) + "\n"
    write_atomically(target, text.encode())
    return target


def load_plan(path: str | os.PathLike[str]) -> TrainingPlan:
    """The plan in a JSON file.

    Raises:
        ConfigurationError: the file is missing, not JSON, or not a valid plan (the message
            starts with the path).
    """
    target = Path(path)
    return plan_from_json(read_json_object(target, ConfigurationError), where=str(target))


def describe_model(
    architecture: str, options: Mapping[str, Any], module: torch.nn.Module
) -> ModelDescription:
    """A :class:`ModelDescription` of ``module`` built as ``architecture`` with ``options``."""
    return ModelDescription(architecture, options, model_spec(module))
