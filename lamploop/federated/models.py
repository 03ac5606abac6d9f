"""Turning a plan into things that train: the model (from a local registry), the optimizer, the loss.

No code travels with a plan.  A node builds the model with a builder it holds itself,
looked up by the plan's architecture name; ``"mlp"`` is built in, and node operators add
their own (:data:`ModelBuilders`).  The model built must have exactly the tensors the plan
describes, or the node refuses the round.

.. versionadded:: 0.3
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import torch

from lamploop.checks import check_seed
from lamploop.errors import ConfigurationError, LamploopError
from lamploop.federated.plan import ModelDescription, OptimizerConfig, TrainingPlan
from lamploop.metrics import accuracy
from lamploop.model import SupervisedModel, cross_entropy_loss, mse_loss
from lamploop.modelspec import describe_mismatch, model_spec

__all__ = [
    "BUILT_IN_BUILDERS",
    "ModelBuilder",
    "ModelBuilders",
    "build_model",
    "build_optimizer",
    "build_supervised_model",
    "mlp",
]

ModelBuilder: TypeAlias = Callable[[Mapping[str, Any]], torch.nn.Module]
"""Builds a module from a plan's model options; refuses options it cannot build with a
``ValueError``, ``TypeError`` or ``KeyError`` (:func:`build_model` names them in a
``ConfigurationError``) or a ``ConfigurationError`` of its own."""

ModelBuilders: TypeAlias = Mapping[str, ModelBuilder]
"""Architecture name -> builder."""

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def mlp(options: Mapping[str, Any]) -> torch.nn.Module:
    """A multilayer perceptron: ``options["sizes"]`` = [inputs, hidden..., outputs], ReLU between.

    ``options["dtype"]`` (``"float32"`` by default, or ``"float64"``) and ``options["seed"]``
    (the initial weights' seed, 0 by default) are optional.

    Raises:
        ConfigurationError: sizes are not at least two positive ints, or the dtype is unknown.
    """
    if not isinstance(options, Mapping):
        msg = f"mlp: options must be a mapping (sizes, dtype, seed), got {type(options).__name__}"
        raise ConfigurationError(msg)
    sizes = options.get("sizes")
    if (
        not isinstance(sizes, list)
        or len(sizes) < 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)
    ):
        msg = f"mlp: options.sizes must be a list of at least two positive ints, got {sizes!r}"
        raise ConfigurationError(msg)
    dtype_name = options.get("dtype", "float32")
    if dtype_name not in _DTYPES:
        msg = f"mlp: options.dtype must be one of {', '.join(_DTYPES)}, got {dtype_name!r}"
        raise ConfigurationError(msg)
    seed = check_seed("mlp: options.seed", options.get("seed", 0))
    layers: list[torch.nn.Module] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
            if i:
                layers.append(torch.nn.ReLU())
            layers.append(torch.nn.Linear(n_in, n_out))
    return torch.nn.Sequential(*layers).to(_DTYPES[dtype_name])


BUILT_IN_BUILDERS: ModelBuilders = {"mlp": mlp}
"""The architectures every node knows."""


def build_model(description: ModelDescription, builders: ModelBuilders | None = None) -> torch.nn.Module:
    """Build the described model and check that its tensors are the plan's.

    Args:
        description: the plan's model.
        builders: the node's registry (default :data:`BUILT_IN_BUILDERS`).

    Raises:
        ConfigurationError: the architecture is unknown here, its builder refused the options,
            or the model built differs from the plan's tensors (named).
    """
    if not isinstance(description, ModelDescription):
        msg = f"build_model: description must be a plan's ModelDescription, got {type(description).__name__}"
        raise ConfigurationError(msg)
    registry = BUILT_IN_BUILDERS if builders is None else builders
    builder = registry.get(description.architecture)
    if builder is None:
        known = ", ".join(sorted(registry))
        msg = f"architecture {description.architecture!r} is not known here (known: {known})"
        raise ConfigurationError(msg)
    try:
        module = builder(description.options)
    except LamploopError:
        raise
    except (ValueError, TypeError, KeyError) as exc:  # how a builder says the options are not its
        msg = (
            f"the builder of {description.architecture!r} refused the plan's options "
            f"{dict(description.options)!r:.200}: {type(exc).__name__}: {exc}"
        )
        raise ConfigurationError(msg) from exc
    if not isinstance(module, torch.nn.Module):
        got = type(module).__name__
        msg = f"the builder of {description.architecture!r} returned {got}, not a torch.nn.Module"
        raise ConfigurationError(msg)
    mismatch = describe_mismatch(
        description.tensors, model_spec(module), expected_label="the plan's", actual_label="the built model's"
    )
    if mismatch is not None:
        msg = f"the model built from the plan does not match it: {mismatch}"
        raise ConfigurationError(msg)
    return module


def build_supervised_model(
    plan: TrainingPlan, module: torch.nn.Module, *, metrics: bool = True
) -> SupervisedModel:
    """``module`` with the plan's summed loss and metrics (none with ``metrics=False``).

    A node trains without metrics (its reply carries the training loss only; the metrics
    come from validation), which spares computing them on every training batch.
    """
    # Any: mypy cannot see through the field's dict converter.
    named: Any = {name: accuracy for name in plan.metrics if name == "accuracy"} if metrics else {}
    loss = cross_entropy_loss if plan.loss == "cross_entropy" else mse_loss
    return SupervisedModel(module=module, loss=loss, metrics=named)


def build_optimizer(config: OptimizerConfig, module: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer the plan names, over ``module``'s parameters."""
    params = list(module.parameters())
    if config.name == "sgd":
        return torch.optim.SGD(
            params, lr=config.learning_rate, momentum=config.momentum, weight_decay=config.weight_decay
        )
    if config.name == "adam":
        return torch.optim.Adam(
            params,
            lr=config.learning_rate,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    return torch.optim.AdamW(
        params, lr=config.learning_rate, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
    )
