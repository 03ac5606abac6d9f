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

from lamploop.streaming.sample_rows import SampleRow

__all__ = ["Sample", "SampleSink"]


def _tensors(value: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    # A received sample's row of its run's columns is read-only already: kept, not copied.
    return value if type(value) is SampleRow else dict(value)


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

    @property
    def key(self) -> tuple[str, int]:
        """``(producer, seq)``: what names the sample across resends and restarts."""
        return (self.producer, self.seq)


class SampleSink(Protocol):
    """Where a receiver puts the samples it takes in (a buffer)."""

    async def put(self, sample: Sample) -> None:
        """Take ``sample``; may wait while full (back-pressure on the producer)."""
        ...
