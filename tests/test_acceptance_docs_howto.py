"""Acceptance tests written from the user documentation alone.

Pages: docs/getting-started.md, docs/coming-from-lightning.md,
docs/how-to/custom-batch-streams.md, docs/how-to/custom-reporters.md, docs/training.md,
docs/concepts/batch-streams.md and the API pages (docstrings) of ``lamploop.metrics``,
``lamploop.model`` and ``lamploop.batches``. Each test quotes the sentence it checks; numbers
are checked against float64 computations made here.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import re
import signal
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import anyio
import attrs
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
    TensorDataset,
)

import lamploop
from lamploop import BatchContext
from lamploop.batches import epoch_seed
from lamploop.errors import (
    BatchError,
    ConfigurationError,
    LamploopError,
    NonFiniteLossError,
    TrainingInterrupted,
)
from lamploop.metrics import PassResult, accuracy, metrics_of
from lamploop.reporting.events import (
    CheckpointWritten,
    EpochFinished,
    EpochStarted,
    PeerJoined,
    ProgressSampled,
    RunFailed,
    RunFinished,
    RunStarted,
    RunStopped,
    ValidationFinished,
)

# ---------------------------------------------------------------------------------------------
# helpers


def batches_of(stream: lamploop.BatchStream) -> list[tuple[object, torch.Tensor]]:
    async def collect() -> list[tuple[object, torch.Tensor]]:
        return [(features, target) async for features, target in stream]

    return anyio.run(collect)


def targets_of(factory: lamploop.BatchStreamFactory, context: BatchContext) -> list[list[int]]:
    return [target.tolist() for _, target in batches_of(factory(context))]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def sgd(lr: float):
    return lambda params: torch.optim.SGD(params, lr=lr)


def double_linear(n_in: int, n_out: int, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(n_in, n_out).double()


class Recorder:
    """Records every event, and start()/close() calls, in one ordered log."""

    def __init__(self) -> None:
        self.events: list = []
        self.log: list[str] = []
        self.started = self.closed = 0
        self.threads: set[int] = set()
        self.inside = 0
        self.overlapped = False

    def start(self) -> None:
        self.started += 1
        self.log.append("start")

    def report(self, event) -> None:
        self.inside += 1
        if self.inside > 1:
            self.overlapped = True
        self.threads.add(threading.get_ident())
        self.events.append(event)
        self.log.append(type(event).__name__)
        self.inside -= 1

    def close(self) -> None:
        self.closed += 1
        self.log.append("close")


def kinds(recorder: Recorder) -> list[type]:
    return [type(event) for event in recorder.events]


def raw(value) -> float:
    """The raw value of a learning-curve metric, whether a float or a (smoothed, raw) pair."""
    return value[1] if isinstance(value, tuple) else value


def float64_ce_mean(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        output = module(x.double())
        return F.cross_entropy(output.double(), y, reduction="sum").item() / len(y)


def float64_accuracy(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (module(x.double()).argmax(dim=1) == y).double().mean().item()


# ---------------------------------------------------------------------------------------------
# concepts/batch-streams.md: tensor_batches


def test_tensor_batches_concept_example() -> None:
    """concepts/batch-streams.md: "Each epoch the examples are permuted by a generator seeded
    from `(seed, epoch)`, the same on every rank, and batch `i` goes to rank `i % nranks`"."""
    x, y = torch.arange(10.0).unsqueeze(1), torch.arange(10)
    factory = lamploop.tensor_batches(x, y, batch_size=3, seed=5)
    epoch0 = targets_of(factory, BatchContext(epoch=0))
    assert [len(batch) for batch in epoch0] == [3, 3, 3, 1]
    assert targets_of(factory, BatchContext(epoch=0)) == epoch0
    assert targets_of(factory, BatchContext(epoch=1)) != epoch0
    rank0 = targets_of(factory, BatchContext(epoch=0, rank=0, nranks=2))
    rank1 = targets_of(factory, BatchContext(epoch=0, rank=1, nranks=2))
    assert rank0 == epoch0[0::2]
    assert rank1 == epoch0[1::2]
    # features travel with their target
    for features, target in batches_of(factory(BatchContext(epoch=0))):
        assert features.squeeze(1).long().tolist() == target.tolist()


@pytest.mark.parametrize("nranks", [1, 2, 3, 5], ids=lambda n: f"nranks{n}")
def test_tensor_batches_every_example_once_per_epoch_and_pure(nranks: int) -> None:
    """api/batches (tensor_batches): "Every rank sees a disjoint part and the ranks together see
    every example once." concepts/batch-streams.md: "the batches must be a pure function of
    (seed, epoch, rank)"."""
    n = 37
    x, y = torch.randn(n, 2), torch.arange(n)
    for epoch in range(3):
        reference = targets_of(
            lamploop.tensor_batches(x, y, batch_size=4, seed=11), BatchContext(epoch=epoch)
        )
        shares = []
        for rank in range(nranks):
            context = BatchContext(epoch=epoch, rank=rank, nranks=nranks)
            # a fresh factory with the same seed: the order depends on (seed, epoch, rank) only
            torch.manual_seed(1000 + rank)
            first = targets_of(lamploop.tensor_batches(x, y, batch_size=4, seed=11), context)
            torch.manual_seed(2000 + rank)
            again = targets_of(lamploop.tensor_batches(x, y, batch_size=4, seed=11), context)
            assert first == again
            assert first == reference[rank::nranks]
            shares += flat(first)
        assert sorted(shares) == list(range(n))
    other_seed = targets_of(lamploop.tensor_batches(x, y, batch_size=4, seed=12), BatchContext(epoch=0))
    assert other_seed != targets_of(
        lamploop.tensor_batches(x, y, batch_size=4, seed=11), BatchContext(epoch=0)
    )


def test_tensor_batches_unshuffled_and_drop_last() -> None:
    """api/batches (tensor_batches): "(or kept in order when ``shuffle`` is false) and cut into
    batches of ``batch_size``"; signature `drop_last=False`."""
    x, y = torch.randn(10, 2), torch.arange(10)
    in_order = targets_of(lamploop.tensor_batches(x, y, batch_size=4, shuffle=False), BatchContext(epoch=3))
    assert in_order == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    dropped = targets_of(lamploop.tensor_batches(x, y, batch_size=4, drop_last=True), BatchContext(epoch=0))
    assert [len(batch) for batch in dropped] == [4, 4]
    assert len(set(flat(dropped))) == 8


_GOOD_X, _GOOD_Y = torch.randn(8, 2), torch.arange(8)


@pytest.mark.parametrize(
    ("arguments", "keywords", "named"),
    [
        ((_GOOD_X, torch.arange(7)), {"batch_size": 2}, "length"),
        ((torch.randn(0, 2), torch.arange(0)), {"batch_size": 2}, "empty"),
        ((_GOOD_X.tolist(), _GOOD_Y), {"batch_size": 2}, "tensor"),
        ((torch.tensor(1.0), torch.tensor(1)), {"batch_size": 2}, "batch dimension"),
        ((_GOOD_X, _GOOD_Y), {"batch_size": 0}, "batch_size"),
        ((_GOOD_X, _GOOD_Y), {"batch_size": 2.0}, "batch_size"),
        ((_GOOD_X, _GOOD_Y), {"batch_size": 2, "seed": -1}, "seed"),
        ((_GOOD_X, _GOOD_Y), {"batch_size": 2, "seed": 1.5}, "seed"),
        ((_GOOD_X, _GOOD_Y), {"batch_size": 2, "shuffle": "yes"}, "shuffle"),
        ((_GOOD_X, _GOOD_Y), {"batch_size": 2, "drop_last": 1}, "drop_last"),
    ],
    ids=[
        "lengths_differ",
        "empty",
        "features_not_tensor",
        "no_batch_dimension",
        "batch_size_0",
        "batch_size_float",
        "seed_negative",
        "seed_float",
        "shuffle_not_bool",
        "drop_last_not_bool",
    ],
)
def test_tensor_batches_bad_arguments(arguments: tuple, keywords: dict, named: str) -> None:
    """api/batches (tensor_batches): "Raises: ConfigurationError: the tensors differ in length,
    are empty or not tensors with a batch dimension, ``batch_size`` is not an int >= 1,
    ``seed`` not an int >= 0, or ``shuffle`` / ``drop_last`` not a bool."""
    with pytest.raises(ConfigurationError) as caught:
        lamploop.tensor_batches(*arguments, **keywords)
    if named in ("batch_size", "seed", "shuffle", "drop_last"):
        assert named in str(caught.value)


@pytest.mark.parametrize(
    "keywords",
    [
        {"epoch": -1},
        {"epoch": 0, "nranks": 0},
        {"epoch": 0, "rank": 2, "nranks": 2},
        {"epoch": 0, "rank": -1},
    ],
    ids=["epoch_negative", "nranks_0", "rank_too_big", "rank_negative"],
)
def test_batch_context_bad_arguments(keywords: dict) -> None:
    """api/batches (BatchContext): "Raises: ConfigurationError: ``epoch < 0``, ``nranks < 1`` or
    ``rank`` not in ``0..nranks-1``."""
    with pytest.raises(ConfigurationError):
        BatchContext(**keywords)


def test_epoch_seed() -> None:
    """api/batches (epoch_seed): "A 63-bit seed mixed from ``seed`` and ``parts`` (epoch,
    rank...) by NumPy's SeedSequence. Raises: ConfigurationError: a negative seed or part."""
    seeds = {epoch_seed(7, epoch, rank) for epoch in range(5) for rank in range(3)}
    assert len(seeds) == 15
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)
    assert epoch_seed(7, 2, 1) == epoch_seed(7, 2, 1)
    for bad in [(-1, 0), (0, -1), (0, 1, -2)]:
        with pytest.raises(ConfigurationError):
            epoch_seed(*bad)


# ---------------------------------------------------------------------------------------------
# concepts/batch-streams.md: iterable_batches, dataloader_batches


def test_iterable_batches_wraps_plain_iterables() -> None:
    """concepts/batch-streams.md: "`iterable_batches(make)` wraps a factory of *plain* iterables
    (a generator function, a list per epoch)"; api: "Raises: ConfigurationError: ``make`` is
    not callable (e.g. the list of batches itself)."""
    x, y = torch.randn(6, 2), torch.arange(6)

    def generator(context: BatchContext):
        yield x[:4], y[:4]
        yield x[4:], y[4:] + 100 * context.epoch

    assert targets_of(lamploop.iterable_batches(generator), BatchContext(epoch=1)) == [
        [0, 1, 2, 3],
        [104, 105],
    ]
    as_list = lamploop.iterable_batches(lambda context: [(x[:3], y[:3]), (x[3:], y[3:])])
    assert targets_of(as_list, BatchContext(epoch=0)) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ConfigurationError):
        lamploop.iterable_batches([(x, y)])


_DATA = TensorDataset(torch.arange(11.0).unsqueeze(1), torch.arange(11))


@pytest.mark.parametrize("nranks", [1, 2, 3], ids=lambda n: f"nranks{n}")
def test_dataloader_batches_shuffled_shares(nranks: int) -> None:
    """concepts/loop.md via batch-streams.md: "its sampler is seeded from `(seed, epoch)` (the
    same order on every rank) and rank `r` takes every `nranks`-th index from `r` on ... so the
    ranks together see every example exactly once per epoch; the batch size ... kept"."""
    loader = DataLoader(_DATA, batch_size=3, shuffle=True)
    factory = lamploop.dataloader_batches(loader, seed=7)
    orders = []
    for epoch in range(2):
        order = flat(targets_of(factory, BatchContext(epoch=epoch)))
        orders.append(order)
        assert sorted(order) == list(range(11))
        shares = []
        for rank in range(nranks):
            context = BatchContext(epoch=epoch, rank=rank, nranks=nranks)
            torch.manual_seed(rank)  # the global RNG must not matter
            mine = targets_of(factory, context)
            torch.manual_seed(99 + rank)
            assert targets_of(lamploop.dataloader_batches(loader, seed=7), context) == mine
            assert flat(mine) == order[rank::nranks]
            assert all(len(batch) == 3 for batch in mine[:-1])
            shares += flat(mine)
        assert sorted(shares) == list(range(11))
    assert orders[0] != orders[1]
    assert flat(targets_of(lamploop.dataloader_batches(loader, seed=8), BatchContext(epoch=0))) != orders[0]


