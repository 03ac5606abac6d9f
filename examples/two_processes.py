"""Two ranks in two processes, driven by hand: TCP control channel + Gloo.

    python examples/two_processes.py            # rank 0; starts rank 1 itself

Rank 0 listens on a free port with a fresh token, starts this script again as
rank 1 (port and token in its arguments and environment), drives 3 epochs and
checks the losses went down.  Each process builds its own model: rank 1's
weights are replaced by rank 0's when the tensor channel opens.
"""

from __future__ import annotations

import os
import secrets
import sys

import anyio
import torch

import lamploop
from lamploop.control.tcp import TcpControlFollower, TcpControlRoot
from lamploop.distributed import drive_distributed_training, follow_distributed_training
from lamploop.modelspec import model_spec

NRANKS = 2


def make_model(rank: int) -> lamploop.SupervisedModel:
    torch.manual_seed(rank)  # different on purpose: the root's weights win
    module = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    return lamploop.SupervisedModel(module, lamploop.cross_entropy_loss)


def data() -> lamploop.BatchStreamFactory:
    generator = torch.Generator().manual_seed(42)
    x = torch.randn(2048, 20, generator=generator)
    y = (x[:, :4].argmax(dim=1)).long()
    return lamploop.tensor_batches(x, y, batch_size=64, seed=7)


async def root() -> None:
    model = make_model(0)
    token = secrets.token_hex(16)
    async with (
        TcpControlRoot(port=0, nranks=NRANKS, token=token, model_spec=model_spec(model.module)) as control,
        anyio.create_task_group() as children,
    ):
        port = control.address[1]
        env = {**os.environ, "EXAMPLE_TOKEN": token}
        children.start_soon(
            lambda: anyio.run_process([sys.executable, __file__, "follower", str(port)], env=env, stdout=None)
        )
        state = await drive_distributed_training(
            nranks=NRANKS,
            device="cpu",
            control=control,
            model=model,
            optimizer_factory=lambda params: torch.optim.Adam(params, lr=1e-2),
            train_batches=data(),
            validation_batches=data(),
            max_epochs=3,
            return_min_validation_loss_model=lamploop.ALL_EPOCHS,
        )
    curve = [round(entry.training_loss, 4) for entry in state.learning_curve]
    print(f"training loss per epoch: {curve}; best epoch {state.min_validation_epoch}")
    assert curve[-1] < curve[0], "training did not reduce the loss"


async def follower(port: int) -> None:
    model = make_model(1)
    async with TcpControlFollower(
        host="127.0.0.1",
        port=port,
        rank=1,
        nranks=NRANKS,
        token=os.environ["EXAMPLE_TOKEN"],
        model_spec=model_spec(model.module),
    ) as control:
        await follow_distributed_training(
            rank=1,
            nranks=NRANKS,
            device="cpu",
            control=control,
            model=model,
            train_batches=data(),
            validation_batches=data(),
        )


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1:2] == ["follower"]:
        anyio.run(follower, int(sys.argv[2]))
    else:
        anyio.run(root)
