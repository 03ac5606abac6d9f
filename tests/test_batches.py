"""Batch streams: determinism per (seed, epoch, rank), rank partitions, adapters.

Examples carry their own index as features and target, so every check is about
which examples arrive where, in which order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lamploop import BatchContext, dataloader_batches, iterable_batches, tensor_batches
from lamploop.batches import BatchStreamFactory
from lamploop.errors import ConfigurationError


def indexed(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features (n, 2) = [i, -i] and target i: an example is recognisable by its index."""
    ids = torch.arange(n)
    return torch.stack([ids, -ids], dim=1).double(), ids


def collect(factory: BatchStreamFactory, context: BatchContext) -> list[list[int]]:
    """The example indices of each batch of one stream, checking features match targets."""

    async def main() -> list[list[int]]:
        out = []
        async for features, target in factory(context):
            assert features.shape[0] == target.shape[0]
            assert torch.equal(features[:, 0].long(), target)
            out.append(target.tolist())
        return out

    return anyio.run(main, backend="asyncio")


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


# --------------------------------------------------------------------------- tensor_batches


@settings(deadline=None, max_examples=30)
@given(
    seed=st.integers(0, 2**32), epoch=st.integers(0, 1000), rank=st.integers(0, 3), extra=st.integers(0, 2)
)
def test_tensor_batches_are_a_pure_function_of_seed_epoch_rank(
    seed: int, epoch: int, rank: int, extra: int
) -> None:
    nranks = rank + 1 + extra
    x, y = indexed(37)
    context = BatchContext(epoch=epoch, rank=rank, nranks=nranks)
    first = collect(tensor_batches(x, y, batch_size=4, seed=seed), context)
    torch.manual_seed(seed + 1)  # the global RNG plays no part
    again = collect(tensor_batches(x, y, batch_size=4, seed=seed), context)
    # a fresh factory and a reused one agree
    factory = tensor_batches(x, y, batch_size=4, seed=seed)
    collect(factory, BatchContext(epoch=epoch + 1, rank=rank, nranks=nranks))
    reused = collect(factory, context)
    assert first == again == reused


def test_tensor_batches_differ_across_epochs_and_seeds() -> None:
    x, y = indexed(50)
    factory = tensor_batches(x, y, batch_size=5, seed=7)
    orders = [tuple(flat(collect(factory, BatchContext(epoch=e)))) for e in range(6)]
    assert len(set(orders)) == len(orders)
    other_seed = flat(collect(tensor_batches(x, y, batch_size=5, seed=8), BatchContext(epoch=0)))
    assert tuple(other_seed) != orders[0]
    for order in orders:
        assert sorted(order) == list(range(50))
    assert orders[0] != tuple(range(50))  # shuffled by default


