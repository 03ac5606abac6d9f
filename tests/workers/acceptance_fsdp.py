"""One rank of an ``fsdp`` run for tests/test_acceptance_docs_fsdp.py, and the data both share.

Written from docs/strategies.md ("Fully sharded: fsdp") and docs/checkpoints.md only.

Usage:

- ``python acceptance_fsdp.py fit OUT WORLD_SIZE CHECKPOINT_DIR``: ``lamploop.fit(strategy="fsdp",
  world_size=WORLD_SIZE, checkpoint_every_n_steps=2)`` started without a launcher, so it runs
  this same command line again for ranks 1.. (docs/distributed.md "Several processes on one
  machine"); rank 0 writes
  ``OUT/model.safetensors`` (the module after the run) and ``OUT/result.json``.
- ``python acceptance_fsdp.py drive OUT PORT TOKEN CHECKPOINT_DIR`` and ``... follow OUT PORT TOKEN``:
  the two ranks of ``drive_distributed_training`` / ``follow_distributed_training`` over the TCP
  control channel with ``settings=TrainingSettings(strategy="fsdp")`` and
  ``checkpoint_position=Checkpointer(...).save_position`` (docs/strategies.md "From fit and the
  drivers"); the root writes the same two files.

The data: every epoch deals a fixed pool of examples to the ranks as a pure function of
(epoch, rank, nranks); the union of what the ranks hold in each optimizer step (2 batches
accumulated) is the same at every world size, so one process training on :func:`steps_of`
is the reference.  The 2-rank streams are uneven (10 and 8 batches, the last step rank 0's alone).
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import torch
from safetensors.torch import save_file

import lamploop
from lamploop.checkpoint import Checkpointer

FEATURES, HIDDEN, CLASSES = 6, 13, 5
"""13 and 5 rows do not split evenly over 2 or 3 ranks: the shards are uneven too."""
TRAIN_EXAMPLES, RANK0_EXAMPLES, BATCH = 70, 40, 4
VALID_EXAMPLES = 17
ACCUMULATE = 2
MAX_EPOCHS = 3
ELIGIBLE = (0, 1)
"""Only epochs 0 and 1 may become the best model, so the model returned differs from the last one."""
LEARNING_RATE = 0.02
STEP_CHECKPOINT_EVERY = 2
"""Every epoch has 5 steps: ``fit`` also writes ``epoch-00000e-step-000002`` and ``-step-000004``;
at step 4 rank 1 of 2 has no batch left (its stream ended in step 3)."""

Batch = tuple[torch.Tensor, torch.Tensor]


def module() -> torch.nn.Module:
    """The MLP 6-13-5 in float64, the same initial values in every process."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES)
    ).double()


def optimizer(params: Any) -> torch.optim.Optimizer:
    """Adam: its state (two moments per parameter) is what fsdp shards besides the parameters."""
    return torch.optim.Adam(params, lr=LEARNING_RATE)


def _pool(n: int, seed: int) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=generator, dtype=torch.float64)
    # Learnable labels (a fixed linear rule), so that the validation loss falls for a while.
    rule = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return x, (x @ rule).argmax(dim=1)


def _two_rank_batches(epoch: int) -> tuple[list[Batch], list[Batch]]:
    """Rank 0 gets 40 examples (10 batches of 4), rank 1 gets 30 (7 batches of 4, then 2)."""
    x, y = _pool(TRAIN_EXAMPLES, seed=1)
    order = torch.randperm(TRAIN_EXAMPLES, generator=torch.Generator().manual_seed(100 + epoch))
    parts = (order[:RANK0_EXAMPLES], order[RANK0_EXAMPLES:])
    return tuple(  # type: ignore[return-value]
        [(x[i], y[i]) for i in part.split(BATCH)] for part in parts
    )


