"""The optimizer a run makes from the user's factory, checked before the first step.

A factory that forgot its ``return`` would otherwise train nothing, silently (a ``None``
optimizer steps nothing); one that returns the parameters fails deep inside with an
``AttributeError``; one that takes no argument with a raw ``TypeError``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lamploop.errors import ConfigurationError

__all__ = ["check_takes_parameters", "make_optimizer"]

_EXAMPLE = "e.g. optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1)"


def check_takes_parameters(factory: Callable[..., Any], *, where: str) -> None:
    """ConfigurationError unless ``factory`` can be called with the parameters as its one argument."""
    try:
        inspect.signature(factory).bind(object())
    except TypeError:
        msg = f"{where}: optimizer_factory must take the parameters as its one argument ({_EXAMPLE})"
        raise ConfigurationError(msg) from None
    except ValueError:  # no signature to read (some builtins): the call will say
        return


def make_optimizer(
    factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
    parameters: Iterable[torch.nn.Parameter],
    *,
    where: str,
) -> torch.optim.Optimizer:
    """``factory(parameters)``, checked to be a ``torch.optim.Optimizer``.

    Raises:
        ConfigurationError: the factory does not take the parameters as its one argument, or
            returned something else than an optimizer (``None``: a forgotten ``return``); the
            message names ``where`` and says what to pass.
    """
    check_takes_parameters(factory, where=where)
    given = list(parameters)
    optimizer = factory(given)
    if isinstance(optimizer, torch.optim.Optimizer):
        _check_steps_these(optimizer, given, where)
        return optimizer
    if optimizer is None:
        problem = "returned None (a forgotten return?)"
    else:
        problem = f"returned a {type(optimizer).__name__}, not a torch.optim.Optimizer"
    msg = f"{where}: optimizer_factory {problem}; return the optimizer it makes ({_EXAMPLE})"
    raise ConfigurationError(msg)


def _check_steps_these(optimizer: torch.optim.Optimizer, given: list[Any], where: str) -> None:
    """The optimizer holds some of the parameters it was given: one made over another model's
    (a factory that ignores its argument) would train nothing, silently."""
    ids = {id(p) for p in given if isinstance(p, torch.Tensor)}
    if not ids:
        return
    if any(id(p) in ids for group in optimizer.param_groups for p in group["params"]):
        return
    msg = (
        f"{where}: optimizer_factory returned an optimizer over none of the parameters it was given "
        f"(does it ignore its argument?); make it from them ({_EXAMPLE})"
    )
    raise ConfigurationError(msg)
