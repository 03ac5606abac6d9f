"""Learn a surrogate of the heat equation from simulations that stream their results.

``python examples/streaming_heat/train.py [--ranks 2] [--producers 3] [--samples 400] [--out DIR]``

1. every rank (``--ranks``, started by this script through ``fit``) opens a receiver into its
   own FIRO buffer (first in, random out: each sample read ``--max-reads`` times, in random
   order), restored from ``--out``'s latest checkpoint when there is one;
2. rank 0 starts ``--producers`` simulation processes (``simulate.py``) once the ranks met;
   each knows only rank 0's receiver, which hands it to a rank (round-robin), and streams
   ``--samples`` solutions with random parameters; no data set is written to disk;
3. every rank trains an MLP parameters -> solution on batches drawn from its buffer while
   more arrive, validating every epoch (``--batches-per-epoch`` batches per rank) on a fixed
   held-out set solved here; the run ends at the first epoch with no batch left on any rank.

Killed (even SIGKILL) and started again with the same ``--out``, it resumes: each rank
restores its buffer and what it acknowledged, and the simulations resend the rest.
Each rank prints ``rank R: received N samples, R reads``; rank 0 then prints the result.

``--offline``: the baseline without streaming, as studies of online training measure it: the
same simulations write their samples to files (``--out``/samples, one safetensors file per
sample), then the same training reads them with a torch ``DataLoader``, each sample
``--max-reads`` times in a random order, validating every ``--batches-per-epoch`` batches.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import sys
import time
from functools import partial
from pathlib import Path

import anyio
import numpy as np
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from heat import random_parameters, solve

import lamploop
from lamploop.distributed.launch import launch_env
from lamploop.streaming import FiroBuffer, StreamState, buffer_batches

HERE = Path(__file__).resolve().parent
TOKEN_VARIABLE = "LAMPLOOP_STREAM_TOKEN"  # the producers' secret; the other ranks inherit it


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


async def run_simulations(host: str, port: int, names: list[str], samples: int, token: str) -> None:
    """The producers: one process per simulation, each with its own seed."""
    async with anyio.create_task_group() as tg:
        for i, name in enumerate(names):
            command = [sys.executable, str(HERE / "simulate.py"), host, str(port), name, str(samples), str(i)]
            env = {**os.environ, TOKEN_VARIABLE: token}
            tg.start_soon(lambda c=command, e=env: anyio.run_process(c, env=e, check=True, stdout=None))


async def write_simulations(folder: Path, names: list[str], samples: int) -> None:
    """The offline baseline's producers: the same simulations, writing their samples to files."""
    async with anyio.create_task_group() as tg:
        for i, name in enumerate(names):
            command = [
                sys.executable,
                str(HERE / "simulate.py"),
                "--out-dir",
                str(folder),
                name,
                str(samples),
                str(i),
            ]
            tg.start_soon(partial(anyio.run_process, command, check=True, stdout=None))


