"""Weight averaging: EMA equals a hand-written EMA, SWA equals torch's AveragedModel + update_bn,
and the average is checkpointed (a resumed run ends with the same average)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from torch.optim.swa_utils import AveragedModel, update_bn

import lamploop
from lamploop.averaging import ema, swa
from lamploop.batches import BatchContext
from lamploop.checkpoint import load_checkpoint
from lamploop.errors import ConfigurationError

torch.manual_seed(0)
X, Y = torch.randn(96, 6, dtype=torch.float64), torch.randint(0, 3, (96,))
TRAIN = lamploop.tensor_batches(X, Y, batch_size=16, seed=4)
EPOCHS = 4


def _module() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.BatchNorm1d(12), torch.nn.Tanh(), torch.nn.Linear(12, 3)
    ).double()


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _fit(module: torch.nn.Module, averaging: Any, max_epochs: int = EPOCHS, **kwargs: Any) -> Any:
    return lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=_optimizer,
        train_batches=TRAIN,
        max_epochs=max_epochs,
        learning_rate_schedule=lamploop.cyclic(2.0, 2),
        averaging=averaging,
        reporters=[],
        **kwargs,
    )


async def _hand_training(after_step: Any, after_epoch: Any) -> torch.nn.Module:
    """The same training, epoch by epoch with one_epoch (lamploop's fit trains exactly so)."""
    module = _module()
    optimizer = _optimizer(module.parameters())
    schedule = lamploop.cyclic(2.0, 2)
    state = schedule.init()
    for epoch in range(EPOCHS):
        state, factor = schedule.learning_rate_factor(state, epoch, None)
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * factor

        def step() -> None:
            optimizer.step()
            after_step(module)

        await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module),
            batches=TRAIN(BatchContext(epoch=epoch)),
            step_optimizer=step,
            epoch=epoch,
        )
        after_epoch(module, epoch)
    return module


def test_ema_equals_a_hand_written_ema() -> None:
    decay = 0.8
    average: dict[str, torch.Tensor] = {}

    def after_step(module: torch.nn.Module) -> None:
        for name, p in module.named_parameters():
            if name not in average:
                average[name] = p.detach().clone()  # the first update copies, as AveragedModel
            else:
                average[name] = decay * average[name] + (1 - decay) * p.detach()

    anyio.run(_hand_training, after_step, lambda module, epoch: None)
    module = _module()
    _fit(module, ema(decay))
    for name, value in average.items():
        torch.testing.assert_close(dict(module.named_parameters())[name], value, rtol=0, atol=1e-12, msg=name)


def test_swa_equals_averaged_model_with_update_bn() -> None:
    holder: list[AveragedModel] = []

    def after_epoch(module: torch.nn.Module, epoch: int) -> None:
        if not holder:
            holder.append(AveragedModel(module))
        if epoch >= 1:
            holder[0].update_parameters(module)

    anyio.run(_hand_training, lambda module: None, after_epoch)
    reference = holder[0]
    batches = anyio.run(_features, EPOCHS - 1)
    update_bn(batches, reference)
    module = _module()
    _fit(module, swa(start_epoch=1))
    expected = reference.module.state_dict()
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-12, msg=name)


async def _features(epoch: int) -> list[torch.Tensor]:
    return [x async for x, _ in TRAIN(BatchContext(epoch=epoch))]


def test_the_average_is_checkpointed_and_a_resumed_run_ends_with_the_same(tmp_path: Path) -> None:
    straight = _module()
    _fit(straight, ema(0.9))
    resumed = _module()
    _fit(resumed, ema(0.9), max_epochs=2, checkpoint_dir=tmp_path)
    saved = load_checkpoint(tmp_path)
    assert saved.state.averaged_count == 2 * 6  # one update per step, 6 steps an epoch
    assert sorted(saved.state.averaged_model) == sorted(_module().state_dict())
    again = _module()
    _fit(again, ema(0.9), checkpoint_dir=tmp_path)
    for name, value in straight.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


def test_bad_averaging_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"ema: decay must be a number in \(0, 1\), got 1.5"):
        ema(1.5)
    with pytest.raises(ConfigurationError, match="swa: start_epoch must be an int >= 0, got -1"):
        swa(-1)
    with pytest.raises(ConfigurationError, match=r"averaging must be lamploop\.averaging\.ema"):
        lamploop.settings.TrainingSettings(averaging=0.99)  # type: ignore[arg-type]


def test_an_swa_that_would_never_average_is_refused_before_training(tmp_path: Path) -> None:
    """swa(start_epoch) at or after max_epochs never updates: refused up front, nothing trained."""
    module = _module()
    before = {name: t.clone() for name, t in module.state_dict().items()}
    with pytest.raises(ConfigurationError, match=r"swa\(start_epoch=4\) never averages with max_epochs=4"):
        _fit(module, swa(EPOCHS), checkpoint_dir=tmp_path)
    assert all(torch.equal(t, before[name]) for name, t in module.state_dict().items())
    assert not any(tmp_path.iterdir())
    _fit(_module(), swa(EPOCHS - 1))  # from the last epoch on: taken (one update)
