"""One batch's forward and the seed of its backward, as a training or validation pass runs them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lamploop.loop.batch_checks import loss_of
from lamploop.loop.precision import Precision, autocast
from lamploop.model import SupervisedModel

__all__ = ["BackwardSeeds", "Forward", "device_of"]


class Forward:
    """The model's loss and metrics on one batch, under the precision's autocast."""

    def __init__(self, model: SupervisedModel, precision: Precision, device: torch.device) -> None:
        self.model, self.precision, self.device = model, precision, device

    def __call__(
        self, batch: Any, epoch: int | None, index: int, rank: int, stream: str = ""
    ) -> tuple[torch.Tensor, int, Sequence[tuple[torch.Tensor, int]]]:
        if self.precision == "32":
            return loss_of(self.model, batch, epoch, index, rank, stream)
        with autocast(self.precision, self.device):
            return loss_of(self.model, batch, epoch, index, rank, stream)


def device_of(module: torch.nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


class BackwardSeeds:
    """``1 / expected`` as a 0-dim tensor like the loss, made once per distinct value."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, expected: int, like: torch.Tensor) -> torch.Tensor:
        key = (expected, like.dtype, like.device)
        scale = self._cache.get(key)
        if scale is None:
            scale = torch.ones((), dtype=like.dtype, device=like.device).div(expected)
            self._cache[key] = scale
        return scale
