"""``dataloader_batches`` shares a DataLoader out to the ranks: every example once per epoch.

Before, each of 2 ranks read all the examples, so an epoch silently used twice the data.
The last test trains on real Gloo process groups (``local_data_parallel_training_loop``)
and records which examples each replica's model saw.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
    TensorDataset,
)

import lamploop
from lamploop import BatchContext, dataloader_batches
from lamploop.errors import ConfigurationError

N = 101  # not a multiple of 2, 3 or the batch size


def _dataset() -> TensorDataset:
    ids = torch.arange(N)
    return TensorDataset(torch.stack([ids.double(), torch.randn(N, dtype=torch.float64)], 1), ids % 3)


def _seen(factory: lamploop.BatchStreamFactory, epoch: int, rank: int, nranks: int) -> list[int]:
    async def main() -> list[int]:
        out: list[int] = []
        async for features, _ in factory(BatchContext(epoch=epoch, rank=rank, nranks=nranks)):
            out.extend(int(i) for i in features[:, 0].tolist())
        return out

    return anyio.run(main)


LOADERS = {
    "shuffled": lambda: DataLoader(_dataset(), batch_size=8, shuffle=True),
    "in order": lambda: DataLoader(_dataset(), batch_size=8),
    "drop_last off, odd batch": lambda: DataLoader(_dataset(), batch_size=7, shuffle=True, drop_last=False),
    "custom batch sampler": lambda: DataLoader(
        _dataset(), batch_sampler=BatchSampler(SequentialSampler(range(N)), batch_size=5, drop_last=False)
    ),
}


@pytest.mark.parametrize("nranks", [2, 3])
@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_the_ranks_together_see_every_example_once_per_epoch(kind: str, nranks: int) -> None:
    factory = dataloader_batches(LOADERS[kind](), seed=4)
    orders = []
    for epoch in range(3):
        shares = [_seen(factory, epoch, rank, nranks) for rank in range(nranks)]
        assert sorted(i for share in shares for i in share) == list(range(N)), f"epoch {epoch}"
        assert max(map(len, shares)) - min(map(len, shares)) <= 8  # at most a batch apart
        # a pure function of (seed, epoch, rank): asked again, the same
        assert _seen(factory, epoch, 1, nranks) == shares[1]
        orders.append(shares[0])
    if kind != "in order" and kind != "custom batch sampler":
        assert orders[0] != orders[1]  # shuffled anew each epoch


def test_one_rank_keeps_the_loader_as_it_was() -> None:
    factory = dataloader_batches(LOADERS["shuffled"](), seed=4)
    assert sorted(_seen(factory, 0, 0, 1)) == list(range(N))
    two = [_seen(factory, 0, r, 2) for r in range(2)]
    assert sorted(two[0] + two[1]) == list(range(N))


def test_a_distributed_sampler_made_per_rank_is_used_as_it_is() -> None:
    data = _dataset()

    def loader(context: BatchContext) -> DataLoader[Any]:
        sampler = DistributedSampler(data, num_replicas=context.nranks, rank=context.rank, seed=3)
        return DataLoader(data, batch_size=8, sampler=sampler)

    factory = dataloader_batches(loader)
    shares = [_seen(factory, 2, rank, 2) for rank in range(2)]
    assert set(shares[0]) | set(shares[1]) == set(range(N))
    assert len(shares[0]) == len(shares[1]) == 51  # DistributedSampler pads with a repeat
    assert _seen(factory, 3, 0, 2) != shares[0]  # set_epoch was called


def test_a_distributed_sampler_for_another_rank_is_refused() -> None:
    data = _dataset()
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=1, rank=0))
    factory = dataloader_batches(loader)
    with pytest.raises(ConfigurationError, match="num_replicas=1, rank=0, but it is used on rank 1 of 2"):
        _seen(factory, 0, 1, 2)


class _Counting(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, start: int, step: int) -> None:
        self.start, self.step = start, step

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(self.start, N, self.step):
            yield torch.tensor([float(i), 0.0], dtype=torch.float64), torch.tensor(i % 3)


def test_iterable_datasets_need_a_factory_with_several_ranks() -> None:
    shared = dataloader_batches(DataLoader(_Counting(0, 1), batch_size=4))
    assert _seen(shared, 0, 0, 1) == list(range(N))
    with pytest.raises(ConfigurationError, match="IterableDataset cannot be shared out to 2 ranks"):
        _seen(shared, 0, 0, 2)
    per_rank = dataloader_batches(lambda c: DataLoader(_Counting(c.rank, c.nranks), batch_size=4))
    assert sorted(_seen(per_rank, 0, 0, 2) + _seen(per_rank, 0, 1, 2)) == list(range(N))


def test_bad_loaders_are_named() -> None:
    with pytest.raises(ConfigurationError, match="expected a DataLoader or a factory of them, got list"):
        dataloader_batches([1, 2])  # type: ignore[arg-type]
    factory = dataloader_batches(lambda c: [torch.zeros(2)])  # type: ignore[arg-type, return-value]
    with pytest.raises(ConfigurationError, match="the factory returned list for BatchContext"):
        _seen(factory, 0, 0, 1)


class _Recording(torch.nn.Module):
    """Records the ids (first feature column) of every training example it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 3, dtype=torch.float64)
        self.seen: list[int] = []
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with self.lock:
                self.seen.extend(int(i) for i in x[:, 0].tolist())
        return self.linear(x[:, 1:].expand(-1, 2))


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nranks", [2, 3])
async def test_training_on_several_ranks_sees_every_example_once_per_epoch(nranks: int) -> None:
    modules = [_Recording() for _ in range(nranks)]
    train = dataloader_batches(DataLoader(_dataset(), batch_size=6, shuffle=True), seed=1)
    epochs = 2
    with anyio.fail_after(50):
        await lamploop.local_data_parallel_training_loop(
            [(lamploop.SupervisedModel(m), train, None) for m in modules],
            lambda params: torch.optim.SGD(params, lr=0.01),
            epochs,
        )
    seen = sorted(i for m in modules for i in m.seen)
    assert seen == sorted(list(range(N)) * epochs)
