"""Training on a stream: batches drawn from a buffer while a producer task fills it."""

from __future__ import annotations

from collections import Counter
from typing import Any

import anyio
import pytest
import torch

import lamploop
from lamploop.errors import ConfigurationError
from lamploop.streaming.batches import buffer_batches
from lamploop.streaming.buffers import FifoBuffer, FiroBuffer
from lamploop.streaming.sample import Sample


def _sample(i: int) -> Sample:
    generator = torch.Generator().manual_seed(i)
    x = torch.randn(4, generator=generator)
    return Sample("sim", i, {"x": x, "y": (x.sum() > 0).long()})


async def _produce(buffer: Any, count: int) -> None:
    for i in range(count):
        await buffer.put(_sample(i))
        if i % 25 == 0:
            await anyio.sleep(0.001)  # a producer that takes its time
    buffer.close()


def _train(buffer: Any, *, samples: int, batch_size: int, batches_per_epoch: int) -> lamploop.LoopState:
    async def main() -> lamploop.LoopState | None:
        torch.manual_seed(0)
        model = lamploop.SupervisedModel(torch.nn.Linear(4, 2), lamploop.cross_entropy_loss)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_produce, buffer, samples)
            return await lamploop.fit_async(
                model=model,
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                train_batches=buffer_batches(
                    buffer, batch_size=batch_size, batches_per_epoch=batches_per_epoch
                ),
                max_epochs=1000,  # the stream decides
                reporters=[],
                world_size=1,
            )

    state = anyio.run(main)
    assert state is not None
    return state


@pytest.mark.timeout(60)
def test_every_sample_is_trained_on_once_and_the_run_ends_with_the_stream() -> None:
    reads: Counter[tuple[str, int]] = Counter()
    buffer = FifoBuffer(capacity=64, watermark=16, seed=0, on_read=lambda key, _: reads.update([key]))
    state = _train(buffer, samples=1005, batch_size=10, batches_per_epoch=20)
    # 1005 samples, 200 an epoch: 5 full epochs and one of 5 samples (one short batch).
    assert state.epoch == 6
    assert reads == Counter({("sim", i): 1 for i in range(1005)})
    assert state.learning_curve[-1].training_loss < state.learning_curve[0].training_loss


@pytest.mark.timeout(60)
def test_pseudo_epochs_read_each_sample_max_reads_times() -> None:
    reads: Counter[tuple[str, int]] = Counter()
    buffer = FiroBuffer(
        capacity=64, watermark=32, seed=3, max_reads=3, on_read=lambda key, _: reads.update([key])
    )
    state = _train(buffer, samples=300, batch_size=10, batches_per_epoch=30)
    assert sorted(set(reads.values())) == [3]
    assert len(reads) == 300
    assert state.epoch == 3  # 900 reads, 300 an epoch


def test_a_batch_larger_than_the_buffer_is_refused() -> None:
    buffer = FifoBuffer(capacity=8, watermark=8, seed=0)

    async def make() -> None:
        buffer_batches(buffer, batch_size=9, batches_per_epoch=1)

    with pytest.raises(ConfigurationError, match="exceeds the buffer's capacity 8"):
        anyio.run(make)