def test_dataloader_batches_sequential_and_batch_sampler() -> None:
    """api/batches (dataloader_batches): "with ``nranks > 1``, rank ``r`` takes every
    ``nranks``-th index of the sampler's order starting at ``r`` (a custom ``batch_sampler``:
    every ``nranks``-th batch)"."""
    plain = lamploop.dataloader_batches(DataLoader(_DATA, batch_size=2))
    assert flat(targets_of(plain, BatchContext(epoch=0, rank=1, nranks=3))) == [1, 4, 7, 10]
    sampler = BatchSampler(SequentialSampler(_DATA), batch_size=3, drop_last=False)
    batched = lamploop.dataloader_batches(DataLoader(_DATA, batch_sampler=sampler))
    assert targets_of(batched, BatchContext(epoch=0, rank=0, nranks=2)) == [[0, 1, 2], [6, 7, 8]]
    assert targets_of(batched, BatchContext(epoch=0, rank=1, nranks=2)) == [[3, 4, 5], [9, 10]]


def test_dataloader_batches_distributed_sampler_checked() -> None:
    """api/batches (dataloader_batches): "a sampler that shards by itself ... is used as it is,
    once its ``num_replicas`` and ``rank`` are checked against the context's"; "Raises:
    ConfigurationError: ... a sharding sampler disagrees with the context"."""
    data = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10))
    per_rank = lamploop.dataloader_batches(
        lambda context: DataLoader(
            data,
            batch_size=3,
            sampler=DistributedSampler(data, num_replicas=context.nranks, rank=context.rank),
        )
    )
    shares = [flat(targets_of(per_rank, BatchContext(epoch=0, rank=r, nranks=2))) for r in range(2)]
    assert len(shares[1]) == 5
    assert sorted(shares[0] + shares[1]) == list(range(10))
    wrong = lamploop.dataloader_batches(
        lambda context: DataLoader(
            data, batch_size=3, sampler=DistributedSampler(data, num_replicas=3, rank=0)
        )
    )
    with pytest.raises(ConfigurationError):
        batches_of(wrong(BatchContext(epoch=0, rank=0, nranks=2)))


class _Counting(IterableDataset):
    def __iter__(self):
        for i in range(6):
            yield torch.tensor([float(i)]), torch.tensor(i)


@pytest.mark.parametrize("case", ["iterable_dataset_two_ranks", "not_a_loader", "factory_returns_list"])
def test_dataloader_batches_refusals(case: str) -> None:
    """api/batches (dataloader_batches): "Raises: ConfigurationError: ``loader`` is neither, a
    factory returned something else, ... or one loader over an ``IterableDataset`` is asked
    for several ranks."""
    if case == "iterable_dataset_two_ranks":
        factory = lamploop.dataloader_batches(DataLoader(_Counting(), batch_size=2))
        assert flat(targets_of(factory, BatchContext(epoch=0))) == list(range(6))  # one rank: as it is
        with pytest.raises(ConfigurationError):
            batches_of(factory(BatchContext(epoch=0, rank=1, nranks=2)))
    elif case == "not_a_loader":
        with pytest.raises(ConfigurationError):
            lamploop.dataloader_batches([(torch.zeros(2, 1), torch.zeros(2))])
    else:
        factory = lamploop.dataloader_batches(lambda context: [(torch.zeros(2, 1), torch.zeros(2))])
        with pytest.raises(ConfigurationError):
            batches_of(factory(BatchContext(epoch=0)))


# ---------------------------------------------------------------------------------------------
# how-to/custom-batch-streams.md


def _example_ids(stream: lamploop.BatchStream) -> list[int]:
    async def collect() -> list[int]:
        return [i async for _, target in stream for i in target.tolist()]

    return anyio.run(collect)


def _check(factory: lamploop.BatchStreamFactory, n_examples: int, nranks: int, epochs: int = 2) -> None:
    for epoch in range(epochs):
        shares = []
        for rank in range(nranks):
            context = BatchContext(epoch=epoch, rank=rank, nranks=nranks)
            seen = _example_ids(factory(context))
            again = _example_ids(factory(context))
            assert seen == again, f"epoch {epoch}, rank {rank}: not a pure function of the context"
            shares += seen
        assert sorted(shares) == list(range(n_examples)), f"epoch {epoch}: not every example once"


def _shard_batches(shards: list[Path], *, batch_size: int, seed: int = 0) -> lamploop.BatchStreamFactory:
    def factory(context: BatchContext) -> lamploop.BatchStream:
        generator = torch.Generator().manual_seed(epoch_seed(seed, context.epoch))
        order = torch.randperm(len(shards), generator=generator).tolist()
        mine = [shards[i] for i in order[context.rank :: context.nranks]]

        def read(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
            x = np.load(path)
            y = np.load(path.with_name(path.name.replace("x-", "y-")))
            return torch.from_numpy(x), torch.from_numpy(y)

        async def stream():
            for path in mine:
                x, y = await anyio.to_thread.run_sync(read, path)
                for start in range(0, len(y), batch_size):
                    yield x[start : start + batch_size], y[start : start + batch_size]

        return stream()

    return factory


def _write_shards(directory: Path, *, ids: bool) -> list[Path]:
    rng = np.random.default_rng(0)
    paths, offset = [], 0
    for i, size in enumerate([20, 40, 80, 30, 50, 60, 20]):
        x = rng.standard_normal((size, 4)).astype(np.float32)
        y = np.arange(offset, offset + size) if ids else (x[:, 0] + x[:, 1] > 0).astype(np.int64)
        offset += size
        np.save(directory / f"x-{i}.npy", x)
        np.save(directory / f"y-{i}.npy", y)
        paths.append(directory / f"x-{i}.npy")
    return paths


def test_howto_shard_stream_trains_and_checks(tmp_path: Path) -> None:
    """how-to/custom-batch-streams.md: "The shards have different sizes, so the ranks get
    different numbers of batches: that is fine"; "the ranks together see every example exactly
    once per epoch. Both can be checked without training"."""
    (tmp_path / "train").mkdir()
    (tmp_path / "ids").mkdir()
    train = _shard_batches(_write_shards(tmp_path / "train", ids=False), batch_size=16)
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.Adam(params, lr=0.01),
        train_batches=train,
        max_epochs=4,
        reporters=[],
    )
    assert state.learning_curve[-1].training_loss < state.learning_curve[0].training_loss
    with_ids = _shard_batches(_write_shards(tmp_path / "ids", ids=True), batch_size=16)
    for nranks in (1, 2, 3):
        _check(with_ids, n_examples=300, nranks=nranks)


def test_howto_check_catches_unseeded_stream() -> None:
    """how-to/custom-batch-streams.md: the `check` recipe passes `tensor_batches` and prints
    "epoch 0, rank 0: not a pure function of the context" for a stream on the global RNG."""
    _check(
        lamploop.tensor_batches(torch.randn(50, 3), torch.arange(50), batch_size=8), n_examples=50, nranks=3
    )

    def unseeded(context: BatchContext) -> lamploop.BatchStream:
        order = torch.randperm(50)

        async def stream():
            for start in range(context.rank * 10, 50, 10 * context.nranks):
                index = order[start : start + 10]
                yield index.float().unsqueeze(1), index

        return stream()

    torch.manual_seed(0)
    with pytest.raises(AssertionError, match="epoch 0, rank 0: not a pure function of the context"):
        _check(unseeded, n_examples=50, nranks=2)


class _Nested(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 2)
        self.b = torch.nn.Linear(2, 2)
        self.c = torch.nn.Linear(1, 2)
        self.seen: list[type] = []

    def forward(self, features):
        self.seen.append(type(features))
        first, (second, extra) = features
        return self.a(first) + self.b(second) + self.c(extra["c"])


def test_structured_features_reach_the_module_as_they_are() -> None:
    """how-to/custom-batch-streams.md: "`features` may be a tensor, or a tuple, list or dict of
    tensors (nested, too) ... The module receives it as it is"."""
    torch.manual_seed(0)
    a, b, c, y = torch.randn(24, 3), torch.randn(24, 2), torch.randn(24, 1), torch.randint(0, 2, (24,))

    async def stream(context: BatchContext):
        for start in range(0, 24, 8):
            s = slice(start, start + 8)
            yield (a[s], [b[s], {"c": c[s]}]), y[s]

    module = _Nested()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=sgd(0.1),
        train_batches=stream,
        max_epochs=2,
        reporters=[],
    )
    assert state.epoch == 2
    assert set(module.seen) == {tuple}


def test_howto_two_inputs_dict_recipe() -> None:
    """how-to/custom-batch-streams.md, "Structured features": the `TwoInputs` recipe with dict
    features trains 2 epochs (`assert state.epoch == 2`)."""

    class TwoInputs(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.image = torch.nn.Linear(8, 4)
            self.meta = torch.nn.Linear(2, 4)
            self.head = torch.nn.Linear(4, 3)

        def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.head(torch.relu(self.image(features["image"]) + self.meta(features["meta"])))

    images, meta, labels = torch.randn(48, 8), torch.randn(48, 2), torch.randint(0, 3, (48,))

    async def stream(context: BatchContext):
        for start in range(context.rank * 12, 48, 12 * context.nranks):
            batch = slice(start, start + 12)
            yield {"image": images[batch], "meta": meta[batch]}, labels[batch]

    state = lamploop.fit(
        model=lamploop.SupervisedModel(TwoInputs()),
        optimizer_factory=sgd(0.1),
        train_batches=stream,
        max_epochs=2,
        reporters=[],
    )
    assert state.epoch == 2


def _bad_stream(kind: str):
    x, y = torch.randn(4, 2), torch.randint(0, 2, (4,))

    async def stream(context: BatchContext):
        for batch in range(4):
            if context.epoch == 1 and batch == 2:
                if kind == "sizes_differ":
                    yield x, y[:3]
                elif kind == "dict_sizes_differ":
                    yield {"a": x, "b": x[:3]}, y
                elif kind == "single_tensor":
                    yield x
                elif kind == "triple":
                    yield x, y, y
                elif kind == "none":
                    yield None
                elif kind == "empty":
                    yield x[:0], y[:0]
                elif kind == "target_not_tensor":
                    yield x, y.tolist()
            elif kind.startswith("dict"):
                yield {"a": x, "b": x}, y
            else:
                yield x, y

    return stream


class _DictSum(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)

    def forward(self, features):
        if isinstance(features, dict):
            return self.linear(features["a"]) + self.linear(features["b"][: len(features["a"])])
        return self.linear(features)


@pytest.mark.parametrize(
    "kind",
    [
        "sizes_differ",
        "dict_sizes_differ",
        "single_tensor",
        "triple",
        "none",
        "empty",
        "target_not_tensor",
    ],
)
def test_malformed_batch_is_a_batch_error_naming_epoch_and_batch(kind: str) -> None:
    """how-to/custom-batch-streams.md: "A batch whose features and target disagree in size, an
    item that is not a pair, or an empty batch raises `lamploop.errors.BatchError` naming the
    epoch, the batch and the rank." (`features` tensors "have the target's batch size")."""
    recorder = Recorder()
    with pytest.raises(LamploopError) as caught:
        lamploop.fit(
            model=lamploop.SupervisedModel(_DictSum()),
            optimizer_factory=sgd(0.1),
            train_batches=_bad_stream(kind),
            max_epochs=3,
            reporters=[recorder],
        )
    error = caught.value
    assert isinstance(error, BatchError), f"{type(error).__name__}: {error}"
    assert "epoch 1" in str(error), str(error)
    assert "batch 2" in str(error), str(error)
    assert recorder.closed == 1
    assert isinstance(recorder.events[-1], RunFailed)


def test_empty_batch_message_as_documented() -> None:
    """concepts/batch-streams.md: "A factory that returns a plain generator, or a batch with no
    examples, is named where it happens" -- `epoch 0, batch 0: the batch is empty (0
    examples)`; the plain generator's fix is `lamploop.iterable_batches(...)`."""
    x, y = torch.randn(8, 2), torch.randint(0, 2, (8,))

    def plain(context):
        yield x, y

    async def with_an_empty_batch(context):
        yield x[:0], y[:0]

    def run(factory):
        return lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
            optimizer_factory=sgd(0.1),
            train_batches=factory,
            max_epochs=1,
            reporters=[],
        )

    with pytest.raises(ConfigurationError, match="iterable_batches"):
        run(plain)
    with pytest.raises(BatchError, match=r"epoch 0, batch 0: the batch is empty \(0 examples\)"):
        run(with_an_empty_batch)
    assert run(lamploop.iterable_batches(plain)).epoch == 1


