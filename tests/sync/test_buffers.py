"""BatchNorm buffers are alike on every rank after each training pass (real Gloo groups).

Floating buffers become their mean over the ranks, integer ones (``num_batches_tracked``)
the root's; before, each rank kept statistics of its own batches only, and the root's
(checkpointed) statistics ignored the other ranks' data.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
import torch

import lamploop
from lamploop.batches import BatchContext

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def _module(rank: int) -> torch.nn.Module:
    torch.manual_seed(3 + rank)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2)).double()


def _batches(context: BatchContext) -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 * context.epoch + context.rank)
    shift = 3.0 * context.rank  # each rank's data has another mean: unsynced statistics differ

    async def stream() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(4):
            x = torch.randn(8, 4, generator=generator, dtype=torch.float64) + shift
            yield x, torch.randint(0, 2, (8,), generator=generator)

    return stream()


async def _one_rank_stats(rank: int) -> torch.Tensor:
    """The running mean a rank would end epoch 0 with on its own (same start as the root)."""
    module = _module(0)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)  # statistics only: parameters stay
    await lamploop.one_epoch(
        model=lamploop.SupervisedModel(module),
        batches=_batches(BatchContext(epoch=0, rank=rank, nranks=3)),
        step_optimizer=optimizer.step,
    )
    return module[1].running_mean.clone()


@pytest.mark.parametrize("strategy", ["all_reduce", "reduce_to_root"])
async def test_buffers_are_the_mean_over_the_ranks(strategy: str) -> None:
    modules = [_module(rank) for rank in range(3)]
    with anyio.fail_after(50):
        await lamploop.local_data_parallel_training_loop(
            [(lamploop.SupervisedModel(m), _batches, None) for m in modules],
            lambda params: torch.optim.SGD(params, lr=0.0),
            1,
            strategy=strategy,
        )
    for name, buffer in modules[0].named_buffers():
        for other in modules[1:]:
            assert torch.equal(dict(other.named_buffers())[name], buffer), name
    alone = [await _one_rank_stats(rank) for rank in range(3)]
    assert not torch.allclose(alone[0], alone[2], atol=0.5)  # the ranks' own statistics differ a lot
    torch.testing.assert_close(modules[0][1].running_mean, sum(alone) / 3, rtol=0, atol=1e-12)
    assert int(modules[0][1].num_batches_tracked) == 4
