"""One rank of a three-stage pipeline for tests/test_acceptance_docs_api_r4.py.

Usage: ``python acceptance_api_r4_worker.py RANK PORT OUT_DIR``.  As docs/pipeline.md's
training script: every rank builds the same float64 model, joins the Gloo group with
``open_pipeline_group`` and calls ``train_pipeline`` (boundaries ``(2, 4)``: three stages,
"1f1b" with 4 micro-batches, a summed squared-error loss of its own, validation, SGD with
momentum, ``stage_checkpointer``).  It writes ``OUT_DIR/rank<R>`` with
:func:`records.save_record`: the loop state (through :data:`lamploop.state.converter`), its
stage's ``state_dict`` and the epochs :func:`saved_epochs` lists for its stage.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from records import save_record

import lamploop
from lamploop.pipeline import (
    PipelineSpec,
    open_pipeline_group,
    saved_epochs,
    split_sequential,
    stage_checkpointer,
    train_pipeline,
)
from lamploop.state import converter

N_TRAIN, N_VALID, BATCH, LR, MOMENTUM, EPOCHS = 48, 16, 8, 0.05, 0.9, 2
BOUNDARIES, MICROBATCHES, SCHEDULE = (2, 4), 4, "1f1b"


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(N_TRAIN + N_VALID, 4, generator=generator, dtype=torch.float64)
    y = torch.stack([x[:, 0] * x[:, 1], x[:, 2].sin(), x[:, 3] - x[:, 0]], dim=1)
    return x[:N_TRAIN], y[:N_TRAIN], x[N_TRAIN:], y[N_TRAIN:]


def make_model() -> torch.nn.Sequential:
    torch.manual_seed(5)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6),
        torch.nn.Tanh(),
        torch.nn.Linear(6, 5),
        torch.nn.Tanh(),
        torch.nn.Linear(5, 3),
    ).double()


def squared_error(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    return ((output - target) ** 2).sum(), output.shape[0]


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    x, y, xv, yv = data()
    model = make_model()
    spec = PipelineSpec(boundaries=BOUNDARIES, n_microbatches=MICROBATCHES, schedule=SCHEDULE)
    directory = out / "checkpoints"
    with open_pipeline_group(rank=rank, world_size=spec.num_stages, host="127.0.0.1", port=port, timeout=60):
        state = anyio.run(
            partial(
                train_pipeline,
                model=model,
                spec=spec,
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
                train_batches=lamploop.tensor_batches(x, y, batch_size=BATCH, seed=3),
                validation_batches=lamploop.tensor_batches(xv, yv, batch_size=BATCH, shuffle=False),
                loss=squared_error,
                max_epochs=EPOCHS,
                checkpoint_state=stage_checkpointer(directory, rank, keep_last=2),
            )
        )
    stage = split_sequential(model, spec.boundaries)[rank]
    save_record(
        {
            "state": converter.unstructure(state),
            "stage": {name: tensor.detach().clone() for name, tensor in stage.state_dict().items()},
            "saved_epochs": sorted(saved_epochs(directory, rank)),
        },
        out / f"rank{rank}",
    )


if __name__ == "__main__":
    main()
