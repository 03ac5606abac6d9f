"""Two ranks of ``fit`` where rank 1 gets SIGTERM as its last validation batch is drawn.

    python tests/workers/stop_at_validation_end.py OUT_DIR

``fit(world_size=2)`` starts rank 1 itself (this script again).  At epoch 1, rank 1's
validation stream sends SIGTERM to its own process as it yields its last batch: the request
is heard in the validation pass's sum, before the control channel can carry its reason to
the root.  Rank 0 prints the ``TrainingInterrupted`` message and its reason, and exits with
143 after a stop by SIGTERM (130 by anything else); rank 1 writes ``follower-1.json`` and
exits with 0 once ``fit`` returns.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import torch

import lamploop
from lamploop.batches import BatchContext, BatchStream
from lamploop.distributed.launch import launch_env

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script: ``workers.records`` from tests/
    sys.path.insert(0, str(HERE.parent))

from workers.records import save_record  # noqa: E402

STOP_EPOCH = 1
VALIDATION_BATCHES = 4
SCRIPT = Path(__file__).resolve()


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
    return x, (x.sum(dim=1) > 0).long()


def _train(context: BatchContext) -> BatchStream:
    async def batches() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(4):
            yield _batch(1000 * context.epoch + 10 * context.rank + i)

    return batches()


def _validation(context: BatchContext) -> BatchStream:
    async def batches() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(VALIDATION_BATCHES):
            last = i == VALIDATION_BATCHES - 1
            if last and context.rank == 1 and context.epoch == STOP_EPOCH:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler sets the request: the pass goes on
            yield _batch(-1 - 10 * context.rank - i)

    return batches()


async def main(out: Path) -> int:
    env = launch_env()
    rank = env.rank if env is not None else 0
    torch.manual_seed(0)
    try:
        state = await lamploop.fit_async(
            model=lamploop.SupervisedModel(torch.nn.Linear(4, 2), lamploop.cross_entropy_loss),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=_train,
            validation_batches=_validation,
            max_epochs=5,
            checkpoint_dir=out / "checkpoints",
            reporters=[],
            world_size=2,
            launch_command=[sys.executable, str(SCRIPT), str(out)],
        )
    except lamploop.errors.TrainingInterrupted as exc:
        print(f"rank {rank} at {time.time():.3f}: {exc} (reason {exc.reason!r})", file=sys.stderr, flush=True)
        return 143 if exc.reason == "SIGTERM" else 130
    if state is None:
        save_record({"rank": rank}, out / f"follower-{rank}.json")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(anyio.run(main, Path(sys.argv[1])))
