"""``PipelineSpec``: where a sequential model is cut into stages, and how each batch is fed through them."""

from __future__ import annotations

from typing import Final, Literal, TypeAlias

import attrs
import torch

from lamploop.errors import ConfigurationError

__all__ = ["SCHEDULES", "PipelineSpec", "ScheduleName"]

ScheduleName: TypeAlias = Literal["gpipe", "1f1b"]
SCHEDULES: Final = ("gpipe", "1f1b")
"""``"gpipe"``: every micro-batch forward, then every micro-batch backward
(``torch.distributed.pipelining.ScheduleGPipe``); ``"1f1b"``: one forward, one backward in
the steady state, fewer activations held (``Schedule1F1B``; needs ``n_microbatches >= stages``)."""


def _boundaries(value: object) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        msg = f"PipelineSpec: boundaries must be a sequence of layer indices, got {value!r}"
        raise ConfigurationError(msg)
    items = tuple(value)
    for item in items:
        if not isinstance(item, int) or isinstance(item, bool):
            msg = f"PipelineSpec: boundaries must be ints (layer indices), got {item!r} in {items!r}"
            raise ConfigurationError(msg)
    return items


@attrs.frozen
class PipelineSpec:
    """How a ``torch.nn.Sequential`` is split into pipeline stages and fed.

    Attributes:
        boundaries: the index of the first layer of every stage but the first, strictly
            increasing: ``(2,)`` cuts ``Sequential(a, b, c, d)`` into ``(a, b)`` and ``(c, d)``.
            ``len(boundaries) + 1`` stages, one per rank.
        n_microbatches: each batch is cut into this many equal micro-batches, which flow
            through the stages one after the other; the batch size must be a multiple of it.
        schedule: ``"gpipe"`` or ``"1f1b"`` (see :data:`SCHEDULES`).

    Raises:
        ConfigurationError: a boundary is not an int, they are not strictly increasing or
            not >= 1, ``n_microbatches`` is not an int >= 1, an unknown schedule, or
            ``"1f1b"`` with fewer micro-batches than stages.
    """

    boundaries: tuple[int, ...] = attrs.field(converter=_boundaries)
    n_microbatches: int = 1
    schedule: ScheduleName = "gpipe"

    def __attrs_post_init__(self) -> None:
        if any(b < 1 for b in self.boundaries):
            msg = f"PipelineSpec: boundaries must be >= 1 (stage 0 starts at layer 0), got {self.boundaries}"
            raise ConfigurationError(msg)
        if any(a >= b for a, b in zip(self.boundaries, self.boundaries[1:], strict=False)):
            msg = f"PipelineSpec: boundaries must strictly increase (no empty stage), got {self.boundaries}"
            raise ConfigurationError(msg)
        n = self.n_microbatches
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            msg = f"PipelineSpec: n_microbatches must be an int >= 1, got {n!r}"
            raise ConfigurationError(msg)
        if self.schedule not in SCHEDULES:
            msg = f"PipelineSpec: schedule must be one of {SCHEDULES}, got {self.schedule!r}"
            raise ConfigurationError(msg)
        if self.schedule == "1f1b" and n < self.num_stages:
            msg = (
                f"PipelineSpec: the 1f1b schedule needs n_microbatches >= the number of stages "
                f"({self.num_stages}), got {n}; use more micro-batches or schedule='gpipe'"
            )
            raise ConfigurationError(msg)

    @property
    def num_stages(self) -> int:
        """How many stages (and ranks) the model is split into."""
        return len(self.boundaries) + 1

    def layer_ranges(self, model: torch.nn.Module) -> tuple[range, ...]:
        """The layer indices of every stage of ``model``, checked against its length.

        Raises:
            ConfigurationError: ``model`` is not a ``torch.nn.Sequential``, or a boundary is
                not below its number of layers (the last stage would be empty).
        """
        if not isinstance(model, torch.nn.Sequential):
            msg = (
                f"pipeline: the model must be a torch.nn.Sequential (split at layer indices), "
                f"got {type(model).__qualname__}; wrap its parts in one"
            )
            raise ConfigurationError(msg)
        layers = len(model)
        if self.boundaries and self.boundaries[-1] >= layers:
            msg = (
                f"pipeline: boundary {self.boundaries[-1]} is out of range for a Sequential of "
                f"{layers} layers (boundaries must be in 1..{layers - 1})"
            )
            raise ConfigurationError(msg)
        starts = (0, *self.boundaries)
        ends = (*self.boundaries, layers)
        return tuple(range(a, b) for a, b in zip(starts, ends, strict=True))
