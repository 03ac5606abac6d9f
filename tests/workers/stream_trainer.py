"""A streamed trainer that checkpoints its stream, for tests/streaming/test_stream_resume.py.

    python tests/workers/stream_trainer.py PORT CHECKPOINT_DIR READS_LOG POLICY PRODUCERS...

Restores the stream from CHECKPOINT_DIR's latest checkpoint (if any) before it opens its
receiver on 127.0.0.1:PORT, then trains (resuming) until the producers are done and the
buffer is drained.  Every read from the buffer is appended to READS_LOG as
``<epoch> <producer> <seq>``, flushed at once (a SIGKILL loses none of them).  POLICY is
``fifo`` (each sample read once) or ``firo`` (twice).  The token is LAMPLOOP_STREAM_TOKEN.
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
from lamploop.streaming import FifoBuffer, FiroBuffer, Sample, StreamState, buffer_batches
from lamploop.streaming.batches import stack_samples

BATCH_SIZE = 4
BATCHES_PER_EPOCH = 2
BATCH_SECONDS = 0.04  # each batch is slowed down a little, so that the run takes a while


async def main(argv: Sequence[str]) -> None:
    port, checkpoint_dir, log_path, policy, *names = argv
    epoch = [-1]
    log = open(log_path, "a", buffering=1, encoding="utf-8")  # noqa: ASYNC230, SIM115 (lives with the process)

    def on_read(key: tuple[str, int], seen: int) -> None:
        log.write(f"{epoch[0]} {key[0]} {key[1]}\n")
        log.flush()

    kind = {"fifo": (FifoBuffer, 1), "firo": (FiroBuffer, 2)}[policy]
    buffer = kind[0](capacity=16, watermark=8, seed=0, max_reads=kind[1], on_read=on_read)
    stream = StreamState(buffer)
    stream.restore(checkpoint_dir)  # before the receiver opens
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
    token = os.environ["LAMPLOOP_STREAM_TOKEN"]
    async with (
        stream.open_receiver(token=token, producers=names, port=int(port)) as receiver,
        anyio.create_task_group() as tg,
    ):

        async def end_of_stream() -> None:
            await receiver.wait_all_done()
            buffer.close()

        tg.start_soon(end_of_stream)
        state = await lamploop.fit_async(
            model=model,
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.01),
            train_batches=train_batches,
            max_epochs=10**6,
            checkpoint_dir=checkpoint_dir,
            keep_last=None,
            checkpoint_extras={"stream": stream},
            reporters=[],
            world_size=1,
        )
    assert state is not None
    print(f"finished at epoch {state.epoch}, {buffer.read_total} reads", flush=True)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1:])
