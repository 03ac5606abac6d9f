"""Two ranks trained by fit with a strategy that keeps state, for tests/sync/test_sync_state.py.

    python tests/workers/stateful_strategy.py STRATEGY CHECKPOINT_DIR MAX_EPOCHS

Run as rank 0 it starts rank 1 itself.  Deterministic data, split unevenly over the ranks
(rank 1 has fewer batches); resumes from CHECKPOINT_DIR's latest checkpoint when there is one.
"""

from __future__ import annotations

import sys

import torch

import lamploop
from lamploop.batches import BatchContext, BatchStream


def batches(context: BatchContext) -> BatchStream:
    generator = torch.Generator().manual_seed(1000 * context.epoch + context.rank)
    count = 6 if context.rank == 0 else 4
    x = torch.randn(count * 8, 16, generator=generator, dtype=torch.float64)
    y = (x[:, :4].sum(dim=1) > 0).long()
    return lamploop.tensor_batches(x, y, batch_size=8, shuffle=False)(BatchContext(epoch=context.epoch))


def main(strategy: str, checkpoint_dir: str, max_epochs: int) -> None:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)).double()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, lamploop.cross_entropy_loss),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        train_batches=batches,
        max_epochs=max_epochs,
        checkpoint_dir=checkpoint_dir,
        keep_last=None,
        strategy=strategy,
        world_size=2,
        reporters=[],
    )
    if state is not None:
        print(f"finished at epoch {state.epoch}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
