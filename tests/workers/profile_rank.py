"""One rank of a Gloo run of ``one_epoch`` with the profiler and the step breakdown on.

``python tests/workers/profile_rank.py RANK NRANKS PORT OUT_DIR [--data-sleep S]``: joins a
Gloo group over a store on 127.0.0.1:PORT (rank 0 opens it), trains EPOCHS epochs of
STEPS steps, each epoch on the rank's one worker thread as a real run does
(:func:`lamploop.distributed.worker.worker_runner`), with a :class:`StepProfiler` spanning
the epochs, and writes ``OUT_DIR/breakdown-rank<R>.json`` (the summed step breakdown).
``--data-sleep``: this rank's stream sleeps that long before each batch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import attrs
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from lamploop import SupervisedModel, one_epoch  # noqa: E402
from lamploop.distributed.process_group import new_process_group  # noqa: E402
from lamploop.distributed.worker import open_rank_thread, worker_runner  # noqa: E402
from lamploop.loop.profiler import Profile, StepProfiler  # noqa: E402
from lamploop.loop.step_timing import StepTimes  # noqa: E402
from lamploop.sync.collectives import AbortSignal  # noqa: E402
from lamploop.sync.group_channel import ProcessGroupChannel  # noqa: E402

EPOCHS, STEPS, BATCH = 2, 4, 8


def batches(rank: int, epoch: int, sleep: float) -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 * epoch + rank)

    async def stream() -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(STEPS):
            if sleep > 0:
                await anyio.sleep(sleep)
            x = torch.randn(BATCH, 16, generator=generator)
            yield x, (x.sum(dim=1) > 0).long()

    return stream()


async def main(rank: int, nranks: int, port: int, out_dir: Path, sleep: float) -> None:
    store = dist.TCPStore(
        "127.0.0.1", port, nranks, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    device = torch.device("cpu")
    group = new_process_group(store, rank=rank, nranks=nranks, device=device, timeout=60, prefix="profile")
    channel = ProcessGroupChannel.of_group(group, rank=rank, nranks=nranks, device=device, timeout=60)
    torch.manual_seed(0)  # the same initial parameters on every rank
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    model = SupervisedModel(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    # Steps 2, 3 and 4 are recorded: the window spans the end of epoch 0.
    profile = Profile(out_dir=out_dir / "traces", wait=1, warmup=1, active=3)
    profiler = StepProfiler(profile, rank=rank, device=device)
    times = StepTimes()
    async with open_rank_thread(AbortSignal()) as thread:
        run_epoch = worker_runner(thread)
        for epoch in range(EPOCHS):

            async def train(epoch: int = epoch) -> float:
                return await one_epoch(
                    model=model,
                    batches=batches(rank, epoch, sleep),
                    channel=channel,
                    step_optimizer=optimizer.step,
                    epoch=epoch,
                    step_times=times,
                    profiler=profiler,
                )

            await run_epoch(train)
    profiler.close()  # on the event loop's thread, as open_replica does
    breakdown = attrs.asdict(times.snapshot())
    (out_dir / f"breakdown-rank{rank}.json").write_text(json.dumps(breakdown))
    channel.close(abandon=False)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("rank", type=int)
    parser.add_argument("nranks", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--data-sleep", type=float, default=0.0)
    args = parser.parse_args()
    anyio.run(main, args.rank, args.nranks, args.port, args.out_dir, args.data_sleep)
