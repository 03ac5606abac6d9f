"""A follower rank for tests/test_acceptance_docs_r5.py: docs/how-to/multi-node.md's "By hand" recipe.

``python acceptance_r5_worker.py CONFIG.json``; the token comes from ``LAMPLOOP_TOKEN`` (the page:
"pass the token through the environment, not the command line").  CONFIG holds ``port``,
``rank``, ``nranks``, ``accumulate`` and ``record`` (where the outcome is saved with
:func:`tests.workers.records.save_record`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from records import save_record

import lamploop

N_EXAMPLES = 24
BATCH_SIZE = 4
LEARNING_RATE = 0.1


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The same float64 data on every rank (each takes its share)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(N_EXAMPLES, 3, generator=generator, dtype=torch.float64)
    y = torch.randn(N_EXAMPLES, 2, generator=generator, dtype=torch.float64)
    return x, y


def make_model(seed: int) -> lamploop.SupervisedModel:
    """A float64 ``Linear(3, 2)``; each rank may seed it differently (the root's weights win)."""
    torch.manual_seed(seed)
    return lamploop.SupervisedModel(torch.nn.Linear(3, 2).double(), lamploop.mse_loss)


def train_batches() -> lamploop.BatchStreamFactory:
    x, y = data()
    return lamploop.tensor_batches(x, y, batch_size=BATCH_SIZE, shuffle=False)


def main() -> None:
    config: dict[str, Any] = json.loads(Path(sys.argv[1]).read_text())
    rank, nranks = int(config["rank"]), int(config["nranks"])
    model = make_model(seed=100 + rank)
    outcome: dict[str, Any]

    async def follower() -> Any:
        async with lamploop.TcpControlFollower(
            host="127.0.0.1",
            port=int(config["port"]),
            rank=rank,
            nranks=nranks,
            token=os.environ["LAMPLOOP_TOKEN"],
            model_spec=lamploop.model_spec(model.module),
            connect_timeout=30.0,
        ) as control:
            return await lamploop.follow_distributed_training(
                rank=rank,
                nranks=nranks,
                device="cpu",
                control=control,
                model=model,
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=LEARNING_RATE),
                train_batches=train_batches(),
                validation_batches=None,
                accumulate_gradient_over_n_batches=int(config["accumulate"]),
            )

    try:
        returned = anyio.run(follower)
    except Exception as error:  # the record says what happened; the exit status too
        outcome = {"outcome": "error", "type": type(error).__name__, "message": str(error)}
        save_record(outcome, config["record"])
        sys.exit(3)
    outcome = {
        "outcome": "done",
        "returned_none": returned is None,
        "params": {name: tensor.detach().clone() for name, tensor in model.module.state_dict().items()},
    }
    save_record(outcome, config["record"])


if __name__ == "__main__":
    main()
