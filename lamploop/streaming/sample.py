"""``Sample``: one item a producer streams to a trainer, and the ``SampleSink`` that takes it.

A sample is named by its producer and a sequence number that the producer counts from 0,
so a receiver can acknowledge "everything up to n" and a producer that reconnects resends
exactly what was not acknowledged (see :mod:`lamploop.streaming`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import attrs
import torch

from lamploop.errors import ConfigurationError
from lamploop.streaming.sample_rows import SampleRow

__all__ = ["Sample", "SampleSink"]


def _tensors(value: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    # A received sample's row of its run's columns is read-only already: kept, not copied.
    if type(value) is SampleRow:
        return value
    if not isinstance(value, Mapping):
        msg = f"Sample: tensors must be a mapping of names to tensors, got {type(value).__name__}"
        raise ConfigurationError(msg)
    return dict(value)


@attrs.frozen
class Sample:
    """One streamed sample.

    Attributes:
        producer: the producer's name (unique among a run's producers).
        seq: its sequence number at that producer, from 0, without gaps.
        tensors: the sample's named tensors (e.g. ``{"x": ..., "y": ...}``).
    """

    producer: str
    seq: int
    tensors: Mapping[str, torch.Tensor] = attrs.field(converter=_tensors, hash=False, eq=False)

    def __attrs_post_init__(self) -> None:
        # A received sample (its tensors a row of a decoded frame) was checked on the wire: the
        # receiver makes one per sample, so it pays one type check here and nothing more.
        if type(self.tensors) is SampleRow:
            return
        if not isinstance(self.producer, str) or not self.producer:
            msg = f"Sample: producer must be a non-empty str, got {self.producer!r}"
            raise ConfigurationError(msg)
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 0:
            msg = f"Sample: seq must be an int >= 0, got {self.seq!r}"
            raise ConfigurationError(msg)
        if not self.tensors:
            msg = f"Sample {self.producer!r} {self.seq}: a sample has at least one tensor, got none"
            raise ConfigurationError(msg)
        for name, tensor in self.tensors.items():
            if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
                msg = (
                    f"Sample {self.producer!r} {self.seq}: tensors must map names (str) to "
                    f"torch.Tensor, got {name!r}: {type(tensor).__name__}"
                )
                raise ConfigurationError(msg)

    @property
    def key(self) -> tuple[str, int]:
        """``(producer, seq)``: what names the sample across resends and restarts."""
        return (self.producer, self.seq)


class SampleSink(Protocol):
    """Where a receiver puts the samples it takes in (a buffer)."""

    async def put(self, sample: Sample) -> None:
        """Take ``sample``; may wait while full (back-pressure on the producer)."""
        ...
