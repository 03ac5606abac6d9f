"""One rank of tests/distributed/test_acceptance_docs_reliability.py: ``lamploop.fit`` on a tiny model.

Run as ``python acceptance_reliability_rank.py --out DIR [...]``.  With ``--world-size n`` and no
launcher it becomes rank 0 and ``fit`` starts ranks ``1..n-1`` by running the same command line
again (docs: ``fit(world_size=n)``), which then read their rank from ``LAMPLOOP_RANK``; under
Slurm's variables (``SLURM_PROCID``...) the test starts every rank itself.

Every rank writes to ``DIR``:

- ``rank<r>.json`` at start: its pid and, on a follower, the root's control address
  (``LAMPLOOP_CONTROL``);
- ``rank<r>.progress``: a line ``epoch batch time`` as each batch is made (after its compute);
- ``rank<r>.result.json`` when ``fit`` returns or raises: what happened, and when
  (``time.time()``), so the test can time the fault to the error.

Each batch "computes" for ``--step-seconds`` on the training thread (a sleep), as in
docs/reliability.md's fault runs (20 ms).  The process then ends as docs/reliability.md
advises a script that ends its process after a failed run: ``gc.freeze()`` and exit (1 for a
failure, 143 / 130 for a stop on request, 0 for success).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import lamploop
from lamploop.errors import PeerLostError, TrainingInterrupted

FEATURES = 4


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def make_module(dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 2)
    )


def digest(module: torch.nn.Module) -> str:
    sha = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        sha.update(name.encode())
        sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()


def batch_factory(
    *,
    batches: int,
    step_seconds: float,
    progress: Path | None,
    long_step: tuple[int, int, float] | None,
    sigterm_at: tuple[int, int] | None = None,
) -> Any:
    """A pure function of (epoch, rank) per stream: the order a resumed run replays.

    ``sigterm_at=(epoch, index)``: this process sends itself SIGTERM (``os.kill``) as it makes
    that batch of that epoch, once.
    """
    armed = [sigterm_at]

    def make(context: lamploop.BatchContext) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(batches):
            if armed[0] == (context.epoch, index):
                armed[0] = None
                os.kill(os.getpid(), signal.SIGTERM)
            generator = torch.Generator().manual_seed(10_000 * context.epoch + 100 * context.rank + index)
            features = torch.randn(8, FEATURES, generator=generator)
            target = torch.randint(0, 2, (8,), generator=generator)
            seconds = step_seconds
            if long_step is not None and (long_step[0], long_step[1]) == (context.epoch, context.rank):
                seconds = long_step[2] if index == 0 else seconds
            if seconds:
                time.sleep(seconds)
            if progress is not None:
                with progress.open("a") as file:
                    file.write(f"{context.epoch} {index} {time.time()}\n")
            yield features, target

    return lamploop.iterable_batches(make)


def fit_run(
    *,
    out: Path | None,
    rank: int,
    world_size: int,
    epochs: int,
    batches: int,
    step_seconds: float,
    checkpoint_dir: str | None,
    checkpoint_every: int | None,
    dropout: float,
    long_step: tuple[int, int, float] | None = None,
    sigterm_at: tuple[int, int] | None = None,
) -> lamploop.SupervisedModel:
    model = lamploop.SupervisedModel(make_module(dropout))
    progress = None if out is None else out / f"rank{rank}.progress"
    fit_kwargs: dict[str, Any] = {}
    if world_size > 1:
        fit_kwargs["world_size"] = world_size
    if checkpoint_every is not None:
        fit_kwargs["checkpoint_every_n_steps"] = checkpoint_every
    lamploop.fit(
        model=model,
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.05),
        train_batches=batch_factory(
            batches=batches,
            step_seconds=step_seconds,
            progress=progress,
            long_step=long_step,
            sigterm_at=sigterm_at,
        ),
        max_epochs=epochs,
        checkpoint_dir=checkpoint_dir,
        keep_last=None,
        device="cpu",
        reporters=[],
        **fit_kwargs,
    )
    return model


def run_once(args: argparse.Namespace, rank: int, out: Path) -> tuple[dict[str, Any], int]:
    """One ``fit``: what it returned or raised, and the exit status that stands for it."""
    long_step = None
    if args.long_step:
        epoch, long_rank, seconds = args.long_step.split(",")
        long_step = (int(epoch), int(long_rank), float(seconds))
    sigterm_at = None
    if args.sigterm_at:
        epoch, index, signal_rank = (int(part) for part in args.sigterm_at.split(","))
        sigterm_at = (epoch, index) if signal_rank == rank else None

    result: dict[str, Any]
    code: int
    try:
        model = fit_run(
            out=out,
            rank=rank,
            world_size=args.world_size,
            epochs=args.epochs,
            batches=args.batches,
            step_seconds=args.step_seconds,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            dropout=args.dropout,
            long_step=long_step,
            sigterm_at=sigterm_at,
        )
    except PeerLostError as error:
        result = {"kind": "PeerLostError", "rank": error.rank, "how": error.how, "message": str(error)}
        code = 1
    except TrainingInterrupted as error:
        result = {
            "kind": "TrainingInterrupted",
            "epoch": error.epoch,
            "steps_done": error.steps_done,
            "reason": error.reason,
            "message": str(error),
        }
        code = 130 if error.reason == "SIGINT" else 143
    except BaseException as error:
        result = {"kind": type(error).__name__, "message": str(error)}
        code = 1
    else:
        result = {"kind": "ok", "digest": digest(model.module)}
        code = 0
    result["time"] = time.time()
    result["self_rank"] = rank
    return result, code


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=4, help="batches per rank per epoch")
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--checkpoint-every", type=int)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--long-step", help="EPOCH,RANK,SECONDS: that rank's first batch of that epoch")
    parser.add_argument("--sigterm-at", help="EPOCH,INDEX,RANK: that rank sends itself SIGTERM there")
    parser.add_argument("--repeat", type=int, default=1, help="run fit this many times (Slurm launch only)")
    args = parser.parse_args()

    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")

    rank = int(os.environ.get("LAMPLOOP_RANK") or os.environ.get("SLURM_PROCID") or 0)
    out = Path(args.out)
    _write_json(out / f"rank{rank}.json", {"pid": os.getpid(), "control": os.environ.get("LAMPLOOP_CONTROL")})
    code = 0
    for _ in range(args.repeat):
        result, code = run_once(args, rank, out)
        with (out / f"rank{rank}.results.jsonl").open("a") as file:
            file.write(json.dumps(result) + "\n")
        _write_json(out / f"rank{rank}.result.json", result)
    gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())
