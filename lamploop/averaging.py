"""Weight averaging: an exponential moving average (EMA) after every step, or lamp's SWA per epoch.

``averaging=ema(decay)`` keeps ``avg = decay * avg + (1 - decay) * params`` after every
optimizer step; ``averaging=swa(start_epoch)`` keeps the equal-weight mean of the parameters
at the end of every epoch from ``start_epoch`` on (lamp's ``withSWA``: pair it with a
learning-rate schedule that warms up and then cycles, e.g. ``lamploop.cyclic``), and at the
end of training refreshes the BatchNorm statistics of the averaged model with a pass over the
training data.  Both follow ``torch.optim.swa_utils.AveragedModel``: the first update copies
the parameters, buffers are the live model's.  The average lives on the root, is written to
checkpoints (so a resumed run goes on averaging exactly), and at the end of the run the model
holds it (instead of the best validation epoch's).

>>> ema(0.9)
EMA(decay=0.9)
>>> swa(start_epoch=3)
SWA(start_epoch=3, refresh_batchnorm=True)
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Mapping
from typing import Any, TypeAlias

import attrs
import torch

from lamploop.checks import check_bool, check_int, int_at_least
from lamploop.errors import ConfigurationError
from lamploop.model import unwrapped

__all__ = [
    "EMA",
    "SWA",
    "Averaging",
    "WeightAverage",
    "check_averaging_starts",
    "ema",
    "install_average",
    "swa",
]


def _check_decay(where: str, decay: object) -> float:
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
        msg = f"{where}: decay must be a number in (0, 1), got {decay!r}"
        raise ConfigurationError(msg)
    return float(decay)


def _valid_decay(_: object, __: attrs.Attribute[float], value: object) -> None:
    _check_decay("EMA", value)


def _valid_refresh(_: object, attribute: attrs.Attribute[bool], value: object) -> None:
    check_bool(f"SWA: {attribute.name}", value)


@attrs.frozen
class EMA:
    """Exponential moving average after every optimizer step (``decay`` in ``(0, 1)``, checked)."""

    decay: float = attrs.field(validator=_valid_decay)


@attrs.frozen
class SWA:
    """Equal-weight average at the end of every epoch from ``start_epoch`` on (an int >= 0, checked)."""

    start_epoch: int = attrs.field(validator=int_at_least("SWA", 0))
    refresh_batchnorm: bool = attrs.field(default=True, validator=_valid_refresh)


Averaging: TypeAlias = EMA | SWA


def ema(decay: float) -> EMA:
    """An exponential moving average with ``decay`` in ``(0, 1)``.

    Raises:
        ConfigurationError: ``decay`` outside ``(0, 1)``.
    """
    return EMA(_check_decay("ema", decay))


def swa(start_epoch: int, *, refresh_batchnorm: bool = True) -> SWA:
    """Stochastic weight averaging from epoch ``start_epoch`` on.

    Raises:
        ConfigurationError: ``start_epoch`` is not an int >= 0, or ``refresh_batchnorm`` not a bool.
    """
    return SWA(check_int("swa: start_epoch", start_epoch, 0), refresh_batchnorm)


class WeightAverage:
    """The running average of one model's parameters (on the root), and how many updates it has had."""

    def __init__(self, averaging: Averaging, module: torch.nn.Module) -> None:
        self.averaging, self.module = averaging, unwrapped(module)
        self.count = 0
        self.parameters: dict[str, torch.Tensor] = {}

    def load(self, state: Mapping[str, torch.Tensor], count: int) -> None:
        """Go on from a checkpoint's average (its :meth:`state_dict`)."""
        names = dict(self.module.named_parameters())
        self.parameters = {
            name: t.detach().clone().to(names[name].device) for name, t in state.items() if name in names
        }
        self.count = count

    @torch.no_grad()
    def update(self) -> None:
        """Fold the module's current parameters in."""
        live = dict(self.module.named_parameters())
        if self.count == 0:
            self.parameters = {name: p.detach().clone() for name, p in live.items()}
        elif isinstance(self.averaging, EMA):
            decay = self.averaging.decay
            for name, p in live.items():
                self.parameters[name].mul_(decay).add_(p.detach(), alpha=1.0 - decay)
        else:
            for name, p in live.items():
                avg = self.parameters[name]
                avg.add_((p.detach() - avg) / (self.count + 1))
        self.count += 1

    def after_step(self) -> None:
        if isinstance(self.averaging, EMA):
            self.update()

    def after_epoch(self, epoch: int) -> None:
        if isinstance(self.averaging, SWA) and epoch >= self.averaging.start_epoch:
            self.update()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averaged model as a ``state_dict``: averaged parameters, the live buffers."""
        state = {name: t.detach().clone() for name, t in self.module.state_dict().items()}
        state.update({name: t.clone() for name, t in self.parameters.items()})
        return state


def check_averaging_starts(where: str, averaging: Averaging | None, max_epochs: int) -> None:
    """Refuse an SWA that would never average: ``start_epoch`` at or after the last epoch.

    Raises:
        ConfigurationError: ``averaging`` is ``swa(start_epoch)`` with ``start_epoch >=
            max_epochs`` (the epochs are ``0 .. max_epochs - 1``).
    """
    if isinstance(averaging, SWA) and averaging.start_epoch >= max_epochs:
        msg = (
            f"{where}: swa(start_epoch={averaging.start_epoch}) never averages with max_epochs={max_epochs} "
            f"(epochs 0 to {max_epochs - 1}): start it at an epoch before {max_epochs}"
        )
        raise ConfigurationError(msg)


async def install_average(
    average: WeightAverage, batches: AsyncIterable[Any] | None, device: torch.device | None
) -> None:
    """Load the average into its module; for SWA, refresh the BatchNorm statistics with ``batches``.

    The refresh is ``torch.optim.swa_utils.update_bn``'s: the statistics are reset and
    recomputed as a plain mean over one pass of the training data in training mode.
    """
    module = average.module
    module.load_state_dict(average.state_dict())
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    refresh = isinstance(average.averaging, SWA) and average.averaging.refresh_batchnorm
    if not (refresh and norms and batches is not None):
        return
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative mean over the pass
    was_training = module.training
    module.train()
    with torch.no_grad():
        async for features, _ in batches:
            module(
                features.to(device) if device is not None and isinstance(features, torch.Tensor) else features
            )
    for m, momentum in zip(norms, momenta, strict=True):
        m.momentum = momentum
    module.train(was_training)