class SampleFiles(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The samples the simulations wrote (``simulate.py --out-dir``), one file each: ``(x, y)``."""

    def __init__(self, folder: Path) -> None:
        self.files = sorted(folder.glob("*.safetensors"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tensors = load_file(self.files[index])
        return tensors["x"], tensors["y"]


def file_batches(
    folder: Path, *, batch_size: int, batches_per_epoch: int, reads: int, seed: int = 0
) -> tuple[lamploop.BatchStreamFactory, int]:
    """The batch-stream factory reading the files with a DataLoader, and its number of epochs.

    Every sample is read ``reads`` times (``reads`` shuffled passes, one after the other), as a
    FIRO buffer with ``max_reads=reads`` reads it; an epoch is ``batches_per_epoch`` batches, as
    online, so that validation comes after as many samples.
    """
    data = SampleFiles(folder)
    generator = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(len(data), generator=generator) for _ in range(reads)]).tolist()
    per_epoch = batch_size * batches_per_epoch

    def loader(context: lamploop.BatchContext) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        part = order[context.epoch * per_epoch : (context.epoch + 1) * per_epoch]
        return DataLoader(data, batch_size=batch_size, sampler=part)

    return lamploop.dataloader_batches(loader), math.ceil(len(order) / per_epoch)


async def train_offline(args: argparse.Namespace) -> lamploop.LoopState | None:
    """The offline baseline: simulate to files first (once, on the first rank), then train on them."""
    env = launch_env()
    names = [f"sim-{i}" for i in range(args.producers)]
    folder = args.out / "samples"
    if env is None and len(list(folder.glob("*.safetensors"))) < args.producers * args.samples:
        began = time.perf_counter()
        await write_simulations(folder, names, args.samples)
        print(
            f"{len(names)} simulations wrote {len(names) * args.samples} samples to {folder} "
            f"in {time.perf_counter() - began:.1f} s",
            flush=True,
        )
    x_valid, y_valid = held_out()
    train_batches, epochs = file_batches(
        folder, batch_size=args.batch_size, batches_per_epoch=args.batches_per_epoch, reads=args.max_reads
    )
    state = await lamploop.fit_async(
        model=lamploop.SupervisedModel(surrogate(), lamploop.mse_loss),
        optimizer_factory=lambda params: torch.optim.Adam(params, lr=3e-3),
        train_batches=train_batches,
        validation_batches=lamploop.tensor_batches(x_valid, y_valid, batch_size=50, shuffle=False),
        max_epochs=epochs,
        checkpoint_dir=args.out,
        world_size=args.ranks,
        reporters=[],
    )
    if state is not None:
        first, last = state.learning_curve[0].validation_loss, state.learning_curve[-1].validation_loss
        assert first is not None
        assert last is not None
        print(
            f"{state.epoch} epochs on {args.ranks} ranks from {len(names)} simulations' files; "
            f"validation loss per example {first[1]:.4f} -> {last[1]:.4f}",
            flush=True,
        )
    return state


async def train(args: argparse.Namespace) -> lamploop.LoopState | None:
    """This rank's part of the run; rank 0 returns the final state, the others ``None``."""
    env = launch_env()
    rank = env.rank if env is not None else 0
    token = os.environ.setdefault(TOKEN_VARIABLE, secrets.token_hex(16))  # set before fit starts the ranks
    names = [f"sim-{i}" for i in range(args.producers)]
    buffer = FiroBuffer(capacity=args.capacity, watermark=args.watermark, seed=rank, max_reads=args.max_reads)
    stream = StreamState(buffer)
    stream.restore(args.out)  # a resumed run: this rank's buffer and what it acknowledged
    x_valid, y_valid = held_out()
    async with (
        stream.open_receiver(token=token, producers=names, nranks=args.ranks) as receiver,
        anyio.create_task_group() as tg,
    ):

        async def end_of_stream() -> None:
            await receiver.wait_all_done()  # this rank's share of the producers
            buffer.close()  # drain what is left, then this rank's stream ends

        async def producers() -> None:
            if args.ranks > 1:
                await stream.wait_ranks_joined()  # rank 0's receiver knows every rank's by then
            await run_simulations(*receiver.address, names, args.samples, token)

        tg.start_soon(end_of_stream)
        if rank == 0:
            tg.start_soon(producers)
        state = await lamploop.fit_async(
            model=lamploop.SupervisedModel(surrogate(), lamploop.mse_loss),
            optimizer_factory=lambda params: torch.optim.Adam(params, lr=3e-3),
            train_batches=buffer_batches(
                buffer, batch_size=args.batch_size, batches_per_epoch=args.batches_per_epoch
            ),
            validation_batches=lamploop.tensor_batches(x_valid, y_valid, batch_size=50, shuffle=False),
            max_epochs=10**6,  # the stream decides when training ends
            checkpoint_dir=args.out,
            checkpoint_extras={"stream": stream},
            world_size=args.ranks,
            reporters=[],
        )
    print(f"rank {rank}: received {receiver.stats.samples} samples, {buffer.read_total} reads", flush=True)
    if state is not None:
        first, last = state.learning_curve[0].validation_loss, state.learning_curve[-1].validation_loss
        assert first is not None
        assert last is not None
        print(
            f"{state.epoch} epochs on {args.ranks} ranks from {len(names)} simulations; "
            f"validation loss per example {first[1]:.4f} -> {last[1]:.4f}",
            flush=True,
        )
    return state


def main(argv: list[str] | None = None) -> lamploop.LoopState | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--samples", type=int, default=400, help="samples per producer")
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--watermark", type=int, default=64)
    parser.add_argument("--max-reads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches-per-epoch", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("runs/streaming-heat"))
    parser.add_argument(
        "--offline", action="store_true", help="the baseline: simulate to files, then train with a DataLoader"
    )
    args = parser.parse_args(argv)
    return anyio.run(train_offline if args.offline else train, args)


if __name__ == "__main__":
    main()