def test_tensor_batches_without_shuffle_keep_the_order() -> None:
    x, y = indexed(10)
    factory = tensor_batches(x, y, batch_size=4, shuffle=False)
    for epoch in range(3):
        assert collect(factory, BatchContext(epoch=epoch)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@settings(deadline=None, max_examples=80)
@given(
    n=st.integers(1, 40),
    batch_size=st.integers(1, 7),
    nranks=st.integers(1, 4),
    seed=st.integers(0, 1000),
    epoch=st.integers(0, 50),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
)
def test_ranks_partition_the_examples(
    n: int, batch_size: int, nranks: int, seed: int, epoch: int, shuffle: bool, drop_last: bool
) -> None:
    x, y = indexed(n)
    factory = tensor_batches(x, y, batch_size=batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last)
    per_rank = [collect(factory, BatchContext(epoch=epoch, rank=r, nranks=nranks)) for r in range(nranks)]
    seen = [i for batches in per_rank for i in flat(batches)]

    kept = n - n % batch_size if drop_last else n
    assert len(seen) == len(set(seen)) == kept  # disjoint, nothing repeated
    if not drop_last:
        assert sorted(seen) == list(range(n))  # the union is everything
    sizes = [len(b) for batches in per_rank for b in batches]
    assert all(size == batch_size for size in sizes if drop_last)
    assert sum(size != batch_size for size in sizes) <= 1  # at most one short batch in all

    # batch i of the one-rank stream goes to rank i % nranks, in order
    single = collect(factory, BatchContext(epoch=epoch))
    for r in range(nranks):
        assert per_rank[r] == single[r::nranks]
    # the ranks' batch counts differ by at most one
    counts = [len(b) for b in per_rank]
    assert max(counts) - min(counts) <= 1


def test_drop_last_drops_only_the_short_batch() -> None:
    x, y = indexed(11)
    keep = collect(tensor_batches(x, y, batch_size=4, seed=3), BatchContext(epoch=2))
    drop = collect(tensor_batches(x, y, batch_size=4, seed=3, drop_last=True), BatchContext(epoch=2))
    assert [len(b) for b in keep] == [4, 4, 3]
    assert drop == keep[:2]
    exact = collect(tensor_batches(x[:8], y[:8], batch_size=4, drop_last=True), BatchContext(epoch=0))
    assert sorted(flat(exact)) == list(range(8))


def test_a_rank_beyond_the_batches_gets_an_empty_stream() -> None:
    x, y = indexed(5)
    factory = tensor_batches(x, y, batch_size=4)
    assert [len(b) for b in collect(factory, BatchContext(epoch=0, rank=0, nranks=3))] == [4]
    assert len(collect(factory, BatchContext(epoch=0, rank=1, nranks=3))) == 1
    assert collect(factory, BatchContext(epoch=0, rank=2, nranks=3)) == []


@pytest.mark.parametrize(("rank", "nranks"), [(2, 2), (5, 3), (-1, 2)])
def test_a_rank_outside_the_world_is_refused(rank: int, nranks: int) -> None:
    """A context naming a rank that is not in ``range(nranks)`` is a set-up error.

    Today it is accepted: rank 2 of 2 silently gets rank 0's batches minus the
    first (examples seen twice per epoch), rank -1 gets an empty first batch.
    """
    x, y = indexed(10)
    factory = tensor_batches(x, y, batch_size=2)
    with pytest.raises(ValueError, match="rank"):
        collect(factory, BatchContext(epoch=0, rank=rank, nranks=nranks))


@pytest.mark.parametrize(
    ("args", "kwargs", "pattern"),
    [
        (indexed(5), {"batch_size": 0}, "batch_size"),
        (indexed(5), {"batch_size": -2}, "batch_size"),
        ((indexed(5)[0], indexed(4)[1]), {"batch_size": 2}, r"5.*4"),
        (indexed(0), {"batch_size": 2}, "no examples"),
    ],
)
def test_tensor_batches_bad_arguments(args: tuple[Any, Any], kwargs: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigurationError, match=pattern):
        tensor_batches(*args, **kwargs)


# --------------------------------------------------------------------------- dataloader_batches


def loader_order(factory: BatchStreamFactory, epoch: int, rank: int = 0, nranks: int = 1) -> list[int]:
    async def main() -> list[int]:
        out: list[int] = []
        async for _features, target in factory(BatchContext(epoch=epoch, rank=rank, nranks=nranks)):
            out.extend(target.tolist())
        return out

    return anyio.run(main, backend="asyncio")


def test_dataloader_with_shuffle_is_deterministic_per_seed_and_epoch() -> None:
    x, y = indexed(40)
    loader = DataLoader(TensorDataset(x, y), batch_size=6, shuffle=True)
    factory = dataloader_batches(loader, seed=11)

    torch.manual_seed(0)
    first = loader_order(factory, epoch=3)
    torch.manual_seed(1)  # a different global RNG state must not matter
    loader_order(factory, epoch=4)  # nor what ran in between
    again = loader_order(factory, epoch=3)
    assert first == again
    assert sorted(first) == list(range(40))
    assert first != list(range(40))

    by_epoch = [tuple(loader_order(factory, epoch=e)) for e in range(5)]
    assert len(set(by_epoch)) == 5
    other = dataloader_batches(DataLoader(TensorDataset(x, y), batch_size=6, shuffle=True), seed=12)
    assert loader_order(other, epoch=3) != first
    # a second loader over the same data with the same seed gives the same order
    twin = dataloader_batches(DataLoader(TensorDataset(x, y), batch_size=6, shuffle=True), seed=11)
    assert loader_order(twin, epoch=3) == first


def test_dataloader_with_distributed_sampler_gets_the_epoch() -> None:
    x, y = indexed(30)
    dataset = TensorDataset(x, y)
    orders = {}
    for rank in range(2):
        sampler: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=2, rank=rank, shuffle=True, seed=5
        )
        factory = dataloader_batches(DataLoader(dataset, batch_size=4, sampler=sampler))
        orders[rank] = [loader_order(factory, epoch=e, rank=rank, nranks=2) for e in range(3)]
        assert loader_order(factory, epoch=1, rank=rank, nranks=2) == orders[rank][1]
        assert orders[rank][0] != orders[rank][1]
    for e in range(3):
        assert sorted(orders[0][e] + orders[1][e]) == list(range(30))


def test_dataloader_without_shuffle_keeps_the_order() -> None:
    x, y = indexed(9)
    factory = dataloader_batches(DataLoader(TensorDataset(x, y), batch_size=4))
    assert loader_order(factory, epoch=5) == list(range(9))


# --------------------------------------------------------------------------- iterable_batches


def test_iterable_batches_passes_the_context_and_yields_every_item() -> None:
    contexts: list[BatchContext] = []
    x, y = indexed(6)

    def make(context: BatchContext) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        contexts.append(context)
        start = context.epoch  # a pure function of the context
        for i in range(start, 6, 2):
            yield x[i : i + 1], y[i : i + 1]

    factory = iterable_batches(make)
    a = collect(factory, BatchContext(epoch=0, rank=1, nranks=2))
    b = collect(factory, BatchContext(epoch=1, rank=1, nranks=2))
    assert a == [[0], [2], [4]]
    assert b == [[1], [3], [5]]
    assert contexts == [BatchContext(0, 1, 2), BatchContext(1, 1, 2)]
    assert collect(factory, BatchContext(epoch=0, rank=1, nranks=2)) == a  # each call is a fresh stream


def test_iterable_batches_of_a_list_can_be_replayed() -> None:
    x, y = indexed(4)
    batches = [(x[:2], y[:2]), (x[2:], y[2:])]
    factory = iterable_batches(lambda context: batches)
    assert (
        collect(factory, BatchContext(epoch=0)) == collect(factory, BatchContext(epoch=0)) == [[0, 1], [2, 3]]
    )
