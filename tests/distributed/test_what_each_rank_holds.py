"""What each rank's model holds when the run ends (docs/distributed.md): the root's the best
model, a follower's the last epoch's weights, with either strategy.

The reference is a plain-torch loop in float64 over the same batches (the mean gradient of
both ranks' batches per step, SGD), recording every epoch's weights and validation loss.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import torch

import lamploop
from lamploop.control import local_control

pytestmark = pytest.mark.timeout(60)

EPOCHS = 5
LR = 2.0
BATCH = 8


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(32, 4, generator=generator, dtype=torch.float64)
    return x, (x[:, 0] > x[:, 1]).long()


def _module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2).double()


def _reference() -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Each epoch's weights and its global validation loss (on the weights after the epoch)."""
    module = _module()
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    data = [_data(rank) for rank in (0, 1)]
    weights, losses = [], []
    for _ in range(EPOCHS):
        for start in range(0, 32, BATCH):
            optimizer.zero_grad()
            x = torch.cat([d[0][start : start + BATCH] for d in data])
            y = torch.cat([d[1][start : start + BATCH] for d in data])
            torch.nn.functional.cross_entropy(module(x), y).backward()
            optimizer.step()
        weights.append({k: v.clone() for k, v in module.state_dict().items()})
        with torch.no_grad():
            x = torch.cat([d[0] for d in data])
            y = torch.cat([d[1] for d in data])
            # The opposite labels: the better the training, the worse the validation loss.
            losses.append(float(torch.nn.functional.cross_entropy(module(x), 1 - y)))
    return weights, losses


def _batches(context: lamploop.BatchContext) -> Any:
    x, y = _data(context.rank)

    async def stream() -> Any:
        for start in range(0, 32, BATCH):
            yield x[start : start + BATCH], y[start : start + BATCH]

    return stream()


def _validation(context: lamploop.BatchContext) -> Any:
    x, y = _data(context.rank)

    async def stream() -> Any:
        yield x, 1 - y

    return stream()


async def _run(strategy: str) -> tuple[lamploop.LoopState, torch.nn.Module, torch.nn.Module]:
    root, (follower,) = local_control(2)
    models = [lamploop.SupervisedModel(_module()), lamploop.SupervisedModel(_module())]
    result: list[lamploop.LoopState] = []

    def optimizer(parameters: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(parameters, lr=LR)

    async def drive() -> None:
        async with root:
            state = await lamploop.drive_distributed_training(
                nranks=2,
                device="cpu",
                control=root,
                model=models[0],
                optimizer_factory=optimizer,
                train_batches=_batches,
                validation_batches=_validation,
                max_epochs=EPOCHS,
                strategy=strategy,
                return_min_validation_loss_model=lamploop.ALL_EPOCHS,
            )
            result.append(state)

    async def follow() -> None:
        async with follower:
            await lamploop.follow_distributed_training(
                rank=1,
                nranks=2,
                device="cpu",
                control=follower,
                model=models[1],
                optimizer_factory=optimizer if strategy == "all_reduce" else None,
                train_batches=_batches,
                validation_batches=_validation,
                strategy=strategy,
            )

    with anyio.fail_after(45):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(drive)
            tasks.start_soon(follow)
    return result[0], models[0].module, models[1].module


@pytest.mark.parametrize("strategy", ["all_reduce", "reduce_to_root"])
def test_the_root_holds_the_best_model_and_a_follower_the_last_epochs(strategy: str) -> None:
    weights, losses = _reference()
    best = min(range(EPOCHS), key=lambda epoch: losses[epoch])
    assert best != EPOCHS - 1, f"the reference's best epoch is its last ({losses}): no test of the difference"
    state, root_module, follower_module = anyio.run(_run, strategy)
    assert state.min_validation_epoch == best
    for name, value in root_module.state_dict().items():
        torch.testing.assert_close(value, weights[best][name], rtol=1e-9, atol=1e-10)
    for name, value in follower_module.state_dict().items():
        torch.testing.assert_close(value, weights[-1][name], rtol=1e-9, atol=1e-10)