@pytest.mark.parametrize("returned", ["list", "tensor", "none"])
def test_factory_returning_a_non_stream_is_a_configuration_error(returned: str) -> None:
    """training.md (usability checks): "a batch factory that returns a plain iterable or
    generator | `ConfigurationError`: "the batch stream is a generator, not an async
    iterable", with the fix"; api/errors: "Every error lamploop raises on purpose derives from
    LamploopError"."""
    x, y = torch.randn(4, 2), torch.randint(0, 2, (4,))
    value = {"list": [(x, y)], "tensor": x, "none": None}[returned]
    with pytest.raises(LamploopError) as caught:
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
            optimizer_factory=sgd(0.1),
            train_batches=lambda context: value,
            max_epochs=1,
            reporters=[],
        )
    if returned == "list":
        assert isinstance(caught.value, ConfigurationError)
        assert "iterable_batches" in str(caught.value)


def test_factory_called_once_per_epoch_with_the_context() -> None:
    """how-to/custom-batch-streams.md: "a function `BatchContext -> async iterable of (features,
    target)`, called once per epoch on every rank"."""
    x, y = torch.randn(16, 2), torch.randint(0, 2, (16,))
    inner = lamploop.tensor_batches(x, y, batch_size=4)
    train_calls: list[BatchContext] = []
    valid_calls: list[BatchContext] = []

    def train(context: BatchContext):
        train_calls.append(context)
        return inner(context)

    def valid(context: BatchContext):
        valid_calls.append(context)
        return inner(context)

    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
        optimizer_factory=sgd(0.1),
        train_batches=train,
        validation_batches=valid,
        max_epochs=3,
        reporters=[],
    )
    assert train_calls == [BatchContext(epoch=e, rank=0, nranks=1) for e in range(3)]
    assert valid_calls == [BatchContext(epoch=e, rank=0, nranks=1) for e in range(3)]


def test_stream_that_awaits_trains_like_one_that_does_not() -> None:
    """concepts/batch-streams.md: "An async generator function is the shortest; it may await
    (read a file in a worker thread, fetch from a queue) between batches."""
    x, y = torch.randn(40, 3).double(), torch.randint(0, 2, (40,))

    def make(wait: bool):
        async def stream(context: BatchContext):
            for start in range(0, 40, 8):
                if wait:
                    await anyio.sleep(0.01)
                    await anyio.to_thread.run_sync(lambda: None)
                yield x[start : start + 8], y[start : start + 8]

        return stream

    results = []
    for wait in (False, True):
        module = double_linear(3, 2)
        state = lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=sgd(0.2),
            train_batches=make(wait),
            max_epochs=2,
            reporters=[],
        )
        results.append((state.learning_curve, [p.detach().clone() for p in module.parameters()]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)


def test_stream_that_raises_fails_the_run_and_closes_reporters() -> None:
    """how-to/custom-reporters.md: "`close()` ... is called once when the run ends, however it
    ends, after the last event"; `RunFailed` has "`error` (`"Type: message"`)"."""
    x, y = torch.randn(4, 2), torch.randint(0, 2, (4,))

    async def stream(context: BatchContext):
        for batch in range(3):
            if context.epoch == 1 and batch == 1:
                raise RuntimeError("disk gone")
            yield x, y

    recorder = Recorder()
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the docs name no type for it
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
            optimizer_factory=sgd(0.1),
            train_batches=stream,
            max_epochs=3,
            reporters=[recorder],
        )
    chain, error = [], caught.value
    while error is not None:
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    assert any("disk gone" in text for text in chain)
    assert isinstance(recorder.events[-1], RunFailed)
    assert re.match(r"^\w+: .*disk gone", recorder.events[-1].error, re.DOTALL), recorder.events[-1].error
    assert recorder.log[-1] == "close"
    assert recorder.closed == 1
    assert kinds(recorder).count(EpochFinished) == 1


def test_no_batches_at_all_is_a_batch_error() -> None:
    """api/batches (EndingBatchStream): "...instead of failing with "the batch streams were
    empty"; one_epoch: "BatchError: ... or no rank had any batch."""

    async def nothing(context: BatchContext):
        return
        yield

    with pytest.raises(BatchError, match="empty"):
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
            optimizer_factory=sgd(0.1),
            train_batches=nothing,
            max_epochs=2,
            reporters=[],
        )


class _EndingStream:
    def __init__(self, batches: list, ended: bool) -> None:
        self.batches, self.ended = batches, ended

    @property
    def source_ended(self) -> bool:
        return self.ended

    async def _iterate(self):
        for batch in self.batches:
            yield batch

    def __aiter__(self):
        return self._iterate()


def test_ending_stream_ends_the_run() -> None:
    """api/batches (EndingBatchStream): "A training epoch in which no rank had a batch and whose
    stream says so ends the run (StreamExhausted) instead of failing"; custom-reporters.md:
    `RunFinished`'s `reason` says "why the run ended before `max_epochs`: ... the end of the
    streams"."""
    x, y = torch.randn(4, 2), torch.randint(0, 2, (4,))

    def factory(context: BatchContext):
        if context.epoch < 2:
            return _EndingStream([(x, y), (x, y)], ended=False)
        return _EndingStream([], ended=True)

    recorder = Recorder()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
        optimizer_factory=sgd(0.1),
        train_batches=factory,
        max_epochs=5,
        reporters=[recorder],
    )
    assert state.epoch == 2
    assert len(state.learning_curve) == 2
    assert lamploop.batches.source_ended(factory(BatchContext(epoch=3)))
    assert isinstance(recorder.events[-1], RunFinished)
    assert recorder.events[-1].reason != ""


@pytest.mark.timeout(60)
def test_uneven_ranks_nothing_dropped_float64() -> None:
    """concepts/batch-streams.md: "ranks may have different numbers of batches (a rank that runs
    out takes part with zero examples until every rank has finished, so nothing hangs and
    nothing is dropped)"; loop: "One optimizer step uses the gradient of *(sum of the losses of
    every example in the step) / (number of those examples)*"."""
    torch.manual_seed(3)
    x, y = torch.randn(14, 3).double(), torch.randn(14, 1).double()
    # rank 0: batches of 4, 4, 4; rank 1: one batch of 2
    plan = {0: [slice(0, 4), slice(4, 8), slice(8, 12)], 1: [slice(12, 14)]}
    seen: list[BatchContext] = []

    def factory(context: BatchContext):
        seen.append(context)

        async def stream():
            for s in plan[context.rank]:
                yield x[s], y[s]

        return stream()

    replicas = [
        (lamploop.SupervisedModel(double_linear(3, 1, seed=5), lamploop.mse_loss), factory, None)
        for _ in range(2)
    ]
    state = anyio.run(
        lambda: lamploop.local_data_parallel_training_loop(
            replicas, sgd(0.1), 1, return_min_validation_loss_model=()
        )
    )
    assert {(c.rank, c.nranks) for c in seen} == {(0, 2), (1, 2)}
    # float64 by hand: step 0 = r0b0 + r1b0, step 1 = r0b1, step 2 = r0b2
    w = double_linear(3, 1, seed=5)
    weight, bias = w.weight.detach().clone(), w.bias.detach().clone()
    total, count = 0.0, 0
    for step in ([slice(0, 4), slice(12, 14)], [slice(4, 8)], [slice(8, 12)]):
        xs, ys = torch.cat([x[s] for s in step]), torch.cat([y[s] for s in step])
        weight.requires_grad_(True)
        bias.requires_grad_(True)
        loss_sum = ((xs @ weight.T + bias - ys) ** 2).sum()
        total, count = total + loss_sum.item(), count + len(ys)
        (loss_sum / len(ys)).backward()
        with torch.no_grad():
            weight, bias = weight - 0.1 * weight.grad, bias - 0.1 * bias.grad
    trained = replicas[0][0].module
    torch.testing.assert_close(trained.weight.detach(), weight.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(trained.bias.detach(), bias.detach(), rtol=1e-12, atol=1e-12)
    assert state.learning_curve[0].training_loss == pytest.approx(total / count, rel=1e-12)


@pytest.mark.timeout(60)
def test_malformed_batch_on_rank_1_names_the_rank() -> None:
    """how-to/custom-batch-streams.md: "...raises `lamploop.errors.BatchError` naming the epoch,
    the batch and the rank."""
    x, y = torch.randn(4, 2), torch.randint(0, 2, (4,))

    def factory(context: BatchContext):
        async def stream():
            for batch in range(3):
                if context.rank == 1 and batch == 1:
                    yield x, y[:2]
                else:
                    yield x, y

        return stream()

    torch.manual_seed(0)
    initial = torch.nn.Linear(2, 2).state_dict()
    replicas = []
    for _ in range(2):
        module = torch.nn.Linear(2, 2)
        module.load_state_dict(initial)
        replicas.append((lamploop.SupervisedModel(module), factory, None))
    with pytest.raises(LamploopError) as caught:
        anyio.run(lambda: lamploop.local_data_parallel_training_loop(replicas, sgd(0.1), 1))
    assert isinstance(caught.value, BatchError), f"{type(caught.value).__name__}: {caught.value}"
    text = str(caught.value)
    assert "epoch 0" in text, text
    assert "batch 1" in text, text
    assert "rank 1" in text, text


# ---------------------------------------------------------------------------------------------
# how-to/custom-reporters.md


def test_reporter_fed_by_hand_doc_example() -> None:
    """how-to/custom-reporters.md: "Events are plain values, so a reporter can be tested without
    training anything." (the `Summary` example, verbatim)."""
    from lamploop import LearningCurveEntry, LoopState

    class Summary:
        def __init__(self, out: io.TextIOBase) -> None:
            self.out = out
            self.lines: list[str] = []
            self.samples = 0

        def report(self, event) -> None:
            match event:
                case RunStarted(nranks=nranks, epoch=epoch, max_epochs=max_epochs):
                    self.lines.append(f"start at epoch {epoch} of {max_epochs} on {nranks} rank(s)")
                case ProgressSampled():
                    self.samples += 1
                case EpochFinished(state=state, seconds=seconds):
                    entry = state.learning_curve[-1]
                    valid = "" if entry.validation_loss is None else f" valid {entry.validation_loss[1]:.3f}"
                    self.lines.append(
                        f"epoch {entry.epoch}: train {entry.training_loss:.3f}{valid} ({seconds:.1f} s)"
                    )
                case CheckpointWritten(path=path):
                    self.lines.append(f"  checkpoint {path}")
                case RunFinished(state=state):
                    self.lines.append(f"done; best epoch {state.min_validation_epoch}")
                case RunStopped(reason=reason) | RunFailed(error=reason):
                    self.lines.append(f"ended early: {reason}")
                case _:
                    pass

        def close(self) -> None:
            self.out.write("\n".join(self.lines) + "\n")

    curve = (LearningCurveEntry(epoch=0, training_loss=0.9, validation_loss=(0.8, 0.8)),)
    after_epoch_0 = LoopState(
        epoch=1,
        last_validation_loss=0.8,
        min_validation_loss=0.8,
        min_validation_epoch=0,
        learning_curve=curve,
    )
    out = io.StringIO()
    summary = Summary(out)
    for event in [
        RunStarted(nranks=1, epoch=0, max_epochs=1),
        EpochStarted(epoch=0, learning_rate_factor=1.0),
        ProgressSampled(
            epoch=0,
            steps_done=1,
            examples=32,
            loss=0.95,
            steps=1,
            seconds_per_step=0.01,
            communication_seconds_per_step=0.0,
            examples_per_second=3200.0,
            total_steps=1,
            total_examples=32,
        ),
        ValidationFinished(epoch=0, loss=0.8),
        EpochFinished(state=after_epoch_0, seconds=1.5, steps=4, examples=128),
        CheckpointWritten(epoch=1, steps_done=0, path="runs/x/epoch-000001"),
        RunFinished(state=after_epoch_0),
        RunStopped(reason="SIGTERM", message="stopped"),
        RunFailed(error="BatchError: bad"),
    ]:
        summary.report(event)
    summary.close()
    assert out.getvalue() == (
        "start at epoch 0 of 1 on 1 rank(s)\n"
        "epoch 0: train 0.900 valid 0.800 (1.5 s)\n"
        "  checkpoint runs/x/epoch-000001\n"
        "done; best epoch 0\n"
        "ended early: SIGTERM\n"
        "ended early: BatchError: bad\n"
    )
    assert summary.samples == 1
    # "Every event also has `time`, the wall-clock `time.time()` when it was made"; frozen values
    event = RunStarted(nranks=1, epoch=0, max_epochs=1)
    assert isinstance(event.time, float)
    assert abs(event.time - __import__("time").time()) < 60
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        event.epoch = 3


def test_reporter_in_a_run_event_sequence_and_fields(tmp_path: Path) -> None:
    """how-to/custom-reporters.md, "The events": "A run on the root produces, in order:
    RunStarted ... for each epoch: EpochStarted, ProgressSampled, ..., ValidationFinished,
    EpochFinished, CheckpointWritten ... RunFinished", with the fields of the table; "`report`
    is called on the root rank's event-loop thread, one event at a time"."""
    torch.manual_seed(0)
    x, y = torch.randn(96, 5), torch.randint(0, 3, (96,))
    module = torch.nn.Linear(5, 3).double()
    initial = {k: v.clone() for k, v in module.state_dict().items()}
    snapshots: list[dict[str, torch.Tensor]] = []
    stream_threads: set[int] = set()
    train_inner = lamploop.tensor_batches(x[:64].double(), y[:64], batch_size=16)

    def train(context: BatchContext):
        async def stream():
            stream_threads.add(threading.get_ident())
            async for batch in train_inner(context):
                yield batch

        return stream()

    recorder = Recorder()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, metrics={"accuracy": accuracy}),
        optimizer_factory=sgd(0.1),
        train_batches=train,
        validation_batches=lamploop.tensor_batches(x[64:].double(), y[64:], batch_size=32, shuffle=False),
        max_epochs=3,
        checkpoint_dir=tmp_path,
        on_epoch=lambda s: snapshots.append({k: v.clone() for k, v in module.state_dict().items()}),
        reporters=[recorder],
    )
    events = recorder.events
    assert recorder.log[0] == "start"
    assert recorder.log[-1] == "close"
    assert recorder.started == recorder.closed == 1
    assert not recorder.overlapped
    assert recorder.threads == stream_threads
    assert len(stream_threads) == 1

    # the grammar, ProgressSampled removed (time-dependent)
    core = [type(e).__name__ for e in events if not isinstance(e, ProgressSampled)]
    per_epoch = ["EpochStarted", "ValidationFinished", "EpochFinished", "CheckpointWritten"]
    assert core == ["RunStarted", *per_epoch * 3, "RunFinished"]
    times = [e.time for e in events]
    assert times == sorted(times)

    started = events[0]
    assert (started.nranks, started.epoch, started.max_epochs) == (1, 0, 3)
    epoch_started = [e for e in events if isinstance(e, EpochStarted)]
    assert [e.epoch for e in epoch_started] == [0, 1, 2]
    assert all(
        e.learning_rate_factor == 1.0 and e.steps_done == 0 and e.examples_done == 0 for e in epoch_started
    )
    assert [e.expected_steps for e in epoch_started] == [None, 4, 4]

    validations = [e for e in events if isinstance(e, ValidationFinished)]
    finished = [e for e in events if isinstance(e, EpochFinished)]
    checkpoints = [e for e in events if isinstance(e, CheckpointWritten)]
    for epoch, (valid, done, checkpoint) in enumerate(zip(validations, finished, checkpoints, strict=True)):
        reference = torch.nn.Linear(5, 3).double()
        reference.load_state_dict(snapshots[epoch])
        assert valid.epoch == epoch
        assert valid.loss == pytest.approx(float64_ce_mean(reference, x[64:], y[64:]), rel=1e-9)
        assert valid.metrics["accuracy"] == pytest.approx(
            float64_accuracy(reference, x[64:], y[64:]), rel=1e-12
        )
        assert valid.loss == done.state.learning_curve[-1].validation_loss[1]
        assert done.state.epoch == epoch + 1
        assert done.state.learning_curve[-1].epoch == epoch
        assert (done.steps, done.examples) == (4, 64)
        assert done.seconds >= 0
        assert (checkpoint.epoch, checkpoint.steps_done) == (epoch + 1, 0)
        assert Path(checkpoint.path).exists()
    assert isinstance(events[-1], RunFinished)
    assert events[-1].state == state
    assert events[-1].reason == ""

    samples = [e for e in events if isinstance(e, ProgressSampled)]
    assert samples, "no ProgressSampled: documented 'after the first step'"
    first = samples[0]
    assert events.index(first) < events.index(finished[0])
    assert (first.epoch, first.steps_done) == (0, 1)
    first_batch_x, first_batch_y = batches_of(train_inner(BatchContext(epoch=0)))[0]
    reference = torch.nn.Linear(5, 3).double()
    reference.load_state_dict(initial)
    assert first.loss == pytest.approx(float64_ce_mean(reference, first_batch_x, first_batch_y), rel=1e-9)


