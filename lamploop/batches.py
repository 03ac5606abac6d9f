"""Batch streams: async iterables of ``(features, target)`` batches.

Training code never holds a data set, only a *factory* that makes the stream of
one epoch for one rank: ``factory(BatchContext(epoch, rank, nranks))``.  The
order of the batches must be a pure function of (seed, epoch, rank), so that a
resumed run sees exactly the data an uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any, TypeAlias

import attrs
import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler

from lamploop.errors import ConfigurationError

__all__ = [
    "BatchContext",
    "BatchStream",
    "BatchStreamFactory",
    "dataloader_batches",
    "epoch_seed",
    "iterable_batches",
    "tensor_batches",
]

Batch: TypeAlias = tuple[Any, torch.Tensor]
BatchStream: TypeAlias = AsyncIterable[Batch]


@attrs.frozen
class BatchContext:
    """Which stream to make: the epoch, this rank and the number of ranks.

    Raises:
        ConfigurationError: ``epoch < 0``, ``nranks < 1`` or ``rank`` not in ``0..nranks-1``.
    """

    epoch: int
    rank: int = 0
    nranks: int = 1

    def __attrs_post_init__(self) -> None:
        if self.epoch < 0:
            msg = f"BatchContext: epoch must be >= 0, got {self.epoch}"
            raise ConfigurationError(msg)
        if self.nranks < 1:
            msg = f"BatchContext: nranks must be >= 1, got {self.nranks}"
            raise ConfigurationError(msg)
        if not 0 <= self.rank < self.nranks:
            msg = f"BatchContext: rank must be in 0..{self.nranks - 1}, got {self.rank}"
            raise ConfigurationError(msg)


BatchStreamFactory: TypeAlias = Callable[[BatchContext], BatchStream]


def epoch_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed mixed from ``seed`` and ``parts`` (epoch, rank...) by NumPy's SeedSequence.

    Raises:
        ConfigurationError: a negative seed or part.
    """
    if seed < 0 or any(part < 0 for part in parts):
        msg = f"seeds must be >= 0, got seed={seed} and {parts}"
        raise ConfigurationError(msg)
    state = np.random.SeedSequence([seed, *parts]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def tensor_batches(
    features: torch.Tensor,
    target: torch.Tensor,
    *,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> BatchStreamFactory:
    """Batches cut from two tensors that share their first dimension.

    Each epoch the examples are permuted by a generator seeded from
    ``(seed, epoch)`` (or kept in order when ``shuffle`` is false) and cut into
    batches of ``batch_size``; batch ``i`` goes to rank ``i % nranks``.  Every
    rank sees a disjoint part and the ranks together see every example once.

    Raises:
        ConfigurationError: the tensors differ in length, are empty, or
            ``batch_size < 1``.
    """
    if batch_size < 1:
        msg = f"tensor_batches: batch_size must be >= 1, got {batch_size}"
        raise ConfigurationError(msg)
    if seed < 0:
        msg = f"tensor_batches: seed must be >= 0, got {seed}"
        raise ConfigurationError(msg)
    n = int(target.shape[0])
    if int(features.shape[0]) != n:
        msg = f"tensor_batches: features have {features.shape[0]} rows but target has {n}"
        raise ConfigurationError(msg)
    if n == 0:
        msg = "tensor_batches: the tensors hold no examples"
        raise ConfigurationError(msg)

    def factory(context: BatchContext) -> BatchStream:
        if shuffle:
            generator = torch.Generator().manual_seed(epoch_seed(seed, context.epoch))
            order = torch.randperm(n, generator=generator)
        else:
            order = torch.arange(n)
        stop = n - n % batch_size if drop_last else n
        starts = range(context.rank * batch_size, stop, batch_size * context.nranks)

        async def stream() -> AsyncIterator[Batch]:
            for start in starts:
                index = order[start : start + batch_size]
                yield features[index], target[index]

        return stream()

    return factory


def iterable_batches(make: Callable[[BatchContext], Iterable[Batch]]) -> BatchStreamFactory:
    """Adapt a factory of plain (synchronous) iterables of batches."""

    def factory(context: BatchContext) -> BatchStream:
        async def stream() -> AsyncIterator[Batch]:
            for batch in make(context):
                yield batch

        return stream()

    return factory


def dataloader_batches(loader: DataLoader[Any], *, seed: int = 0) -> BatchStreamFactory:
    """Adapt a ``torch.utils.data.DataLoader`` (the same loader on every rank call).

    Before each epoch the sampler is made deterministic: a ``RandomSampler``
    gets a generator seeded from ``(seed, epoch, rank)``, and a sampler with
    ``set_epoch`` (such as ``DistributedSampler``) gets the epoch.  Sharding
    across ranks is the sampler's job (use ``DistributedSampler``).
    """

    def make(context: BatchContext) -> Iterable[Batch]:
        sampler = loader.sampler
        if isinstance(sampler, RandomSampler):
            sampler.generator = torch.Generator().manual_seed(epoch_seed(seed, context.epoch, context.rank))
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(context.epoch)
        return loader

    return iterable_batches(make)
