"""A trainer that waits for samples: ``fit`` over a ``FifoBuffer`` that no producer fills (enough).

    python tests/workers/stop_waiting.py OUT_DIR NRANKS MODE

Every rank (``fit`` starts ranks ``1..NRANKS-1`` itself, running this script again) trains on
its own ``FifoBuffer`` through ``buffer_batches``, checkpointing into ``OUT_DIR/checkpoints``.
``MODE``:

- ``empty``: no producer at all: the first pass waits for its first batch;
- ``stalled``: a producer puts ``STALLED_BATCHES`` batches into each rank's buffer, then
  stalls (it never closes the buffer): the pass trains those, then waits.

Each rank writes ``OUT_DIR/waiting-<rank>.json`` once it waits for a batch that will not
come (its stream asked for more samples than were put), so that the test knows when to
signal.  Rank 0 exits with 143 after a SIGTERM stop (130 after SIGINT), printing the
``TrainingInterrupted`` message; a follower writes ``follower-<rank>.json`` and exits with 0.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import torch

import lamploop
from lamploop.batches import BatchContext
from lamploop.distributed.launch import launch_env
from lamploop.streaming import FifoBuffer, Sample, buffer_batches

BATCH = 4
STALLED_BATCHES = 3


def _write(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _sample(seq: int) -> Sample:
    generator = torch.Generator().manual_seed(seq)
    x = torch.randn(4, generator=generator)
    return Sample("sim", seq, {"x": x, "y": (x.sum() > 0).long()})


class _Marked:
    """The buffer's stream; writes ``waiting-<rank>.json`` when asking for a batch beyond those put."""

    def __init__(self, inner: Any, marker: Path, available: int) -> None:
        self._inner, self._marker, self._available = inner, marker, available

    @property
    def source_ended(self) -> bool:
        return bool(self._inner.source_ended)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[Any]:
        drawn = 0
        iterator = aiter(self._inner)
        while True:
            if drawn == self._available:
                _write(self._marker, {"at": time.time(), "drawn": drawn, "pid": os.getpid()})
            batch = await anext(iterator, None)
            if batch is None:
                return
            drawn += 1
            yield batch


SCRIPT = Path(__file__).resolve()


async def main(out: Path, nranks: int, mode: str) -> int:
    env = launch_env()
    rank = env.rank if env is not None else 0
    torch.manual_seed(rank)
    buffer = FifoBuffer(capacity=64, watermark=1, seed=rank)
    available = STALLED_BATCHES if mode == "stalled" else 0
    for seq in range(available * BATCH):
        await buffer.put(_sample(seq))
    batches = buffer_batches(buffer, batch_size=BATCH, batches_per_epoch=1000)

    def marked(context: BatchContext) -> Any:
        return _Marked(batches(context), out / f"waiting-{rank}.json", available)

    extra: dict[str, Any] = {}
    if nranks > 1:
        command = [sys.executable, str(SCRIPT), str(out), str(nranks), mode]
        extra = {"world_size": nranks, "launch_command": command}
    try:
        state = await lamploop.fit_async(
            model=lamploop.SupervisedModel(torch.nn.Linear(4, 2), lamploop.cross_entropy_loss),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=marked,
            max_epochs=10,
            checkpoint_dir=out / "checkpoints",
            reporters=[],
            **extra,
        )
    except lamploop.errors.TrainingInterrupted as exc:
        print(f"rank {rank} at {time.time():.3f}: {exc}", file=sys.stderr, flush=True)
        return 143 if exc.reason == "SIGTERM" else 130
    if state is None:
        print(f"rank {rank} at {time.time():.3f}: stopped by the root", file=sys.stderr, flush=True)
        _write(out / f"follower-{rank}.json", {"rank": rank})
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(anyio.run(main, Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