def test_reporter_that_raises_is_logged_and_never_fails_the_run(caplog: pytest.LogCaptureFixture) -> None:
    """how-to/custom-reporters.md: "A reporter that raises in `report` is logged on the
    `lamploop` logger and never fails the run."""

    class Broken:
        def report(self, event) -> None:
            raise RuntimeError("reporter bug 1234")

    recorder = Recorder()
    x, y = torch.randn(16, 2), torch.randint(0, 2, (16,))
    with caplog.at_level(logging.DEBUG, logger="lamploop"):
        state = lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=4),
            max_epochs=2,
            reporters=[Broken(), recorder],
        )
    assert state.epoch == 2
    assert isinstance(recorder.events[-1], RunFinished)
    assert recorder.closed == 1
    records = [r for r in caplog.records if r.name.split(".")[0] == "lamploop"]
    assert any(
        "reporter bug 1234" in r.getMessage() or (r.exc_info and "reporter bug 1234" in str(r.exc_info[1]))
        for r in records
    )


def test_reporter_start_failure_stops_the_run_and_still_closes() -> None:
    """how-to/custom-reporters.md: "A `start()` that fails stops the run before it begins, with
    that error (and `close()` is still called)"."""

    class NeedsAPort:
        def __init__(self) -> None:
            self.events = 0
            self.closed = 0

        def start(self) -> None:
            raise OSError("port 9100 is in use")

        def report(self, event) -> None:
            self.events += 1

        def close(self) -> None:
            self.closed += 1

    batches_made = []
    inner = lamploop.tensor_batches(torch.randn(8, 2), torch.zeros(8, dtype=torch.long), batch_size=4)
    reporter = NeedsAPort()
    with pytest.raises(OSError, match="port 9100 is in use"):
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
            optimizer_factory=sgd(0.1),
            train_batches=lambda context: batches_made.append(context) or inner(context),
            max_epochs=1,
            reporters=[reporter],
        )
    assert reporter.events == 0
    assert batches_made == []
    assert reporter.closed == 1


def test_reporter_closed_once_after_run_failed_on_nan() -> None:
    """how-to/custom-reporters.md: "`close()` ... is called once when the run ends, however it
    ends, after the last event"; "RunFinished | RunStopped | RunFailed" ends the sequence;
    `RunFailed`: "`error` (`"Type: message"`)"."""
    x, y = torch.randn(12, 2), torch.randint(0, 2, (12,))
    x[9, 0] = float("nan")
    recorder = Recorder()
    with pytest.raises(NonFiniteLossError):
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=3, shuffle=False),
            max_epochs=2,
            reporters=[recorder],
        )
    assert recorder.log[-2:] == ["RunFailed", "close"]
    assert recorder.closed == 1
    assert recorder.events[-1].error.startswith("NonFiniteLossError: ")
    assert kinds(recorder)[0] is RunStarted


def test_reporter_without_start_or_close_and_logging_reporter_kept(caplog: pytest.LogCaptureFixture) -> None:
    """how-to/custom-reporters.md: "A reporter is any object with one method"; "`fit(reporters=
    [...])` replaces the default ... list it too to keep it: `reporters=[mine,
    lamploop.LoggingReporter()]`"; training.md: "The `LoggingReporter`'s line for each epoch
    lists the metrics after the losses."""

    class OnlyReport:
        def __init__(self) -> None:
            self.events: list = []

        def report(self, event) -> None:
            self.events.append(event)

    mine = OnlyReport()
    logger = logging.getLogger("acceptance_howto_reporter")
    x, y = torch.randn(16, 2), torch.randint(0, 2, (16,))
    with caplog.at_level(logging.INFO, logger="acceptance_howto_reporter"):
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2), metrics={"accuracy": accuracy}),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=4),
            validation_batches=lamploop.tensor_batches(x, y, batch_size=8),
            max_epochs=2,
            reporters=[mine, lamploop.LoggingReporter(logger)],
        )
    assert type(mine.events[0]) is RunStarted
    assert type(mine.events[-1]) is RunFinished
    lines = [r.getMessage() for r in caplog.records if r.name == "acceptance_howto_reporter"]
    epoch_lines = [line for line in lines if "accuracy" in line]
    assert len(epoch_lines) == 2, lines
    assert all(line.index("loss") < line.index("accuracy") for line in epoch_lines), epoch_lines


def test_reporters_empty_reports_nothing_and_model_summary_on_run_started() -> None:
    """training.md: "The summary is computed once per run ... and travels on the `RunStarted`
    event as `model_summary`" (354 parameters for Linear(8,32), ReLU, Linear(32,2))."""
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    module = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    recorder = Recorder()
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=sgd(0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),
        max_epochs=1,
        reporters=[recorder],
    )
    summary = recorder.events[0].model_summary
    assert summary is not None
    assert (summary.total_parameters, summary.trainable_parameters, summary.non_trainable_parameters) == (
        354,
        354,
        0,
    )
    mine = lamploop.summarize(module)
    assert [(layer.name, layer.parameters) for layer in mine.layers] == [("0", 288), ("1", 0), ("2", 66)]


class _Unhandled(Exception):
    pass


