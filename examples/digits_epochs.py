"""The digits model trained with the building blocks instead of ``fit``.

    python examples/digits_epochs.py

Shows what ``fit`` wires for you: ``epochs`` drives, ``one_epoch`` trains and
validates, a ``Checkpointer`` writes each epoch, and the best model (lowest
smoothed validation loss) is restored at the end.
"""

from __future__ import annotations

import tempfile

import anyio
import torch

import lamploop
from lamploop.checkpoint import Checkpointer
from lamploop.demo import accuracy, digits_data, digits_model
from lamploop.distributed.replica import set_learning_rate_factor


async def main(directory: str) -> None:
    x_train, y_train, x_valid, y_valid = digits_data(seed=0)
    module = digits_model(seed=0)
    model = lamploop.SupervisedModel(module, lamploop.cross_entropy_loss)
    optimizer = torch.optim.Adam(module.parameters(), lr=2e-3)
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    train_batches = lamploop.tensor_batches(x_train, y_train, batch_size=32, seed=0)
    valid_batches = lamploop.tensor_batches(x_valid, y_valid, batch_size=256, shuffle=False)
    save = Checkpointer(directory, keep_last=2)
    best: dict[str, torch.Tensor] = {}
    epoch = 0

    async def train_epoch(lr_factor: float) -> float:
        set_learning_rate_factor(optimizer, base_lrs, lr_factor)
        return await lamploop.one_epoch(
            model=model,
            batches=train_batches(lamploop.BatchContext(epoch)),
            step_optimizer=optimizer.step,
            epoch=epoch,
        )

    async def validation_epoch() -> float:
        batches = valid_batches(lamploop.BatchContext(epoch))
        return await lamploop.one_epoch(model=model, batches=batches, forward_only=True, epoch=epoch)

    async def save_best() -> None:
        best.update({name: t.detach().clone() for name, t in module.state_dict().items()})

    async def checkpoint(state: lamploop.LoopState, schedule_state: object) -> None:
        nonlocal epoch
        epoch = state.epoch
        print(f"epoch {state.learning_curve[-1].epoch}: {state.learning_curve[-1]}")
        data = lamploop.LoopStateWithModelAndOptimizerData(
            loop_state=state, model=module.state_dict(), optimizer=optimizer.state_dict(), best_model=best
        )
        await save(data, schedule_state)

    state = await lamploop.epochs(
        max_epochs=20,
        train_epoch=train_epoch,
        validation_epoch=validation_epoch,
        save_min_validation_loss_model=save_best,
        checkpoint_state=checkpoint,
        return_min_validation_loss_model=lamploop.ALL_EPOCHS,
        learning_rate_schedule=lamploop.reduce_lr_on_plateau(patience=2),
        validation_loss_exponential_smoothing_factor=0.5,
    )
    module.load_state_dict(best)
    result = accuracy(module, x_valid, y_valid)
    print(f"best epoch {state.min_validation_epoch}; validation accuracy {result:.4f}")
    assert result > 0.9, f"accuracy {result} is too low"


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as directory:
        anyio.run(main, directory)
