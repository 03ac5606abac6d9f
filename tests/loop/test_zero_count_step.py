"""A step whose loss counts no example is refused where it happens, not taken for the end of the pass."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import torch

import lamploop
from lamploop.errors import BatchError

pytestmark = pytest.mark.anyio


async def test_a_step_whose_loss_counts_no_example_mid_epoch_is_refused_not_the_end_of_the_epoch() -> None:
    """A count of 0 ended the pass like an ended stream: the batches after it were silently dropped."""
    module = torch.nn.Linear(3, 2)
    seen: list[int] = []

    def masked_loss(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        seen.append(len(seen))
        count = 0 if len(seen) == 2 else int(target.shape[0])  # the second batch: all masked
        return torch.nn.functional.cross_entropy(output, target, reduction="sum") * bool(count), count

    async def batches() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(4):
            yield torch.randn(4, 3), torch.randint(0, 2, (4,))

    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(BatchError, match=r"epoch 5, batch 1, rank 0: the loss counted 0 examples"):
        await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module, loss=masked_loss),
            batches=batches(),
            step_optimizer=optimizer.step,
            epoch=5,
        )
    assert seen == [0, 1]  # refused at that step, not after the other batches were dropped
