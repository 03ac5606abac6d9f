"""A streamed run of several ranks, each with its own buffer, for tests/streaming/test_stream_ranks.py.

    python tests/workers/stream_ranks.py CHECKPOINT_DIR LOG_PREFIX POLICY COUNTS [EXTRAS_ON]

Run as rank 0 it starts the other ranks itself (``fit(world_size=len(COUNTS))``).  Each
rank ``r`` fills its buffer from an in-process producer ``p<r>`` with ``COUNTS[r]`` samples
(comma-separated, one count per rank, so the streams are uneven), slowly, then closes
it; a resumed rank restores its buffer from CHECKPOINT_DIR first and its producer resends
from the restored buffer's acknowledged position (what a transport's producer does).
Every read is appended to ``LOG_PREFIX.rank<r>.<pid>`` as ``<epoch> <producer> <seq>``,
flushed at once.  POLICY is ``fifo`` (each sample read once) or ``firo`` (twice).
EXTRAS_ON (default: every rank) lists the ranks that pass checkpoint extras.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
import torch

import lamploop
from lamploop.batches import BatchContext
from lamploop.distributed.launch import launch_env
from lamploop.streaming import FifoBuffer, FiroBuffer, Sample, StreamState, buffer_batches
from lamploop.streaming.batches import stack_samples

BATCH_SIZE = 4
BATCHES_PER_EPOCH = 2
PUT_SECONDS = 0.01
BATCH_SECONDS = 0.03  # each batch is slowed down a little, so that the run takes a while


async def main(argv: Sequence[str]) -> None:
    checkpoint_dir, log_prefix, policy, counts_text, *rest = argv
    counts = [int(c) for c in counts_text.split(",")]
    extras_on = {int(r) for r in rest[0].split(",")} if rest else set(range(len(counts)))
    env = launch_env()
    rank = env.rank if env is not None else 0
    epoch = [-1]
    log = open(f"{log_prefix}.rank{rank}.{os.getpid()}", "a", buffering=1, encoding="utf-8")  # noqa: ASYNC230, SIM115

    def on_read(key: tuple[str, int], seen: int) -> None:
        log.write(f"{epoch[0]} {key[0]} {key[1]}\n")
        log.flush()

    kind, max_reads = {"fifo": (FifoBuffer, 1), "firo": (FiroBuffer, 2)}[policy]
    buffer = kind(capacity=12, watermark=4, seed=rank, max_reads=max_reads, on_read=on_read)
    stream = StreamState(buffer)
    acknowledged = stream.restore(checkpoint_dir) if rank in extras_on else {}
    name = f"p{rank}"

    async def produce() -> None:
        for seq in range(acknowledged.get(name, -1) + 1, counts[rank]):
            x = torch.tensor([float(rank), float(seq) / 10, 1.0])
            await buffer.put(Sample(name, seq, {"x": x, "y": x[:1] * 0.5 + 0.1}))
            await anyio.sleep(PUT_SECONDS)
        buffer.close()

    stack = stack_samples()

    def collate(samples: Sequence[Sample]) -> Any:
        time.sleep(BATCH_SECONDS)
        return stack(samples)

    batches = buffer_batches(
        buffer, batch_size=BATCH_SIZE, batches_per_epoch=BATCHES_PER_EPOCH, collate=collate
    )

    def train_batches(context: BatchContext) -> AsyncIterator[Any]:
        epoch[0] = context.epoch
        return batches(context)

    torch.manual_seed(0)
    model = lamploop.SupervisedModel(torch.nn.Linear(3, 1), lamploop.mse_loss)
    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        state = await lamploop.fit_async(
            model=model,
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.01),
            train_batches=train_batches,
            max_epochs=10**6,  # the streams decide
            checkpoint_dir=checkpoint_dir,
            keep_last=None,
            checkpoint_extras={"stream": stream} if rank in extras_on else None,
            reporters=[],
            world_size=len(counts),
            heartbeat_timeout=10.0,
        )
    if state is not None:
        print(f"finished at epoch {state.epoch}", flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