def test_sigterm_stops_with_run_stopped_checkpoint_and_resumes(tmp_path: Path) -> None:
    """getting-started.md: "A run stopped by SIGTERM or Ctrl-C writes a checkpoint at the step
    boundary and raises `lamploop.errors.TrainingInterrupted`; calling `fit` again resumes at
    that step"; custom-reporters.md: `RunStopped` `reason` (`"SIGINT"`, `"SIGTERM"`...)."""
    x, y = torch.randn(48, 3).double(), torch.randint(0, 2, (48,))
    inner = lamploop.tensor_batches(x, y, batch_size=4)
    fire = {"armed": True}

    def train(context: BatchContext):
        async def stream():
            async for index, batch in _aenumerate(inner(context)):
                if fire["armed"] and context.epoch == 1 and index == 5:
                    fire["armed"] = False
                    os.kill(os.getpid(), signal.SIGTERM)
                    await anyio.sleep(0.05)
                yield batch

        return stream()

    def run(directory: Path | None, recorder: Recorder) -> tuple[lamploop.LoopState, torch.nn.Module]:
        module = double_linear(3, 2, seed=1)
        state = lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            train_batches=train,
            max_epochs=3,
            checkpoint_dir=directory,
            reporters=[recorder],
        )
        return state, module

    def raise_unhandled(signum, frame):
        raise _Unhandled("lamploop did not handle SIGTERM")

    previous = signal.signal(signal.SIGTERM, raise_unhandled)
    try:
        stopped = Recorder()
        with pytest.raises(TrainingInterrupted) as caught:
            run(tmp_path, stopped)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "SIGTERM" in str(getattr(caught.value, "reason", caught.value))
    assert isinstance(stopped.events[-1], RunStopped)
    assert stopped.events[-1].reason == "SIGTERM"
    assert stopped.log[-1] == "close"
    assert stopped.closed == 1
    inside = [e for e in stopped.events if isinstance(e, CheckpointWritten) and e.steps_done > 0]
    assert len(inside) == 1
    assert inside[0].epoch == 1
    assert inside[0].steps_done >= 5

    resumed_recorder = Recorder()
    resumed_state, resumed = run(tmp_path, resumed_recorder)
    first_resumed_epoch = next(e for e in resumed_recorder.events if isinstance(e, EpochStarted))
    assert (first_resumed_epoch.epoch, first_resumed_epoch.steps_done) == (1, inside[0].steps_done)
    assert first_resumed_epoch.examples_done == 4 * inside[0].steps_done
    straight_state, straight = run(None, Recorder())
    assert [e.epoch for e in resumed_state.learning_curve] == [0, 1, 2]
    for a, b in zip(resumed_state.learning_curve, straight_state.learning_curve, strict=True):
        assert a.training_loss == pytest.approx(b.training_loss, rel=1e-9)
    for a, b in zip(resumed.parameters(), straight.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


async def _aenumerate(iterable):
    index = 0
    async for item in iterable:
        yield index, item
        index += 1


_FOLLOWER_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    sys.path.insert(0, {tests!r})
    import torch
    import lamploop
    from test_acceptance_docs_howto import _two_rank_fit_arguments

    class FileReporter:
        def __init__(self):
            self.events = 0
            self.started = 0
        def start(self):
            self.started += 1
        def report(self, event):
            self.events += 1
        def close(self):
            name = "follower-" + os.environ.get("LAMPLOOP_RANK", "?") + ".json"
            with open(os.path.join(sys.argv[1], name), "w") as f:
                json.dump({{"events": self.events, "started": self.started, "closed": 1}}, f)

    contexts = []
    result = lamploop.fit(reporters=[FileReporter()], **_two_rank_fit_arguments(sys.argv[1], contexts))
    with open(os.path.join(sys.argv[1], "contexts.json"), "w") as f:
        json.dump({{"contexts": contexts, "result_is_none": result is None}}, f)
    """
)


def _two_rank_data():
    generator = torch.Generator().manual_seed(42)
    x = torch.randn(84, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (84,), generator=generator)
    return x, y


def _two_rank_fit_arguments(out_dir: str, contexts: list) -> dict:
    x, y = _two_rank_data()
    train_inner = lamploop.tensor_batches(x[:52], y[:52], batch_size=8)  # 7 batches: 4 and 3

    def train(context: BatchContext):
        contexts.append([context.epoch, context.rank, context.nranks])
        return train_inner(context)

    torch.manual_seed(7)
    module = torch.nn.Linear(4, 3).double()
    return {
        "model": lamploop.SupervisedModel(module, metrics={"accuracy": accuracy}),
        "optimizer_factory": sgd(0.0),
        "train_batches": train,
        "validation_batches": lamploop.tensor_batches(x[52:], y[52:], batch_size=5, shuffle=False),
        "max_epochs": 2,
        "world_size": 2,
        "launch_command": [sys.executable, str(Path(out_dir) / "follower.py"), out_dir],
        "heartbeat_timeout": 20.0,
    }


@pytest.mark.timeout(90)
def test_two_processes_peer_joined_follower_reporters_and_reduction(tmp_path: Path) -> None:
    """custom-reporters.md: "PeerJoined once per follower (runs of several ranks)"; "`fit` also
    closes the reporters of the other ranks, which get no events"; `ValidationFinished`: "`loss`
    (raw, over every rank)"; metrics.md: "a metric over ranks is the metric of the union"."""
    (tmp_path / "follower.py").write_text(_FOLLOWER_SCRIPT.format(tests=str(Path(__file__).parent)))
    contexts: list = []
    arguments = _two_rank_fit_arguments(str(tmp_path), contexts)
    recorder = Recorder()
    state = lamploop.fit(reporters=[recorder], **arguments)
    assert contexts == [[0, 0, 2], [1, 0, 2]]
    follower = json.loads((tmp_path / "follower-1.json").read_text())
    assert follower["events"] == 0
    assert follower["started"] == 0  # "`start()` ... is called by `fit` on the root"
    assert follower["closed"] == 1
    follower_contexts = json.loads((tmp_path / "contexts.json").read_text())
    assert follower_contexts == {"contexts": [[0, 1, 2], [1, 1, 2]], "result_is_none": True}

    assert recorder.events[0].nranks == 2
    joined = [e for e in recorder.events if isinstance(e, PeerJoined)]
    assert [(e.rank, e.nranks) for e in joined] == [(1, 2)]
    assert kinds(recorder).index(PeerJoined) < kinds(recorder).index(EpochStarted)
    assert recorder.closed == 1
    assert recorder.log[-1] == "close"

    # lr = 0: the weights stay the initial ones, so every number is one float64 evaluation
    x, y = _two_rank_data()
    module = arguments["model"].module
    entry = state.learning_curve[-1]
    assert entry.training_loss == pytest.approx(float64_ce_mean(module, x[:52], y[:52]), rel=1e-12)
    assert raw(entry.training_metrics["accuracy"]) == pytest.approx(
        float64_accuracy(module, x[:52], y[:52]), rel=1e-12
    )
    assert entry.validation_loss[1] == pytest.approx(float64_ce_mean(module, x[52:], y[52:]), rel=1e-12)
    assert entry.validation_metrics["accuracy"][1] == pytest.approx(
        float64_accuracy(module, x[52:], y[52:]), rel=1e-12
    )
    validation = [e for e in recorder.events if isinstance(e, ValidationFinished)][-1]
    assert validation.loss == pytest.approx(entry.validation_loss[1], rel=1e-12)


# ---------------------------------------------------------------------------------------------
# api/metrics.md, api/model.md, training.md "Metrics"


def test_accuracy_and_metrics_of_docstrings() -> None:
    """api/metrics: ">>> correct, n = accuracy(...) ... (2, 3)"; metrics_of: "The metrics a pass's
    result carries (none for a plain ``float``)."""
    correct, n = accuracy(torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), torch.tensor([1, 1, 1]))
    assert (int(correct), n) == (2, 3)
    assert metrics_of(0.5) == {}
    result = PassResult(0.25, {"accuracy": 0.75})
    assert isinstance(result, float)
    assert float(result) == 0.25
    assert metrics_of(result) == {"accuracy": 0.75}


def test_losses_are_sums_float64() -> None:
    """getting-started.md: "a loss that returns `(loss sum, example count)` for a batch:
    `cross_entropy_loss` (the default) and `mse_loss` do, and `lamploop.summed(F.l1_loss)`
    makes one of any PyTorch loss that takes `reduction="sum"`"; api/model (summed): "The
    example count is the target's first dimension."""
    torch.manual_seed(0)
    logits, labels = torch.randn(7, 4, dtype=torch.float64), torch.randint(0, 4, (7,))
    total, count = lamploop.cross_entropy_loss(logits, labels)
    manual = -sum(torch.log_softmax(logits[i], 0)[labels[i]].item() for i in range(7))
    assert count == 7
    assert total.item() == pytest.approx(manual, rel=1e-12)
    assert total.dim() == 0
    prediction, target = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    total, count = lamploop.mse_loss(prediction, target)
    assert count == 5
    assert total.item() == pytest.approx(((prediction - target) ** 2).sum().item(), rel=1e-12)
    total, count = lamploop.summed(F.smooth_l1_loss)(prediction, target)
    assert count == 5
    assert total.item() == pytest.approx(
        F.smooth_l1_loss(prediction, target, reduction="sum").item(), rel=1e-12
    )
    loss_sum, n = lamploop.summed(F.l1_loss)(torch.zeros(3), torch.ones(3))
    assert (float(loss_sum), n) == (3.0, 3)
    model = lamploop.SupervisedModel(torch.nn.Identity())
    assert model.loss_sum_and_count(logits, labels)[1] == 7


@pytest.mark.parametrize(
    "keywords",
    [
        {"module": "not a module"},
        {"module": torch.nn.Linear(2, 2), "loss": 3},
        {"module": torch.nn.Linear(2, 2), "metrics": [accuracy]},
        {"module": torch.nn.Linear(2, 2), "metrics": {1: accuracy}},
        {"module": torch.nn.Linear(2, 2), "metrics": {"accuracy": "accuracy"}},
    ],
    ids=[
        "module_not_module",
        "loss_not_callable",
        "metrics_list",
        "metric_name_not_str",
        "metric_not_callable",
    ],
)
def test_supervised_model_bad_arguments(keywords: dict) -> None:
    """api/model (SupervisedModel): "Raises: ConfigurationError: ``module`` is not a
    ``torch.nn.Module``, ``loss`` is not callable, or ``metrics`` is not a mapping of str names
    to callables."""
    with pytest.raises(ConfigurationError):
        lamploop.SupervisedModel(**keywords)


def test_mean_loss_refused_with_the_fix() -> None:
    """training.md: "a loss that returns a mean (`F.cross_entropy` as the loss) |
    `ConfigurationError`: "the loss cross_entropy returned a tensor of shape (), not (loss sum,
    example count)", with the fix (`lamploop.summed(...)`)"; coming-from-lightning.md: "A loss
    that returns a mean is refused with what to write instead."""
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    with pytest.raises(ConfigurationError) as caught:
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(3, 2), F.cross_entropy),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=4),
            max_epochs=1,
            reporters=[],
        )
    text = str(caught.value)
    assert "the loss cross_entropy returned a tensor of shape ()" in text, text
    assert "summed" in text, text
    with pytest.raises(ConfigurationError):
        lamploop.SupervisedModel(torch.nn.Linear(3, 2), F.cross_entropy).loss_sum_and_count(x, y)


def test_model_error_is_a_batch_error_with_torch_cause() -> None:
    """training.md: "anything the model or loss raises on a batch, e.g. a target of the wrong
    dtype | `BatchError`: "epoch 0, batch 0: the model or its loss failed: RuntimeError:
    expected target dtype to be Long ...", torch's error as the cause"."""
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,)).float()
    with pytest.raises(BatchError) as caught:
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=4),
            max_epochs=1,
            reporters=[],
        )
    assert "epoch 0, batch 0: the model or its loss failed: RuntimeError" in str(caught.value)
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_one_epoch_metrics_are_means_over_examples_float64() -> None:
    """training.md: "`one_epoch` still returns the mean loss, a `float`; with metrics it is a
    `lamploop.metrics.PassResult` whose `.metrics` holds each metric's mean"; api/metrics: "with
    the means of the model's metrics over every example"."""
    torch.manual_seed(0)
    x, y = torch.randn(30, 4, dtype=torch.float64), torch.randint(0, 3, (30,))
    module = torch.nn.Linear(4, 3).double()

    def mean_max_logit(output: torch.Tensor, target: torch.Tensor):
        return output.max(dim=1).values.sum(), len(target)

    model = lamploop.SupervisedModel(module, metrics={"accuracy": accuracy, "max_logit": mean_max_logit})
    batches = lamploop.tensor_batches(x, y, batch_size=7)  # 7, 7, 7, 7, 2: batch means would differ
    result = anyio.run(
        lambda: lamploop.one_epoch(model=model, batches=batches(BatchContext(epoch=0)), forward_only=True)
    )
    assert isinstance(result, PassResult)
    assert isinstance(result, float)
    assert float(result) == pytest.approx(float64_ce_mean(module, x, y), rel=1e-12)
    assert result.metrics["accuracy"] == pytest.approx(float64_accuracy(module, x, y), rel=1e-12)
    with torch.no_grad():
        assert result.metrics["max_logit"] == pytest.approx(
            module(x).max(dim=1).values.mean().item(), rel=1e-12
        )
    plain = anyio.run(
        lambda: lamploop.one_epoch(
            model=lamploop.SupervisedModel(module), batches=batches(BatchContext(epoch=0)), forward_only=True
        )
    )
    assert type(plain) is float or metrics_of(plain) == {}


def test_metric_sees_the_loss_output_under_no_grad() -> None:
    """training.md: "named metrics beside its loss, each `(output, target) -> (sum over the
    batch's examples, number of examples)`, computed under `torch.no_grad()` on the output the
    loss saw, in training and validation passes"."""
    loss_outputs: list[int] = []
    metric_calls: list[tuple[int, bool]] = []

    def loss(output, target):
        loss_outputs.append(id(output))
        return F.cross_entropy(output, target, reduction="sum"), len(target)

    def metric(output, target):
        metric_calls.append((id(output), torch.is_grad_enabled()))
        return output.sum(), len(target)

    x, y = torch.randn(12, 3), torch.randint(0, 2, (12,))
    state = lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(3, 2), loss, metrics={"m": metric}),
        optimizer_factory=sgd(0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=4),
        validation_batches=lamploop.tensor_batches(x, y, batch_size=6),
        max_epochs=1,
        reporters=[],
    )
    assert len(metric_calls) == 3 + 2
    assert [i for i, _ in metric_calls] == loss_outputs
    assert not any(grad for _, grad in metric_calls)
    entry = state.learning_curve[0]
    assert set(entry.training_metrics) == {"m"}
    assert set(entry.validation_metrics) == {"m"}
    assert entry.validation_metrics["m"][0] == entry.validation_metrics["m"][1]  # smoothing factor 1