def _cat(batches: list[Batch]) -> Batch:
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def batches_of(epoch: int, rank: int, nranks: int) -> list[Batch]:
    """This rank's training batches at this world size (1, 2 or 3), the same steps' union at each."""
    first, second = _two_rank_batches(epoch)
    if nranks == 2:
        return first if rank == 0 else second
    if nranks == 3:
        if rank == 0:
            return first
        halves = []
        for bx, by in second:
            half = slice(0, (len(by) + 1) // 2) if rank == 1 else slice((len(by) + 1) // 2, None)
            halves.append((bx[half], by[half]))
        return halves
    if nranks == 1:
        # The micro-batch in position p of each step holds both ranks' micro-batches in position p.
        merged = []
        for index in range(len(first)):
            parts = [b[index] for b in (first, second) if index < len(b)]
            merged.append(_cat(parts))
        return merged
    msg = f"no layout for {nranks} ranks"
    raise ValueError(msg)


def steps_of(epoch: int) -> list[Batch]:
    """Every optimizer step's examples, over all ranks: what one process trains on in the reference."""
    first, second = _two_rank_batches(epoch)
    steps = []
    for start in range(0, max(len(first), len(second)), ACCUMULATE):
        window = slice(start, start + ACCUMULATE)
        steps.append(_cat(first[window] + second[window]))
    return steps


def validation_of(rank: int, nranks: int) -> list[Batch]:
    """The validation pool dealt round robin, in batches of 4."""
    x, y = _pool(VALID_EXAMPLES, seed=2)
    return [
        (bx, by) for bx, by in zip(x[rank::nranks].split(BATCH), y[rank::nranks].split(BATCH), strict=True)
    ]


def validation_set() -> Batch:
    """Every validation example (the reference's validation loss is their mean)."""
    return _pool(VALID_EXAMPLES, seed=2)


def train_factory(context: lamploop.BatchContext) -> AsyncIterator[Batch]:
    """The training :data:`BatchStreamFactory`."""

    async def stream() -> AsyncIterator[Batch]:
        for batch in batches_of(context.epoch, context.rank, context.nranks):
            yield batch

    return stream()


def valid_factory(context: lamploop.BatchContext) -> AsyncIterator[Batch]:
    """The validation :data:`BatchStreamFactory`."""

    async def stream() -> AsyncIterator[Batch]:
        for batch in validation_of(context.rank, context.nranks):
            yield batch

    return stream()


def _curve(state: lamploop.LoopState) -> list[dict[str, Any]]:
    return [
        {
            "epoch": entry.epoch,
            "training_loss": entry.training_loss,
            "validation_loss": list(entry.validation_loss) if entry.validation_loss else None,
        }
        for entry in state.learning_curve
    ]


def _write(out: Path, net: torch.nn.Module, state: lamploop.LoopState, extra: dict[str, Any]) -> None:
    save_file(
        {k: v.detach().clone().contiguous() for k, v in net.state_dict().items()}, out / "model.safetensors"
    )
    result = {
        "epoch": state.epoch,
        "min_validation_epoch": state.min_validation_epoch,
        "curve": _curve(state),
        **extra,
    }
    (out / "result.json").write_text(json.dumps(result))


def run_fit(out: Path, world_size: int, checkpoint_dir: Path) -> None:
    """``fit(strategy="fsdp", world_size=n)``; records on rank 0 whether the module held storage."""
    net = module()
    parameters = list(net.parameters())
    storage_during_run: list[int] = []

    def on_epoch(state: lamploop.LoopState) -> None:
        # docs/strategies.md: "each .data is an empty tensor" during the run.
        storage_during_run.append(sum(p.data.numel() for p in net.parameters()))

    state = lamploop.fit(
        model=lamploop.SupervisedModel(net),
        optimizer_factory=optimizer,
        train_batches=train_factory,
        validation_batches=valid_factory,
        max_epochs=MAX_EPOCHS,
        return_min_validation_loss_model=ELIGIBLE,
        accumulate_gradient_over_n_batches=ACCUMULATE,
        device="cpu",
        world_size=world_size,
        strategy="fsdp",
        checkpoint_dir=checkpoint_dir,
        keep_last=None,
        checkpoint_every_n_steps=STEP_CHECKPOINT_EVERY,
        reporters=[],
        on_epoch=on_epoch,
        heartbeat_timeout=20.0,
    )
    if state is None:  # a follower
        return
    same_objects = all(a is b for a, b in zip(parameters, net.parameters(), strict=True))
    _write(
        out, net, state, {"storage_during_run": storage_during_run, "same_parameter_objects": same_objects}
    )


async def run_drive(out: Path, port: int, token: str, checkpoint_dir: Path) -> None:
    """Rank 0 of the drivers with ``settings=TrainingSettings(strategy="fsdp")``."""
    net = module()
    checkpointer = Checkpointer(checkpoint_dir, keep_last=None)
    settings = lamploop.TrainingSettings(strategy="fsdp")
    async with lamploop.TcpControlRoot(
        port=port, nranks=2, token=token, model_spec=lamploop.model_spec(net), heartbeat_timeout=20.0
    ) as control:
        with anyio.fail_after(120):
            state = await lamploop.drive_distributed_training(
                nranks=2,
                device="cpu",
                control=control,
                model=lamploop.SupervisedModel(net),
                optimizer_factory=optimizer,
                train_batches=train_factory,
                validation_batches=valid_factory,
                max_epochs=MAX_EPOCHS,
                return_min_validation_loss_model=ELIGIBLE,
                accumulate_gradient_over_n_batches=ACCUMULATE,
                settings=settings,
                checkpoint_position=checkpointer.save_position,
            )
    _write(out, net, state, {})


async def run_follow(port: int, token: str) -> None:
    """Rank 1 of the drivers, with the same settings object."""
    net = module()
    async with lamploop.TcpControlFollower(
        host="127.0.0.1",
        port=port,
        rank=1,
        nranks=2,
        token=token,
        model_spec=lamploop.model_spec(net),
        heartbeat_timeout=20.0,
    ) as control:
        with anyio.fail_after(120):
            await lamploop.follow_distributed_training(
                rank=1,
                nranks=2,
                device="cpu",
                control=control,
                model=lamploop.SupervisedModel(net),
                train_batches=train_factory,
                validation_batches=valid_factory,
                accumulate_gradient_over_n_batches=ACCUMULATE,
                optimizer_factory=optimizer,
                settings=lamploop.TrainingSettings(strategy="fsdp"),
            )


def main() -> None:
    """Dispatch on the first argument (see the module's docstring)."""
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "fit":
        run_fit(out, int(sys.argv[3]), Path(sys.argv[4]))
    elif mode == "drive":
        anyio.run(run_drive, out, int(sys.argv[3]), sys.argv[4], Path(sys.argv[5]))
    elif mode == "follow":
        anyio.run(run_follow, int(sys.argv[3]), sys.argv[4])
    else:
        msg = f"unknown mode {mode!r}"
        raise SystemExit(msg)


if __name__ == "__main__":
    main()
