"""Learn a surrogate of the heat equation from simulations that stream their results.

``python examples/streaming_heat/train.py [--producers 3] [--samples 400] [--out DIR]``:

1. opens a :class:`~lamploop.streaming.receiver.SampleReceiver` into a FIRO buffer (first
   in, random out: each sample read ``--max-reads`` times, in random order);
2. starts ``--producers`` simulation processes (``simulate.py``), each streaming
   ``--samples`` solutions with random parameters; no data set is written to disk;
3. trains an MLP parameters -> solution on batches drawn from the buffer while more arrive,
   validating every epoch (``--batches-per-epoch`` batches) on a fixed held-out set solved
   here, until the producers are done and the buffer is drained.

One rank; several ranks, each with its own receiver, are the next step (docs/streaming.md).
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

import anyio
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from heat import random_parameters, solve

import lamploop
from lamploop.streaming import FiroBuffer, buffer_batches
from lamploop.streaming.receiver import SampleReceiver

HERE = Path(__file__).resolve().parent


def held_out(count: int = 200, seed: int = 12345) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed validation set, solved here (never streamed)."""
    rng = np.random.default_rng(seed)
    parameters = np.stack([random_parameters(rng) for _ in range(count)])
    solutions = np.stack([solve(p) for p in parameters])
    return torch.from_numpy(parameters).float(), torch.from_numpy(solutions).float()


def surrogate() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 32),
    )


async def train(args: argparse.Namespace) -> tuple[lamploop.LoopState, int, int]:
    """Train; the final state, the samples received and the reads from the buffer."""
    token = secrets.token_hex(16)
    names = [f"sim-{i}" for i in range(args.producers)]
    buffer = FiroBuffer(capacity=args.capacity, watermark=args.watermark, seed=0, max_reads=args.max_reads)
    x_valid, y_valid = held_out()
    module = surrogate()
    async with (
        SampleReceiver(buffer, token=token, expected_producers=names) as receiver,
        anyio.create_task_group() as tg,
    ):
        host, port = receiver.address
        for i, name in enumerate(names):
            command = [
                sys.executable,
                str(HERE / "simulate.py"),
                host,
                str(port),
                name,
                str(args.samples),
                str(i),
            ]
            tg.start_soon(
                lambda c=command: anyio.run_process(c, env={"LAMPLOOP_STREAM_TOKEN": token}, check=True)
            )

        async def end_of_stream() -> None:
            await receiver.wait_all_done()
            buffer.close()  # the producers are done: drain what is left, then the run ends

        tg.start_soon(end_of_stream)
        state = await lamploop.fit_async(
            model=lamploop.SupervisedModel(module, lamploop.mse_loss),
            optimizer_factory=lambda params: torch.optim.Adam(params, lr=3e-3),
            train_batches=buffer_batches(
                buffer, batch_size=args.batch_size, batches_per_epoch=args.batches_per_epoch
            ),
            validation_batches=lamploop.tensor_batches(x_valid, y_valid, batch_size=200, shuffle=False),
            max_epochs=10**6,  # the stream decides when training ends
            checkpoint_dir=args.out,
            resume=False,
            world_size=1,
        )
    assert state is not None
    first, last = state.learning_curve[0].validation_loss, state.learning_curve[-1].validation_loss
    assert first is not None
    assert last is not None
    print(
        f"{receiver.stats.samples} samples received from {len(names)} producers, "
        f"{buffer.read_total} reads ({args.max_reads} each); {state.epoch} epochs; "
        f"validation loss per example {first[1]:.4f} -> {last[1]:.4f}"
    )
    return state, receiver.stats.samples, buffer.read_total


def main(argv: list[str] | None = None) -> tuple[lamploop.LoopState, int, int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--samples", type=int, default=400, help="samples per producer")
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--watermark", type=int, default=64)
    parser.add_argument("--max-reads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches-per-epoch", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("runs/streaming-heat"))
    return anyio.run(train, parser.parse_args(argv))


if __name__ == "__main__":
    main()