@pytest.mark.timeout(60)
def test_metrics_over_three_uneven_ranks_are_the_union_float64() -> None:
    """training.md: "a metric over ranks is exactly the metric of the union of their examples
    (... 3 uneven ranks)"; "Every `LearningCurveEntry` records `training_metrics` and
    `validation_metrics` (`(smoothed, raw)`"."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(60, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (60,), generator=generator)
    train_plan = {0: [(0, 3), (3, 10)], 1: [(10, 27)], 2: [(27, 29), (29, 33), (33, 40)]}
    valid_plan = {0: [(40, 41)], 1: [(41, 52), (52, 55)], 2: [(55, 60)]}

    def factory(plan):
        def make(context: BatchContext):
            async def stream():
                for a, b in plan[context.rank]:
                    yield x[a:b], y[a:b]

            return stream()

        return make

    def max_logit(output, target):
        return output.max(dim=1).values.sum(), len(target)

    replicas = []
    for _ in range(3):
        module = double_linear(4, 3, seed=9)
        model = lamploop.SupervisedModel(module, metrics={"accuracy": accuracy, "max_logit": max_logit})
        replicas.append((model, factory(train_plan), factory(valid_plan)))
    state = anyio.run(lambda: lamploop.local_data_parallel_training_loop(replicas, sgd(0.0), 1))
    reference = double_linear(4, 3, seed=9)
    entry = state.learning_curve[0]
    tx, ty, vx, vy = x[:40], y[:40], x[40:], y[40:]
    assert entry.training_loss == pytest.approx(float64_ce_mean(reference, tx, ty), rel=1e-12)
    assert entry.validation_loss[1] == pytest.approx(float64_ce_mean(reference, vx, vy), rel=1e-12)
    assert raw(entry.training_metrics["accuracy"]) == pytest.approx(
        float64_accuracy(reference, tx, ty), rel=1e-12
    )
    assert entry.validation_metrics["accuracy"][1] == pytest.approx(
        float64_accuracy(reference, vx, vy), rel=1e-12
    )
    with torch.no_grad():
        expected = reference(vx).max(dim=1).values.mean().item()
    assert entry.validation_metrics["max_logit"][1] == pytest.approx(expected, rel=1e-12)


def test_training_metrics_are_means_and_validation_metrics_smoothed_raw_pairs() -> None:
    """training.md: "Every `LearningCurveEntry` records `training_metrics` (each metric's mean over
    the epoch's training examples, a float, as `training_loss` is) and `validation_metrics`
    (`(smoothed, raw)`, smoothed like the validation loss)"."""
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    state = lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(3, 2), metrics={"accuracy": accuracy}),
        optimizer_factory=sgd(0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=4),
        validation_batches=lamploop.tensor_batches(x, y, batch_size=8),
        max_epochs=1,
        reporters=[],
    )
    entry = state.learning_curve[0]
    assert isinstance(entry.validation_metrics["accuracy"], tuple)
    assert len(entry.validation_metrics["accuracy"]) == 2
    assert isinstance(entry.training_metrics["accuracy"], float)
    assert 0.0 <= entry.training_metrics["accuracy"] <= 1.0


def test_model_selection_by_accuracy_doc_example() -> None:
    """training.md: "`model_selection_metric="accuracy", model_selection_mode="max"` ... picks the
    best model by the largest smoothed validation accuracy ...; `LoopState.min_validation_loss`
    then holds that best value"."""
    torch.manual_seed(0)
    x, y = torch.randn(96, 5), torch.randint(0, 3, (96,))
    module = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, metrics={"accuracy": accuracy}),
        optimizer_factory=lambda params: torch.optim.Adam(params, lr=0.01),
        train_batches=lamploop.tensor_batches(x[:64], y[:64], batch_size=16),
        validation_batches=lamploop.tensor_batches(x[64:], y[64:], batch_size=16, shuffle=False),
        max_epochs=3,
        model_selection_metric="accuracy",
        model_selection_mode="max",
        reporters=[],
    )
    best = max(range(3), key=lambda e: state.learning_curve[e].validation_metrics["accuracy"][0])
    assert state.min_validation_epoch == best
    assert state.min_validation_loss == state.learning_curve[best].validation_metrics["accuracy"][0]
    # the module ends holding the best epoch's model: its validation accuracy is the best one
    with torch.no_grad():
        final_accuracy = (module(x[64:]).argmax(dim=1) == y[64:]).double().mean().item()
    assert final_accuracy == pytest.approx(
        state.learning_curve[best].validation_metrics["accuracy"][1], abs=1e-9
    )


def test_model_selection_metric_unknown_is_a_configuration_error() -> None:
    """api fit: "model_selection_metric ...: the model's ``metrics`` must have it"."""
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    with pytest.raises(ConfigurationError, match="accurcy"):
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(3, 2), metrics={"accuracy": accuracy}),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=4),
            validation_batches=lamploop.tensor_batches(x, y, batch_size=4),
            max_epochs=1,
            model_selection_metric="accurcy",
            reporters=[],
        )


# ---------------------------------------------------------------------------------------------
# getting-started.md


def test_getting_started_first_fit_keeps_best_model() -> None:
    """getting-started.md: "When training ends, `module` holds the weights of the best validation
    epoch (every epoch is eligible by default"."""
    torch.manual_seed(0)
    x = torch.randn(240, 8)
    y = (x[:, 0] + x[:, 1] > 0).long()
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    snapshots: list[dict[str, torch.Tensor]] = []
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, lamploop.cross_entropy_loss),
        # a large rate, so that the last epoch need not be the best one
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
        train_batches=lamploop.tensor_batches(x[:192], y[:192], batch_size=32),
        validation_batches=lamploop.tensor_batches(x[192:], y[192:], batch_size=48, shuffle=False),
        max_epochs=5,
        on_epoch=lambda s: snapshots.append({k: v.clone() for k, v in module.state_dict().items()}),
        reporters=[],
    )
    assert state.epoch == 5
    assert len(snapshots) == 5
    best = state.min_validation_epoch
    losses = [entry.validation_loss[0] for entry in state.learning_curve]
    assert best == losses.index(min(losses))
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, snapshots[best][name]), name


def test_getting_started_checkpoint_resume(tmp_path: Path) -> None:
    """getting-started.md: "`max_epochs` counts the epochs in all, so a second call with a larger
    `max_epochs` trains only the new ones"."""
    x, y = torch.randn(128, 6), torch.randint(0, 2, (128,))
    calls: list[int] = []
    inner = lamploop.tensor_batches(x, y, batch_size=32)

    def train(directory: Path, max_epochs: int) -> lamploop.LoopState:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        return lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            train_batches=lambda context: calls.append(context.epoch) or inner(context),
            max_epochs=max_epochs,
            checkpoint_dir=directory,
            reporters=[],
        )

    first = train(tmp_path, 2)
    assert Path(lamploop.latest_checkpoint(tmp_path)).name == "epoch-000002"
    second = train(tmp_path, 4)
    assert calls == [0, 1, 2, 3]
    assert [entry.epoch for entry in second.learning_curve] == [0, 1, 2, 3]
    assert second.learning_curve[:2] == first.learning_curve


def _fit_arguments(**changes) -> dict:
    x, y = torch.randn(8, 4), torch.zeros(8, dtype=torch.long)
    arguments = {
        "model": lamploop.SupervisedModel(torch.nn.Linear(4, 2)),
        "optimizer_factory": sgd(0.1),
        "train_batches": lamploop.tensor_batches(x, y, batch_size=4),
        "max_epochs": 1,
        "reporters": [],
    }
    arguments.update(changes)
    return arguments


_X8, _Y8 = torch.randn(8, 4), torch.zeros(8, dtype=torch.long)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"model": torch.nn.Linear(4, 2)}, "torch.nn.Module (Linear)"),
        (
            {"optimizer_factory": torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)},
            "optimizer_factory",
        ),
        ({"train_batches": _X8}, "train_batches"),
        ({"train_batches": [(_X8, _Y8)]}, "train_batches"),
        ({"train_batches": DataLoader(TensorDataset(_X8, _Y8), batch_size=4)}, "train_batches"),
        ({"validation_batches": _X8}, "validation_batches"),
        ({"world_size": 0}, "world_size"),
        ({"precision": "bf16-mixed"}, "precision"),
        ({"max_epochs": -1}, "max_epochs"),
    ],
    ids=[
        "bare_module",
        "optimizer_instance",
        "tensor_as_batches",
        "list_as_batches",
        "dataloader_as_batches",
        "tensor_as_validation",
        "world_size_0",
        "lightning_precision",
        "max_epochs_negative",
    ],
)
def test_fit_checks_arguments_before_anything_starts(changes: dict, named: str) -> None:
    """getting-started.md: "a bare `nn.Module` as the model, an optimizer instead of a factory,
    or tensors instead of a batch factory raise `lamploop.errors.ConfigurationError` saying what
    to pass instead"; training.md adds "a list or a `DataLoader` as the batch factory ...
    `world_size` below 1"."""
    recorder = Recorder()
    with pytest.raises(ConfigurationError) as caught:
        lamploop.fit(**_fit_arguments(**changes, reporters=[recorder]))
    assert named in str(caught.value), str(caught.value)
    assert recorder.events == []


