"""``SupervisedModel``: a module and a loss that yields (loss sum, example count).

Losses are sums, not means, so that batches of different sizes, accumulated
batches and ranks combine exactly: the mean over a step is the sum of every
loss divided by the number of examples.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
import torch
import torch.nn.functional as F

from lamploop.errors import ConfigurationError
from lamploop.metrics import Metric

__all__ = [
    "LossFunction",
    "SupervisedModel",
    "check_model",
    "cross_entropy_loss",
    "mse_loss",
    "summed",
    "unwrapped",
]


class LossFunction(Protocol):
    """``(output, target) -> (sum of per-example losses, number of examples)``."""

    def __call__(self, output: Any, target: torch.Tensor, /) -> tuple[torch.Tensor, int]: ...


# Losses of one value per element: output and target must have one shape, or torch
# broadcasts them (an (N, 1) output against an (N,) target gives an (N, N) loss).
_ELEMENTWISE: frozenset[Callable[..., torch.Tensor]] = frozenset(
    {
        F.mse_loss,
        F.l1_loss,
        F.smooth_l1_loss,
        F.huber_loss,
        F.binary_cross_entropy,
        F.binary_cross_entropy_with_logits,
        F.soft_margin_loss,
    }
)

_CLASS_SCORES: frozenset[Callable[..., torch.Tensor]] = frozenset({F.cross_entropy, F.nll_loss})
"""Losses of class scores, whose output and target differ in shape but not in batch size."""


@attrs.frozen
class _Summed:
    loss: Callable[..., torch.Tensor]

    def __call__(self, output: Any, target: torch.Tensor, /) -> tuple[torch.Tensor, int]:
        if self.loss in _ELEMENTWISE and isinstance(output, torch.Tensor) and output.shape != target.shape:
            raise _shapes_differ(self.loss, output, target)
        if (
            self.loss in _CLASS_SCORES
            and isinstance(output, torch.Tensor)
            and output.dim() >= 1
            and target.dim() >= 1
            and output.shape[0] != target.shape[0]
        ):
            raise _shapes_differ(self.loss, output, target)  # scores and targets of other batch sizes
        return self.loss(output, target, reduction="sum"), int(target.shape[0])


def summed(loss: Callable[..., torch.Tensor]) -> LossFunction:
    """Make a :class:`LossFunction` from a PyTorch loss that takes ``reduction="sum"``.

    The example count is the target's first dimension.

    >>> import torch, torch.nn.functional as F
    >>> loss_sum, n = summed(F.l1_loss)(torch.zeros(3), torch.ones(3))
    >>> float(loss_sum), n
    (3.0, 3)

    Raises:
        ConfigurationError: ``loss`` is not callable.
    """
    if not callable(loss):
        what = type(loss).__name__
        msg = f"summed(loss): loss must be a PyTorch loss function (e.g. F.l1_loss), got {what}"
        raise ConfigurationError(msg)
    return _Summed(loss)


cross_entropy_loss: LossFunction = summed(F.cross_entropy)
"""Summed cross entropy over class logits; one example per target row."""

mse_loss: LossFunction = summed(F.mse_loss)
"""Summed squared error; an example's loss is the sum over its output elements."""


def _check_module(_: object, __: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, torch.nn.Module):
        msg = f"SupervisedModel: module must be a torch.nn.Module, got {type(value).__name__}"
        raise ConfigurationError(msg)


def _check_loss(_: object, __: attrs.Attribute[Any], value: object) -> None:
    if not callable(value):
        msg = (
            f"SupervisedModel: loss must be a function (output, target) -> (loss sum, example count), "
            f"got {type(value).__name__}; e.g. lamploop.summed(F.mse_loss)"
        )
        raise ConfigurationError(msg)


def _metrics(value: object) -> dict[str, Metric]:
    """``metrics`` as a dict of callables, else a ConfigurationError naming the bad entry."""
    if not isinstance(value, Mapping):
        msg = (
            f"SupervisedModel: metrics must be a mapping of names to metrics "
            f"(e.g. {{'accuracy': lamploop.metrics.accuracy}}), got {type(value).__name__}"
        )
        raise ConfigurationError(msg)
    for name, metric in value.items():
        if not isinstance(name, str) or not callable(metric):
            msg = (
                f"SupervisedModel: metrics[{name!r}] must be a function (output, target) -> (sum, count) "
                f"under a str name, got {type(metric).__name__}"
            )
            raise ConfigurationError(msg)
        if not name.strip() or name == "loss":
            why = "is empty" if not name.strip() else "is the loss's own name (the loss columns')"
            msg = f"SupervisedModel: the metric name {name!r} {why}; name it, e.g. 'accuracy'"
            raise ConfigurationError(msg)
    return dict(value)


