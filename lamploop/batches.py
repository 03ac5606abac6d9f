"""Batch streams: async iterables of ``(features, target)`` batches.

Training code never holds a data set, only a *factory* that makes the stream of
one epoch for one rank: ``factory(BatchContext(epoch, rank, nranks))``.  The
order of the batches must be a pure function of (seed, epoch, rank), so that a
resumed run sees exactly the data an uninterrupted run would have seen.
"""

from __future__ import annotations

import weakref
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import Any, Protocol, TypeAlias, runtime_checkable

import attrs
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from lamploop.checks import check_bool, check_int, signature_of, takes_one_argument
from lamploop.errors import ConfigurationError
from lamploop.forked_children import (
    shut_down_at_exit,
    worker_init_leaving_signals,
    workers_forked_here_wait_for_their_init,
)
from lamploop.interruptible import holding_the_loop

__all__ = [
    "BatchContext",
    "BatchStream",
    "BatchStreamFactory",
    "EndingBatchStream",
    "source_ended",
    "dataloader_batches",
    "epoch_seed",
    "iterable_batches",
    "waits_on_nothing",
    "tensor_batches",
]

_END: Any = object()
"""The end of a plain iterable (``next``'s default)."""

Batch: TypeAlias = tuple[Any, torch.Tensor]
BatchStream: TypeAlias = AsyncIterable[Batch]


@runtime_checkable
class EndingBatchStream(Protocol):
    """A batch stream over a source that can end for good, such as a stream of samples.

    ``source_ended`` is ``True`` once no batch will ever come again (in this epoch or a later
    one).  A training epoch in which no rank had a batch and whose stream says so ends the
    run (:class:`~lamploop.errors.StreamExhausted`) instead of failing with "the batch
    streams were empty".
    """

    @property
    def source_ended(self) -> bool: ...

    def __aiter__(self) -> AsyncIterator[Batch]: ...


_WAITS_ON_NOTHING: weakref.WeakSet[Any] = weakref.WeakSet()
"""The streams this module made, which never wait on the outside world in an await."""


def waits_on_nothing(stream: object) -> bool:
    """Whether ``stream`` is one of :func:`tensor_batches`' or :func:`iterable_batches`' (and so
    :func:`dataloader_batches`') streams, which never wait on the outside world in an await: a
    stop request need not end their waits (:mod:`lamploop.loop.stop_aware`)."""
    try:
        return stream in _WAITS_ON_NOTHING
    except TypeError:  # no weak reference to it: none of these
        return False


def _waiting_on_nothing(stream: AsyncIterator[Batch]) -> AsyncIterator[Batch]:
    _WAITS_ON_NOTHING.add(stream)
    return stream