def test_fit_cuda_without_cuda() -> None:
    """training.md: "`device="cuda"` where CUDA is not available" is a ConfigurationError."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ConfigurationError, match="cuda"):
        lamploop.fit(**_fit_arguments(device="cuda"))


def test_optimizer_factory_returning_a_non_optimizer() -> None:
    """coming-from-lightning.md: "`optimizer_factory=lambda params: torch.optim.AdamW(params,
    lr=...)` | checked before the first step"."""
    with pytest.raises(ConfigurationError, match="optimizer"):
        lamploop.fit(**_fit_arguments(optimizer_factory=lambda params: list(params)))


# ---------------------------------------------------------------------------------------------
# coming-from-lightning.md and training.md


def test_lightning_script_as_lamploop() -> None:
    """coming-from-lightning.md, "A Lightning script, as lamploop" (verbatim): summarize,
    lr_find (leaves the module as it was), fit with clipping and early stopping."""
    torch.manual_seed(0)
    x, y = torch.randn(256, 8), torch.randint(0, 3, (256,))
    module = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    summary = lamploop.summarize(module)
    assert summary.total_parameters == 8 * 32 + 32 + 32 * 3 + 3
    before = {k: v.clone() for k, v in module.state_dict().items()}
    found = lamploop.lr_find(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
        train_batches=lamploop.tensor_batches(x[:192], y[:192], batch_size=16),
        num_steps=40,
    )
    assert all(torch.equal(module.state_dict()[k], v) for k, v in before.items())
    lowest = found.lrs[found.losses.index(min(found.losses))]
    assert found.suggestion == lowest / 10
    state = lamploop.fit(
        model=lamploop.SupervisedModel(
            module, lamploop.summed(F.cross_entropy), metrics={"accuracy": lamploop.accuracy}
        ),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=found.suggestion, momentum=0.9),
        train_batches=lamploop.tensor_batches(x[:192], y[:192], batch_size=16),
        validation_batches=lamploop.tensor_batches(x[192:], y[192:], batch_size=64, shuffle=False),
        max_epochs=3,
        max_gradient_norm=1.0,
        early_stopping_patience=5,
        reporters=[],
    )
    assert state is not None
    assert state.epoch == 3
    assert set(state.learning_curve[-1].validation_metrics) == {"accuracy"}


def test_lightning_names_exist() -> None:
    """coming-from-lightning.md table: `strategy="all_reduce_fp16"`, `"powersgd4"`,
    `"local_sgd8"`, `"diloco8"`; `averaging=lamploop.swa(...)` / `lamploop.ema(decay)`;
    `lamploop.summarize(module)`; `lamploop.lr_find`; `ALL_EPOCHS`."""
    names = set(lamploop.strategy_names())
    assert {"all_reduce_fp16", "powersgd4", "local_sgd8", "diloco8"} <= names
    for name in (
        "ema",
        "swa",
        "summarize",
        "lr_find",
        "ALL_EPOCHS",
        "LoggingReporter",
        "fit",
        "one_epoch",
        "epochs",
    ):
        assert hasattr(lamploop, name), name
    from lamploop.reporting import MetricsFileReporter, ProgressReporter  # noqa: F401


def test_loop_state_is_plain_frozen_data() -> None:
    """coming-from-lightning.md: "**State is data.** `fit` returns a `LoopState` (frozen attrs,
    JSON through cattrs)"."""
    from lamploop.state import converter

    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    state = lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(3, 2), metrics={"accuracy": accuracy}),
        optimizer_factory=sgd(0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=4),
        validation_batches=lamploop.tensor_batches(x, y, batch_size=8),
        max_epochs=2,
        reporters=[],
    )
    assert isinstance(state, lamploop.LoopState)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        state.epoch = 7
    text = json.dumps(converter.unstructure(state))
    assert converter.structure(json.loads(text), lamploop.LoopState) == state


@pytest.mark.timeout(60)
def test_ranks_times_accumulation_equals_one_big_batch_float64() -> None:
    """coming-from-lightning.md: "`R` ranks x `k` accumulated batches of `b` train like one batch
    of `R*k*b`"; `accumulate_grad_batches=4` is `accumulate_gradient_over_n_batches=4`."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(48, 3, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 2, (48,), generator=generator)

    def two_ranks_k2_b4() -> torch.nn.Module:
        # unshuffled batches of 4 dealt to 2 ranks; with k=2, step s gets batches 4s..4s+3
        batches = lamploop.tensor_batches(x, y, batch_size=4, shuffle=False)
        replicas = [(lamploop.SupervisedModel(double_linear(3, 2, seed=4)), batches, None) for _ in range(2)]
        anyio.run(
            lambda: lamploop.local_data_parallel_training_loop(
                replicas, sgd(0.3), 2, accumulate_gradient_over_n_batches=2
            )
        )
        return replicas[0][0].module

    def one_rank(batch_size: int, k: int) -> torch.nn.Module:
        module = double_linear(3, 2, seed=4)
        lamploop.fit(
            model=lamploop.SupervisedModel(module),
            optimizer_factory=sgd(0.3),
            train_batches=lamploop.tensor_batches(x, y, batch_size=batch_size, shuffle=False),
            max_epochs=2,
            accumulate_gradient_over_n_batches=k,
            reporters=[],
        )
        return module

    manual = double_linear(3, 2, seed=4)
    optimizer = torch.optim.SGD(manual.parameters(), lr=0.3)
    for _ in range(2):
        for start in range(0, 48, 16):
            optimizer.zero_grad()
            F.cross_entropy(manual(x[start : start + 16]), y[start : start + 16]).backward()
            optimizer.step()
    for candidate in (two_ranks_k2_b4(), one_rank(16, 1), one_rank(4, 4)):
        for a, b in zip(candidate.parameters(), manual.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_epoch_that_ends_mid_group_still_steps() -> None:
    """loop (linked from concepts/batch-streams.md): "an epoch that ends mid-group still steps with
    what it has"."""
    steps: list[int] = []

    def factory(params):
        optimizer = torch.optim.SGD(params, lr=0.1)
        step = optimizer.step
        optimizer.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]
        return optimizer

    recorder = Recorder()
    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
        optimizer_factory=factory,
        train_batches=lamploop.tensor_batches(torch.randn(20, 3), torch.randint(0, 2, (20,)), batch_size=4),
        max_epochs=1,
        accumulate_gradient_over_n_batches=2,
        reporters=[recorder],
    )
    assert len(steps) == 3
    assert [e.steps for e in recorder.events if isinstance(e, EpochFinished)] == [3]


def test_gradient_clipping_matches_clip_grad_norm_float64() -> None:
    """training.md: "`max_gradient_norm=` ... clips each step's gradient to that global L2 norm, as
    `torch.nn.utils.clip_grad_norm_` does ... The norm is computed over all parameters of the
    model together."""
    generator = torch.Generator().manual_seed(2)
    x = 10 * torch.randn(24, 5, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (24,), generator=generator)
    module = double_linear(5, 3, seed=6)
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=sgd(0.5),
        train_batches=lamploop.tensor_batches(x, y, batch_size=8, shuffle=False),
        max_epochs=1,
        max_gradient_norm=0.25,
        reporters=[],
    )
    manual = double_linear(5, 3, seed=6)
    optimizer = torch.optim.SGD(manual.parameters(), lr=0.5)
    norms = []
    for start in range(0, 24, 8):
        optimizer.zero_grad()
        F.cross_entropy(manual(x[start : start + 8]), y[start : start + 8]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(manual.parameters(), 0.25)))
        optimizer.step()
    assert max(norms) > 0.25  # the clip did something
    for a, b in zip(module.parameters(), manual.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_ema_averaging_float64() -> None:
    """training.md: "`averaging=lamploop.averaging.ema(decay)` keeps an exponential moving average
    of the weights, updated after every optimizer step ... (the first update copies the
    weights ...) ... At the end of the run the model holds the average"."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(32, 4, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (32,), generator=generator)
    module = double_linear(4, 3, seed=8)
    after_steps: list[list[torch.Tensor]] = []

    def factory(params):
        params = list(params)
        optimizer = torch.optim.SGD(params, lr=0.2)
        step = optimizer.step

        def stepping(*a, **k):
            result = step(*a, **k)
            after_steps.append([p.detach().clone() for p in params])
            return result

        optimizer.step = stepping
        return optimizer

    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=factory,
        train_batches=lamploop.tensor_batches(x, y, batch_size=8),
        max_epochs=2,
        averaging=lamploop.ema(0.9),
        reporters=[],
    )
    assert len(after_steps) == 8
    average = [t.clone() for t in after_steps[0]]
    for weights in after_steps[1:]:
        average = [0.9 * a + 0.1 * w for a, w in zip(average, weights, strict=True)]
    for p, a in zip(module.parameters(), average, strict=True):
        torch.testing.assert_close(p.detach(), a, rtol=1e-12, atol=1e-12)


def test_early_stopping_counts_validations_without_a_new_best() -> None:
    """coming-from-lightning.md: "`early_stopping_patience=3` | counts validations without a new
    best"; custom-reporters.md: `RunFinished` `reason`: "early stopping"."""
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    recorder = Recorder()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
        optimizer_factory=sgd(0.0),  # the validation loss never improves after epoch 0
        train_batches=lamploop.tensor_batches(x, y, batch_size=4),
        validation_batches=lamploop.tensor_batches(x, y, batch_size=8, shuffle=False),
        max_epochs=10,
        early_stopping_patience=2,
        reporters=[recorder],
    )
    assert state.epoch == 3
    assert state.min_validation_epoch == 0
    assert isinstance(recorder.events[-1], RunFinished)
    assert "early stopping" in recorder.events[-1].reason


def test_on_epoch_called_after_every_epoch() -> None:
    """coming-from-lightning.md: "callbacks (`on_train_epoch_end`, ...) | `on_epoch=lambda state:
    ...`"; fit: "on_epoch: called with the LoopState after every epoch (rank 0)"."""
    seen: list[lamploop.LoopState] = []
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    state = lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
        optimizer_factory=sgd(0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=4),
        max_epochs=3,
        on_epoch=seen.append,
        reporters=[],
    )
    assert [s.epoch for s in seen] == [1, 2, 3]
    assert seen[-1] == state


def test_fit_inside_a_running_event_loop() -> None:
    """training.md: "`fit` sees the running loop and runs the training on a thread of its own ...:
    a cell that calls `fit` works as in a script and returns the state."""
    import asyncio

    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))

    async def cell():
        return lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(4, 2)),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=8),
            max_epochs=2,
            reporters=[],
        )

    assert asyncio.run(cell()).epoch == 2


def _rate_recording_sgd(rates: list[float], lr: float = 0.1):
    class RecordingSGD(torch.optim.SGD):
        def step(self, closure=None):
            rates.append(self.param_groups[0]["lr"])
            return super().step(closure)

    return lambda params: RecordingSGD(params, lr=lr)


def test_step_schedule_doc_example() -> None:
    """training.md: "the step's learning rate is `base_lr * epoch factor * step factor`"; the
    warmup_cosine example: `rates[:2] == [0.05, 0.1] and rates[-1] < 0.01`."""
    from lamploop.schedules import warmup_cosine

    torch.manual_seed(0)
    x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))
    rates: list[float] = []
    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(5, 3)),
        optimizer_factory=_rate_recording_sgd(rates),
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),
        max_epochs=3,
        step_schedule=warmup_cosine(warmup_steps=2, total_steps=12, steps_per_epoch=4),
        reporters=[],
    )
    assert len(rates) == 12
    assert rates[:2] == [0.05, 0.1]
    assert rates[-1] < 0.01
    assert all(a >= b for a, b in itertools.pairwise(rates[1:]))


class _NanAt:
    def factor(self, epoch: int, step: int) -> float:
        return float("nan") if (epoch, step) == (1, 1) else 1.0


def test_step_schedule_nan_factor_names_epoch_and_step() -> None:
    """training.md: "Any object with `factor(epoch, step)` will do; a factor that is NaN, infinite
    or negative is a `ConfigurationError` naming the epoch and step."""
    with pytest.raises(ConfigurationError) as caught:
        lamploop.fit(**_fit_arguments(max_epochs=2, step_schedule=_NanAt()))
    text = str(caught.value)
    assert re.search(r"epoch\D{0,3}1\b", text), text
    assert re.search(r"step\D{0,3}1\b", text), text


def test_torch_lr_scheduler_per_epoch_and_per_step() -> None:
    """training.md: "stepped after every optimizer step (`lr_scheduler_interval="step"`) or after
    every training epoch (`"epoch"`, the default)"; "combined with ... a `step_schedule` it is a
    `ConfigurationError`"."""
    from torch.optim.lr_scheduler import OneCycleLR, StepLR

    torch.manual_seed(0)
    x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))
    optimizers: list[torch.optim.Optimizer] = []

    def keep(params):
        optimizers.append(torch.optim.SGD(params, lr=0.1))
        return optimizers[-1]

    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(5, 3)),
        optimizer_factory=keep,
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),
        max_epochs=3,
        lr_scheduler=lambda optimizer: StepLR(optimizer, step_size=1, gamma=0.5),
        reporters=[],
    )
    assert abs(optimizers[0].param_groups[0]["lr"] - 0.1 * 0.5**3) < 1e-12

    rates: list[float] = []
    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(5, 3)),
        optimizer_factory=_rate_recording_sgd(rates),
        train_batches=lamploop.tensor_batches(x, y, batch_size=16),
        max_epochs=2,
        lr_scheduler=lambda optimizer: OneCycleLR(optimizer, max_lr=0.5, total_steps=8),
        lr_scheduler_interval="step",
        reporters=[],
    )
    hand = torch.optim.SGD(torch.nn.Linear(5, 3).parameters(), lr=0.1)
    scheduler = OneCycleLR(hand, max_lr=0.5, total_steps=8)
    expected = []
    for _ in range(8):
        expected.append(hand.param_groups[0]["lr"])
        hand.step()
        scheduler.step()
    assert rates == pytest.approx(expected, rel=1e-12)

    from lamploop.schedules import warmup_cosine

    with pytest.raises(ConfigurationError):
        lamploop.fit(
            **_fit_arguments(
                lr_scheduler=lambda optimizer: StepLR(optimizer, step_size=1),
                step_schedule=warmup_cosine(warmup_steps=1, total_steps=4, steps_per_epoch=2),
            )
        )


@pytest.mark.parametrize(
    "keywords",
    [{"min_lr": 1.0, "max_lr": 0.1}, {"num_steps": 1}, {"divergence_threshold": 1.0}, {"smoothing": 1.0}],
    ids=["min_above_max", "num_steps_1", "threshold_1", "smoothing_1"],
)
def test_lr_find_bad_arguments(keywords: dict) -> None:
    """training.md: "Bad arguments (`min_lr >= max_lr`, `num_steps < 2`, a threshold not above 1,
    a smoothing outside `[0, 1)`...) are a `ConfigurationError` before anything runs."""
    asked: list[BatchContext] = []
    inner = lamploop.tensor_batches(torch.randn(8, 2), torch.zeros(8, dtype=torch.long), batch_size=4)
    with pytest.raises(ConfigurationError):
        lamploop.lr_find(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
            optimizer_factory=sgd(0.1),
            train_batches=lambda context: asked.append(context) or inner(context),
            **keywords,
        )
    assert asked == []


def test_summarize_partly_frozen_and_shared() -> None:
    """training.md: "A module that is partly frozen says `partly`; a parameter shared by two
    modules counts in both rows and once in the totals."""
    first, second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    second.weight = first.weight  # shared: 9 parameters in both rows
    partly = torch.nn.Linear(3, 2)
    partly.bias.requires_grad_(False)
    module = torch.nn.Sequential(first, torch.nn.ReLU(), second, partly)
    summary = lamploop.summarize(module)
    rows = {layer.name: layer for layer in summary.layers}
    assert rows["0"].parameters == 12
    assert rows["2"].parameters == 12
    assert rows["3"].parameters == 8
    assert summary.total_parameters == 9 + 3 + 3 + 8
    assert summary.non_trainable_parameters == 2
    assert summary.trainable_parameters == 21
    row_3 = [line for line in summary.lines() if line.split()[:2] == ["3", "Linear"]]
    assert len(row_3) == 1
    assert "partly" in row_3[0]


def test_progress_samples_and_step_boundary_checkpoints(tmp_path: Path) -> None:
    """custom-reporters.md: `ProgressSampled` "every 0.5 s of training, and after the first step",
    `loss` "(mean since the previous sample, or `None`)"; `CheckpointWritten` "inside the epoch,
    when a step-boundary checkpoint is written", before `ValidationFinished` and `EpochFinished`."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 3).double(), torch.randint(0, 2, (32,))
    step_losses: list[tuple[float, int]] = []

    def loss(output, target):
        total = F.cross_entropy(output, target, reduction="sum")
        if torch.is_grad_enabled():
            step_losses.append((total.item(), len(target)))
        return total, len(target)

    async def slow(context: BatchContext):
        for start in range(0, 32, 4):
            await anyio.sleep(0.1)
            yield x[start : start + 4], y[start : start + 4]

    recorder = Recorder()
    lamploop.fit(
        model=lamploop.SupervisedModel(double_linear(3, 2), loss),
        optimizer_factory=sgd(0.1),
        train_batches=slow,
        validation_batches=lamploop.tensor_batches(x, y, batch_size=12, shuffle=False),
        max_epochs=2,
        checkpoint_dir=tmp_path,
        checkpoint_every_n_steps=2,
        reporters=[recorder],
    )
    samples = [e for e in recorder.events if isinstance(e, ProgressSampled)]
    assert len(samples) >= 3  # 8 steps of 0.1 s per epoch: after step 1, and about 0.5 s later
    previous_total, previous_epoch = 0, 0
    for sample in samples:
        if sample.epoch != previous_epoch:  # samples belong to an epoch: a new one starts afresh
            previous_total, previous_epoch = 8 * sample.epoch, sample.epoch
        since = step_losses[previous_total : sample.total_steps]
        assert sample.steps == len(since)
        expected = sum(total for total, _ in since) / sum(n for _, n in since)
        assert sample.loss == pytest.approx(expected, rel=1e-12)
        assert sample.steps_done == sample.total_steps - 8 * sample.epoch
        previous_total = sample.total_steps
    assert (samples[0].epoch, samples[0].steps_done, samples[0].steps) == (0, 1, 1)
    assert any(sample.steps > 1 for sample in samples)
    # the order inside each epoch
    for epoch in range(2):
        start = next(
            i for i, e in enumerate(recorder.events) if isinstance(e, EpochStarted) and e.epoch == epoch
        )
        valid = next(
            i for i, e in enumerate(recorder.events) if isinstance(e, ValidationFinished) and e.epoch == epoch
        )
        inside = [e for e in recorder.events[start:valid] if isinstance(e, CheckpointWritten)]
        assert [(e.epoch, e.steps_done) for e in inside][:2] == [(epoch, 2), (epoch, 4)]
        assert all(e.path for e in inside)


class _EpochRecordingSampler(SequentialSampler):
    def __init__(self, data) -> None:
        super().__init__(data)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


@pytest.mark.parametrize("sampler_kind", ["subset_random", "weighted_random"])
def test_dataloader_batches_seeds_generator_samplers(sampler_kind: str) -> None:
    """api/batches (dataloader_batches): "a sampler with a ``generator`` attribute
    (``RandomSampler``, ``SubsetRandomSampler``, ``WeightedRandomSampler``) gets one seeded from
    ``(seed, epoch)``"; "Every epoch's order is a pure function of ``(seed, epoch)``"."""
    from torch.utils.data import SubsetRandomSampler, WeightedRandomSampler

    def loader() -> DataLoader:
        if sampler_kind == "subset_random":
            sampler = SubsetRandomSampler(list(range(1, 11, 2)))
        else:
            sampler = WeightedRandomSampler([1.0] * 11, num_samples=8, replacement=True)
        return DataLoader(_DATA, batch_size=2, sampler=sampler)

    orders = {}
    for epoch in range(2):
        torch.manual_seed(epoch)
        first = flat(targets_of(lamploop.dataloader_batches(loader(), seed=3), BatchContext(epoch=epoch)))
        torch.manual_seed(100 + epoch)
        again = flat(targets_of(lamploop.dataloader_batches(loader(), seed=3), BatchContext(epoch=epoch)))
        assert first == again
        shares = [
            flat(targets_of(lamploop.dataloader_batches(loader(), seed=3), BatchContext(epoch, r, 2)))
            for r in range(2)
        ]
        assert shares[0] == first[0::2]
        assert shares[1] == first[1::2]
        orders[epoch] = first
    if sampler_kind == "subset_random":
        assert sorted(orders[0]) == [1, 3, 5, 7, 9]
    assert orders[0] != orders[1]


def test_dataloader_batches_set_epoch_and_collate_kept() -> None:
    """api/batches (dataloader_batches): "a sampler with ``set_epoch`` gets the epoch"; "in a
    loader with the same batch size, collate function, workers and pinning"."""
    sampler = _EpochRecordingSampler(_DATA)

    def collate(items):
        return {"x": torch.stack([f for f, _ in items])}, torch.stack([t for _, t in items])

    factory = lamploop.dataloader_batches(
        DataLoader(_DATA, batch_size=2, sampler=sampler, collate_fn=collate)
    )
    batches = batches_of(factory(BatchContext(epoch=4)))
    assert 4 in sampler.epochs
    assert all(isinstance(features, dict) for features, _ in batches)
    shared = batches_of(factory(BatchContext(epoch=5, rank=1, nranks=2)))
    assert 5 in sampler.epochs
    assert all(isinstance(features, dict) for features, _ in shared)
    assert [t.tolist() for _, t in shared] == [[1, 3], [5, 7], [9]]


def test_resumed_run_started_event_says_where() -> None:
    """custom-reporters.md: `RunStarted` has "`epoch` (where it starts or resumes)"."""
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    with tempfile.TemporaryDirectory() as directory:
        for max_epochs, expected in ((2, 0), (3, 2)):
            recorder = Recorder()
            lamploop.fit(
                model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
                optimizer_factory=sgd(0.1),
                train_batches=lamploop.tensor_batches(x, y, batch_size=4),
                max_epochs=max_epochs,
                checkpoint_dir=directory,
                reporters=[recorder],
            )
            started = recorder.events[0]
            assert (started.epoch, started.max_epochs) == (expected, max_epochs)
            assert kinds(recorder).count(EpochFinished) == max_epochs - expected


def test_validation_frequency_events() -> None:
    """custom-reporters.md: "ValidationFinished      epochs that validate"; fit:
    ``validation_frequency``: "validate in epochs ``e`` with ``e % frequency == 0``"."""
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    recorder = Recorder()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
        optimizer_factory=sgd(0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=4),
        validation_batches=lamploop.tensor_batches(x, y, batch_size=8),
        validation_frequency=2,
        max_epochs=3,
        reporters=[recorder],
    )
    assert [e.epoch for e in recorder.events if isinstance(e, ValidationFinished)] == [0, 2]
    assert [entry.validation_loss is not None for entry in state.learning_curve] == [True, False, True]


@pytest.mark.parametrize("kind", ["empty", "none", "sizes_differ", "triple"])
def test_malformed_validation_batch_is_a_batch_error(kind: str) -> None:
    """how-to/custom-batch-streams.md: "A batch whose features and target disagree in size, an
    item that is not a pair, or an empty batch raises `lamploop.errors.BatchError` naming the
    epoch, the batch and the rank." (here in the validation stream)."""
    x, y = torch.randn(4, 2), torch.randint(0, 2, (4,))
    bad = {"empty": (x[:0], y[:0]), "none": None, "sizes_differ": (x, y[:3]), "triple": (x, y, y)}[kind]

    async def valid(context: BatchContext):
        for batch in range(3):
            yield bad if (context.epoch, batch) == (1, 1) else (x, y)

    with pytest.raises(BatchError, match="epoch 1, batch 1"):
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(2, 2)),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=2),
            validation_batches=valid,
            max_epochs=2,
            reporters=[],
        )


def test_metric_returning_per_example_values_is_refused() -> None:
    """api/metrics: a Metric is "``(output, target) -> (sum of per-example values, number of
    examples)``"; api/errors: "Each message names the offending value and where it came from";
    api/model: a loss returning a non-0-dim sum is a ConfigurationError (a metric returning a
    bare tensor is one too: "the metric 'm' returned a tensor of shape (), not (sum, count)")."""
    x, y = torch.randn(10, 3), torch.randint(0, 2, (10,))  # batches of 4, 4, 2

    def per_example_max(output: torch.Tensor, target: torch.Tensor):
        return output.max(dim=1).values, len(target)  # forgot .sum()

    with pytest.raises(ConfigurationError, match=r"the metric 'max' returned a sum of shape \(4,\)"):
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(3, 2), metrics={"max": per_example_max}),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=4),
            max_epochs=1,
            reporters=[],
        )


def test_metric_that_raises_is_named_where_it_happens() -> None:
    """training.md: "What can only be seen once training runs is named where it happens": "anything
    the model or loss raises on a batch ... | `BatchError`: "epoch 0, batch 0: ...", torch's error
    as the cause" (metrics run "on the output the loss saw", as part of the SupervisedModel)."""
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))

    def broken(output: torch.Tensor, target: torch.Tensor):
        raise ZeroDivisionError("metric bug")

    with pytest.raises(BatchError, match="epoch 0, batch 0") as caught:
        lamploop.fit(
            model=lamploop.SupervisedModel(torch.nn.Linear(3, 2), metrics={"broken": broken}),
            optimizer_factory=sgd(0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=4),
            max_epochs=1,
            reporters=[],
        )
    assert isinstance(caught.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize(
    "arguments", [(1.5, 0), ("7", 0), (7, 0.5)], ids=["seed_float", "seed_str", "part_float"]
)
def test_epoch_seed_non_int_is_a_configuration_error(arguments: tuple) -> None:
    """api/batches (epoch_seed): "A 63-bit seed mixed from ``seed`` and ``parts``" ("Raises:
    ConfigurationError: a negative seed or part"); api/errors: "Errors about bad arguments also
    derive from ValueError ... Each message names the offending value"."""
    with pytest.raises(ConfigurationError):
        epoch_seed(*arguments)


def _collate_with_worker_id(items):
    from torch.utils.data import get_worker_info

    worker = get_worker_info()
    features = torch.stack([f for f, _ in items])
    return features, torch.full((len(items),), -1 if worker is None else worker.id)


def test_dataloader_batches_keeps_workers() -> None:
    """concepts/loop.md (linked from batch-streams.md): "the batch size, collate function, workers
    and pinning are kept"."""
    loader = DataLoader(_DATA, batch_size=2, num_workers=2, collate_fn=_collate_with_worker_id)
    shared = batches_of(lamploop.dataloader_batches(loader)(BatchContext(epoch=0, rank=1, nranks=2)))
    workers = {int(target[0]) for _, target in shared}
    assert workers == {0, 1}
    assert [len(target) for _, target in shared] == [2, 2, 1]