@attrs.frozen
class SupervisedModel:
    """A module trained to map features to targets.

    Attributes:
        module: the ``torch.nn.Module``; ``module(features)`` gives the output.
        loss: maps ``(output, target)`` to ``(loss sum, example count)``.
        metrics: named :class:`~lamploop.metrics.Metric` s, computed on the same output in
            training and validation passes (e.g. ``{"accuracy": lamploop.metrics.accuracy}``).

    Raises:
        ConfigurationError: ``module`` is not a ``torch.nn.Module``, ``loss`` is not callable,
            or ``metrics`` is not a mapping of str names to callables.
    """

    module: torch.nn.Module = attrs.field(validator=_check_module)
    loss: LossFunction = attrs.field(default=cross_entropy_loss, validator=_check_loss)
    metrics: Mapping[str, Metric] = attrs.field(factory=dict, converter=_metrics, hash=False)

    def loss_sum_and_count(self, features: Any, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Run the module and the loss on one batch.

        Raises:
            ConfigurationError: the loss did not return ``(loss sum, example count)``: a
                0-dim tensor and a number.
        """
        return self._loss_of(self.module(features), target)

    def loss_and_metrics(
        self, features: Any, target: torch.Tensor
    ) -> tuple[torch.Tensor, int, list[tuple[torch.Tensor, int]]]:
        """:meth:`loss_sum_and_count`, and every metric's ``(sum, count)`` on the same output."""
        output = self.module(features)
        loss_sum, count = self._loss_of(output, target)
        with torch.no_grad():
            values = [metric(output, target) for metric in self.metrics.values()]
        for name, value in zip(self.metrics, values, strict=True):
            if not isinstance(value, (tuple, list)) or len(value) != 2:
                raise _not_a_metric_sum(name, value)
            total = value[0]
            if isinstance(total, torch.Tensor) and total.numel() != 1:  # per-example values, not their sum
                raise _not_a_metric_sum(name, value, f"a sum of shape {tuple(total.shape)}")
        return loss_sum, count, values

    def _loss_of(self, output: Any, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        result = self.loss(output, target)
        if type(result) is not tuple or len(result) != 2:
            raise _not_a_sum_and_count(self.loss, result)
        loss_sum, count = result
        # Checked here, not where they fail: a (1,)-shaped sum fails in backward, a str count
        # in the sum of counts, each with a message that names neither the loss nor the batch.
        if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0:
            raise _not_a_sum_and_count(self.loss, result, f"a loss sum that is {_described(loss_sum)}")
        if isinstance(count, bool) or not isinstance(count, numbers.Real | torch.Tensor):
            raise _not_a_sum_and_count(self.loss, result, f"an example count that is {_described(count)}")
        if isinstance(count, numbers.Real) and not 0 <= count < math.inf:
            # A negative count flips the step's gradient (the sum is divided by the counts' total);
            # a tensor's is not looked at (that would wait for the device at every batch).
            what = f"an example count of {count} (not >= 0 and finite)"
            raise _not_a_sum_and_count(self.loss, result, what)
        return result


def check_model(where: str, model: Any, *, trainable: bool = True) -> None:
    """``model`` must be a :class:`~lamploop.SupervisedModel`, or an object with its ``module``
    (a ``torch.nn.Module``) and its ``loss_sum_and_count`` method.

    With ``trainable`` (for a driver, which makes an optimizer) its module must have parameters.
    """
    if isinstance(model, torch.nn.Module):
        msg = (
            f"{where}: model is a torch.nn.Module ({type(model).__name__}); wrap it with its loss: "
            "lamploop.SupervisedModel(module) (cross-entropy) or lamploop.SupervisedModel(module, loss=...)"
        )
        raise ConfigurationError(msg)
    if not isinstance(getattr(model, "module", None), torch.nn.Module) or not callable(
        getattr(model, "loss_sum_and_count", None)
    ):
        msg = f"{where}: model must be a lamploop.SupervisedModel, got {type(model).__name__}"
        raise ConfigurationError(msg)
    if trainable and next(model.module.parameters(), None) is None:
        # Else torch's optimizer fails with "optimizer got an empty parameter list".
        msg = f"{where}: the model's module ({type(model.module).__name__}) has no parameters to train"
        raise ConfigurationError(msg)


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The module a ``torch.compile`` wrapper holds, else ``module`` itself.

    Its ``state_dict()`` has the plain keys (``fc.weight``, not ``_orig_mod.fc.weight``), so
    checkpoints of a compiled model load into the uncompiled one and back; the parameters are
    the same objects.
    """
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else module


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _not_a_metric_sum(name: str, value: object, what: str | None = None) -> ConfigurationError:
    return ConfigurationError(
        f"SupervisedModel: the metric {name!r} returned {what or _described(value)}, not (sum, count); "
        "return the sum over the batch's examples and their number, as lamploop.metrics.accuracy "
        "does (a mean cannot be combined over batches and ranks of different sizes)"
    )


def _shapes_differ(
    loss: Callable[..., torch.Tensor], output: torch.Tensor, target: torch.Tensor
) -> ConfigurationError:
    name = getattr(loss, "__name__", type(loss).__name__)
    out, want = tuple(output.shape), tuple(target.shape)
    hint = ""
    if out[-1:] == (1,) and out[:-1] == want:
        hint = f"; squeeze the output (module(x).squeeze(-1)) or give targets of shape {out}"
    elif want[-1:] == (1,) and want[:-1] == out:
        hint = f"; give targets of shape {out} (target.squeeze(-1)) or an output of shape {want}"
    return ConfigurationError(
        f"SupervisedModel: the loss {name} got an output of shape {out} and a target of shape {want}: "
        f"torch would broadcast them and train on the wrong loss{hint}"
    )


def _not_a_sum_and_count(loss: object, result: object, got: str | None = None) -> ConfigurationError:
    got = got or _described(result)
    name = getattr(loss, "__name__", type(loss).__name__)
    return ConfigurationError(
        f"SupervisedModel: the loss {name} returned {got}, not (loss sum, example count); "
        "sum over the examples instead of averaging, e.g. lamploop.summed(F.mse_loss), which "
        "passes reduction='sum' and counts the target's rows"
    )