def source_ended(batches: object) -> bool:
    """Whether ``batches`` is an :class:`EndingBatchStream` whose source ended."""
    return isinstance(batches, EndingBatchStream) and batches.source_ended is True


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
        for name in ("epoch", "rank", "nranks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                msg = f"BatchContext: {name} must be an int, got {value!r:.40}"
                raise ConfigurationError(msg)
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
        ConfigurationError: a seed or part that is not an int >= 0 (naming it).
    """
    check_int("epoch_seed: seed", seed, 0)
    for index, part in enumerate(parts):
        check_int(f"epoch_seed: part {index}", part, 0)
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
        ConfigurationError: the tensors differ in length, are empty or not tensors with a
            batch dimension, ``batch_size`` is not an int >= 1, ``seed`` not an int >= 0, or
            ``shuffle`` / ``drop_last`` not a bool.
    """
    check_int("tensor_batches: batch_size", batch_size, 1)
    check_int("tensor_batches: seed", seed, 0)
    check_bool("tensor_batches: shuffle", shuffle)
    check_bool("tensor_batches: drop_last", drop_last)
    for name, tensor in (("features", features), ("target", target)):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            got = "a 0-dim tensor" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            msg = f"tensor_batches: {name} must be a tensor with a batch dimension, got {got}"
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

        return _waiting_on_nothing(stream())

    return factory


def iterable_batches(make: Callable[[BatchContext], Iterable[Batch]]) -> BatchStreamFactory:
    """Adapt a factory of plain (synchronous) iterables of batches.

    Raises:
        ConfigurationError: ``make`` is not callable (e.g. the list of batches itself).
    """
    if not callable(make) or not takes_one_argument(make):
        got = signature_of(make) if callable(make) else type(make).__name__
        msg = (
            f"iterable_batches: make must be a function of the batch context returning an iterable "
            f"of batches, got {got}; e.g. iterable_batches(lambda context: batches)"
        )
        raise ConfigurationError(msg)

    def factory(context: BatchContext) -> BatchStream:
        async def stream() -> AsyncIterator[Batch]:
            made = make(context)
            try:
                batches = iter(made)
            except TypeError:
                name = getattr(make, "__qualname__", type(make).__name__)
                msg = (
                    f"iterable_batches: epoch {context.epoch}: {name} returned {type(made).__name__}, "
                    "not an iterable of batches"
                )
                raise ConfigurationError(msg) from None
            while True:
                # A slow source holds the event loop: a second stop request may end it here.
                with holding_the_loop():
                    batch = next(batches, _END)
                if batch is _END:
                    return
                yield batch

        return _waiting_on_nothing(stream())

    return factory


def dataloader_batches(
    loader: DataLoader[Any] | Callable[[BatchContext], DataLoader[Any]], *, seed: int = 0
) -> BatchStreamFactory:
    """Adapt a ``torch.utils.data.DataLoader``, or a factory ``BatchContext -> DataLoader``.

    Every epoch's order is a pure function of ``(seed, epoch)``, and with several ranks the
    ranks share it out, so that they together see every example exactly once per epoch:

    - a sampler with a ``generator`` attribute (``RandomSampler``, ``SubsetRandomSampler``,
      ``WeightedRandomSampler``) gets one seeded from ``(seed, epoch)``; a sampler with
      ``set_epoch`` gets the epoch;
    - with ``nranks > 1``, rank ``r`` takes every ``nranks``-th index of the sampler's order
      starting at ``r`` (a custom ``batch_sampler``: every ``nranks``-th batch), in a loader
      with the same batch size, collate function, workers and pinning;
    - a sampler that shards by itself (it has ``num_replicas`` and ``rank``, as
      ``DistributedSampler``) is used as it is, once its ``num_replicas`` and ``rank`` are
      checked against the context's (make it in a factory:
      ``lambda context: DataLoader(data, sampler=DistributedSampler(data,
      num_replicas=context.nranks, rank=context.rank))``);
    - a loader over an ``IterableDataset`` is used as it is; with several ranks it must come
      from a factory that gives each rank its own part.

    A sampler whose order depends on the global RNG (rather than a ``generator``) would
    differ between ranks; the built-in ones do not.

    Raises:
        ConfigurationError: ``loader`` is neither, a factory returned something else, a
            sharding sampler disagrees with the context, or one loader over an
            ``IterableDataset`` is asked for several ranks.
    """
    if not isinstance(loader, DataLoader) and not callable(loader):
        msg = f"dataloader_batches: expected a DataLoader or a factory of them, got {type(loader).__name__}"
        raise ConfigurationError(msg)
    check_int("dataloader_batches: seed", seed, 0)
    made_per_rank = not isinstance(loader, DataLoader)

    def make(context: BatchContext) -> Iterable[Batch]:
        epoch_loader = loader(context) if callable(loader) and made_per_rank else loader
        if not isinstance(epoch_loader, DataLoader):
            msg = (
                f"dataloader_batches: the factory returned {type(epoch_loader).__name__} for "
                f"{context}, not a DataLoader"
            )
            raise ConfigurationError(msg)
        rank_loader = _rank_loader(epoch_loader, context, seed, made_per_rank=made_per_rank)
        return _WorkersEndWithTheEpoch(rank_loader) if rank_loader.num_workers > 0 else rank_loader

    return iterable_batches(make)


@attrs.frozen
class _WorkersEndWithTheEpoch:
    """A ``DataLoader`` with worker processes, iterated so that its workers end with the epoch.

    Its workers leave SIGINT and SIGTERM to the run (:func:`_rank_loader`); so they also ignore
    the SIGTERM of Python's exit, which joins them.  A run that failed (a worker killed: "DataLoader
    worker ... exited unexpectedly") and left its iterator to the exit hung there forever,
    joining a worker that waited for work; so did every process whose loader had persistent
    workers.  The iterator's workers are shut down as the iteration ends, however it ends
    (persistent ones only when it fails or is abandoned), and at the process's exit
    (:func:`~lamploop.forked_children.shut_down_at_exit`); they are forked with the stop signals
    held until they ignore them
    (:func:`~lamploop.forked_children.workers_forked_here_wait_for_their_init`).
    """

    loader: DataLoader[Any]

    def __iter__(self) -> Iterator[Any]:
        with workers_forked_here_wait_for_their_init():
            batches = iter(self.loader)
        shut_down_at_exit(batches)  # persistent workers outlive the epoch: not the process
        finished = False
        try:
            yield from batches
            finished = True
        finally:
            # Persistent workers serve the next epoch's iteration, unless this one failed or was
            # abandoned.  torch's own shutdown (the iterator's __del__ calls it) asks each worker
            # to end, joins it with a bound, then terminates what is left.
            shutdown = getattr(batches, "_shutdown_workers", None)
            if callable(shutdown) and not (finished and self.loader.persistent_workers):
                shutdown()


def _rank_loader(
    loader: DataLoader[Any], context: BatchContext, seed: int, *, made_per_rank: bool
) -> DataLoader[Any]:
    """``loader`` made deterministic for ``context.epoch`` and cut down to ``context.rank``'s share."""
    if loader.num_workers > 0:  # a group SIGTERM or SIGINT is the run's to handle, not its workers'
        loader.worker_init_fn = worker_init_leaving_signals(loader.worker_init_fn)
    if isinstance(loader.dataset, IterableDataset):
        if context.nranks > 1 and not made_per_rank:
            msg = (
                "dataloader_batches: one DataLoader over an IterableDataset cannot be shared out "
                f"to {context.nranks} ranks; pass a factory (context -> DataLoader) that gives "
                "rank context.rank its own part"
            )
            raise ConfigurationError(msg)
        return loader
    custom_batches = loader.batch_size is None and loader.batch_sampler is not None
    sampler: Any = loader.batch_sampler if custom_batches else loader.sampler
    set_epoch = getattr(sampler, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(context.epoch)
    if hasattr(sampler, "num_replicas") and hasattr(sampler, "rank"):
        _check_shard(sampler, context)
        return loader
    inner: Any = getattr(sampler, "sampler", sampler)  # a BatchSampler's sampler
    if hasattr(inner, "generator"):
        inner.generator = torch.Generator().manual_seed(epoch_seed(seed, context.epoch, 0))
    if context.nranks == 1:
        return loader
    share = slice(context.rank, None, context.nranks)
    common: dict[str, Any] = {
        "collate_fn": loader.collate_fn,
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
    }
    if loader.num_workers > 0:
        common["prefetch_factor"] = loader.prefetch_factor
    if custom_batches:  # share out whole batches
        return DataLoader(loader.dataset, batch_sampler=list(sampler)[share], **common)
    indices = list(loader.sampler)[share]
    return DataLoader(
        loader.dataset, batch_size=loader.batch_size, sampler=indices, drop_last=loader.drop_last, **common
    )


def _check_shard(sampler: Any, context: BatchContext) -> None:
    if (sampler.num_replicas, sampler.rank) != (context.nranks, context.rank):
        msg = (
            f"dataloader_batches: the loader's {type(sampler).__name__} has num_replicas="
            f"{sampler.num_replicas}, rank={sampler.rank}, but it is used on rank {context.rank} "
            f"of {context.nranks}; make it in a factory with num_replicas=context.nranks, "
            "rank=context.rank (or pass a plain loader: lamploop shares it out)"
        )
        raise ConfigurationError(msg)
