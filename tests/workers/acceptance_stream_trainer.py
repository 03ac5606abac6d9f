"""A trainer whose receiver runs on its own thread, waiting for samples, for a stop by SIGTERM.

    python tests/workers/acceptance_stream_trainer.py OUT_DIR MODE

``fit`` trains on a ``FifoBuffer`` through ``buffer_batches`` (batches of 4), with the buffer's
``StreamState`` as a checkpoint extra and its receiver opened by
``stream.open_receiver(..., own_thread=True)`` (docs/streaming.md "Receiving off the
training's thread", "When no sample comes").  ``MODE``:

- ``empty``: no producer ever connects: the first pass waits for its first batch;
- ``stalled``: an ``AsyncProducer`` in this process sends 12 samples (3 batches) and then
  stalls without Done: the pass trains those, then waits;
- ``flowing``: that producer never stops sending (the FIFO buffer is full, its puts wait on the
  receiver's thread): a stop while samples flow.

``OUT_DIR/waiting.json`` appears once the trainer waits (``empty``: the training pass asked the
buffer for its first batch; ``stalled``, ``flowing``: the third batch was drawn).  Not before:
a signal during ``fit``'s set-up (its first optimizer imports ``torch._dynamo``, seconds on a
loaded machine) would time the set-up, not the stop of a run that waits.  After ``TrainingInterrupted``,
the receiver's block is left and ``OUT_DIR/result.json`` gets the ids trained on, the error's
message and when it came, and the threads still alive; the exit status is 143 after SIGTERM
(130 after SIGINT), 0 if ``fit`` returned (which it must not: nothing closes the buffer).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

import lamploop
from lamploop.streaming import FifoBuffer, Sample, StreamState, buffer_batches, stack_samples
from lamploop.streaming.producer import AsyncProducer

BATCH = 4
STALLED_SAMPLES = 12


def _write(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


class _Recording(torch.nn.Module):
    """A linear layer that records ``x[:, 0]`` (the sample ids) of every batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.trained: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.trained.extend(int(v) for v in x[:, 0].tolist())
        out: torch.Tensor = self.linear(x)
        return out


def _sample(ident: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(ident)
    x = torch.cat([torch.tensor([float(ident)]), torch.randn(3, generator=generator)])
    return {"x": x, "y": (x[1:].sum() > 0).long()}


class _SaysWhenAsked(FifoBuffer):
    """A FIFO buffer that writes ``waiting.json`` when first asked for a batch (``empty``)."""

    def __init__(self, out: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._out = out
        self._asked = False

    async def get_batch(self, n: int) -> list[Sample]:
        if not self._asked:
            self._asked = True
            _write(self._out / "waiting.json", {"asked": n})
        return await super().get_batch(n)


async def main(out: Path, mode: str) -> int:
    torch.manual_seed(0)
    token = secrets.token_hex(16)
    options: dict[str, Any] = {"capacity": 32, "watermark": 1, "seed": 0}
    buffer = _SaysWhenAsked(out, **options) if mode == "empty" else FifoBuffer(**options)
    stream = StreamState(buffer)
    stream.restore(out / "checkpoints")
    module = _Recording()
    drawn = 0
    stack = stack_samples()

    def collate(samples: Sequence[Sample]) -> Any:
        nonlocal drawn
        batch = stack(samples)
        drawn += 1
        if mode != "empty" and drawn == STALLED_SAMPLES // BATCH:
            _write(out / "waiting.json", {"drawn": drawn})
        return batch

    async def producer_task(address: tuple[str, int]) -> None:
        async with AsyncProducer(address, name="sim", token=token) as producer:
            for ident in range(STALLED_SAMPLES if mode == "stalled" else 2**24):
                await producer.send(_sample(ident))
            await anyio.sleep_forever()  # the simulation stalls: no Done, the buffer stays open

    status = 0
    message = ""
    interrupted_at = 0.0
    async with (
        stream.open_receiver(token=token, producers=["sim"], own_thread=True) as receiver,
        anyio.create_task_group() as tg,
    ):
        if mode != "empty":
            tg.start_soon(producer_task, receiver.address)
        try:
            await lamploop.fit_async(
                model=lamploop.SupervisedModel(module, lamploop.cross_entropy_loss),
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                train_batches=buffer_batches(
                    buffer, batch_size=BATCH, batches_per_epoch=100, collate=collate
                ),
                max_epochs=10,
                checkpoint_dir=out / "checkpoints",
                checkpoint_extras={"stream": stream},
                reporters=[],
            )
        except lamploop.errors.TrainingInterrupted as exc:
            interrupted_at = time.time()
            message = str(exc)
            status = 143 if exc.reason == "SIGTERM" else 130
        tg.cancel_scope.cancel()
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    result = {"trained": module.trained, "message": message, "at": interrupted_at, "threads": threads}
    _write(out / "result.json", result)
    return status


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(anyio.run(main, Path(sys.argv[1]), sys.argv[2]))
