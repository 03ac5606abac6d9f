"""Train the resume scenario in a process of its own (used by tests/checkpoint/test_resume.py).

    python tests/workers/resume.py OUT_DIR full        # 6 epochs, a checkpoint after each
    python tests/workers/resume.py OUT_DIR resume CKPT # load CKPT, train on to 6

Writes OUT_DIR/<mode>.safetensors (final parameters) and OUT_DIR/<mode>.json
(learning curve and best epoch). Dropout, shuffling and a plateau schedule make
every piece of saved state matter: RNG, optimizer, schedule and loop state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import safetensors.torch
import torch

import lamploop
from lamploop.checkpoint import Checkpointer, load_checkpoint

MAX_EPOCHS = 6


def model() -> lamploop.SupervisedModel:
    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 3)
    ).double()
    return lamploop.SupervisedModel(module)


def data() -> tuple[lamploop.BatchStreamFactory, lamploop.BatchStreamFactory]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(300, 8, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (300,), generator=generator)
    return (
        lamploop.tensor_batches(x[:240], y[:240], batch_size=16, seed=2),
        lamploop.tensor_batches(x[240:], y[240:], batch_size=32, shuffle=False),
    )


async def main(out: Path, mode: str, checkpoint: Path | None) -> None:
    supervised = model()
    train, valid = data()
    schedule = lamploop.reduce_lr_on_plateau(patience=0, reduce_factor=0.5)
    init_state, schedule_state = None, None
    if checkpoint is not None:
        loaded = load_checkpoint(checkpoint, schedule=schedule, model=supervised.module)
        loaded.rng.restore()
        init_state, schedule_state = loaded.state, loaded.schedule_state
    state = await lamploop.drive_distributed_training(
        nranks=1,
        device="cpu",
        control=None,
        model=supervised,
        optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-2),
        train_batches=train,
        validation_batches=valid,
        max_epochs=MAX_EPOCHS,
        checkpoint_state=Checkpointer(out / "checkpoints", keep_last=None) if mode == "full" else None,
        return_min_validation_loss_model=lamploop.ALL_EPOCHS,
        learning_rate_schedule=schedule,
        init_state=init_state,
        learning_rate_schedule_init_state=schedule_state,
        validation_loss_exponential_smoothing_factor=0.7,
    )
    safetensors.torch.save_file(
        {k: v.contiguous() for k, v in supervised.module.state_dict().items()}, out / f"{mode}.safetensors"
    )
    (out / f"{mode}.json").write_text(
        json.dumps(
            {"state": lamploop.state.converter.unstructure(state), "best_epoch": state.min_validation_epoch}
        )
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    target = Path(sys.argv[1])
    anyio.run(main, target, sys.argv[2], Path(sys.argv[3]) if len(sys.argv) > 3 else None)
