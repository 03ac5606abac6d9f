"""A torch.optim.lr_scheduler in place of lamploop's schedules: stepped per step or per epoch,
checkpointed, shared from the root, equal to a hand loop that steps it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from torch.optim.lr_scheduler import OneCycleLR, StepLR
from workers import rank as worker

import lamploop
from lamploop.errors import ConfigurationError

(X, Y), _ = worker.fit_data()
TRAIN = lamploop.tensor_batches(X[:48], Y[:48], batch_size=8, seed=1)  # 6 steps an epoch
EPOCHS = 3


def _one_cycle(optimizer: torch.optim.Optimizer) -> Any:
    return OneCycleLR(optimizer, max_lr=0.5, total_steps=6 * EPOCHS)


def _recording(seen: list[float]) -> Any:
    class RecordingSGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            seen.append(self.param_groups[0]["lr"])
            return super().step(closure)

    def factory(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return RecordingSGD(params, lr=0.1, momentum=0.9)

    return factory


def _fit(seen: list[float], scheduler: Any, interval: str, max_epochs: int = EPOCHS, **kwargs: Any) -> Any:
    module = worker.make_module({"seed": 3}, 0)
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=_recording(seen),
        train_batches=TRAIN,
        max_epochs=max_epochs,
        lr_scheduler=scheduler,
        lr_scheduler_interval=interval,
        reporters=[],
        **kwargs,
    )
    return module


def _hand_rates(scheduler: Any, interval: str) -> list[float]:
    optimizer = torch.optim.SGD(worker.make_module({"seed": 3}, 0).parameters(), lr=0.1, momentum=0.9)
    sched = scheduler(optimizer)
    rates = []
    for _ in range(EPOCHS):
        for _ in range(6):
            rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            if interval == "step":
                sched.step()
        if interval == "epoch":
            sched.step()
    return rates


@pytest.mark.parametrize(
    ("scheduler", "interval"), [(_one_cycle, "step"), (lambda o: StepLR(o, step_size=1, gamma=0.5), "epoch")]
)
def test_the_scheduler_sets_every_steps_rate_as_a_hand_loop_would(scheduler: Any, interval: str) -> None:
    seen: list[float] = []
    _fit(seen, scheduler, interval)
    assert seen == pytest.approx(_hand_rates(scheduler, interval), rel=1e-12, abs=0)
    assert len(set(seen)) > 2  # the rates did change


def test_a_resumed_run_steps_on_from_the_checkpointed_scheduler(tmp_path: Path) -> None:
    seen: list[float] = []
    straight = _fit(seen, _one_cycle, "step")
    first: list[float] = []
    _fit(first, _one_cycle, "step", max_epochs=1, checkpoint_dir=tmp_path)
    rest: list[float] = []
    resumed = _fit(rest, _one_cycle, "step", checkpoint_dir=tmp_path)
    assert first + rest == seen
    for name, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_two_ranks_with_a_scheduler_train_like_one_rank_on_the_union() -> None:
    data = {"seed": 12, "batches": [6, 6]}
    modules = [worker.make_module({"seed": 3}, rank) for rank in range(2)]
    train = worker.stream_factory(lambda e, r: worker.train_batches_of(data, e, r))
    factory = worker.optimizer_factory({"name": "sgd", "lr": 0.1})
    with anyio.fail_after(50):
        await lamploop.local_data_parallel_training_loop(
            [(lamploop.SupervisedModel(m), train, None) for m in modules],
            factory,
            EPOCHS,
            strategy="all_reduce",
            lr_scheduler=_one_cycle,
            lr_scheduler_interval="step",
        )
    reference = worker.make_module({"seed": 3}, 0)
    await lamploop.drive_distributed_training(
        nranks=1,
        device="cpu",
        control=None,
        model=lamploop.SupervisedModel(reference),
        optimizer_factory=factory,
        train_batches=worker.stream_factory(lambda e, r: worker.union_train_batches(data, e, 2, 1)),
        validation_batches=None,
        max_epochs=EPOCHS,
        lr_scheduler=_one_cycle,
        lr_scheduler_interval="step",
    )
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(modules[0].state_dict()[name], value, rtol=0, atol=1e-12, msg=name)
        torch.testing.assert_close(modules[1].state_dict()[name], value, rtol=0, atol=1e-12, msg=name)


def test_mistakes_are_named() -> None:
    settings = lamploop.settings.TrainingSettings
    with pytest.raises(ConfigurationError, match="lr_scheduler owns the learning rates"):
        settings(lr_scheduler=_one_cycle, learning_rate_schedule=lamploop.decrement(1, 0.5))
    with pytest.raises(
        ConfigurationError, match="lr_scheduler_interval must be 'epoch' or 'step', got 'batch'"
    ):
        settings(lr_scheduler=_one_cycle, lr_scheduler_interval="batch")
    with pytest.raises(ConfigurationError, match=r"lr_scheduler must return a torch\.optim\.lr_scheduler"):
        _fit([], lambda optimizer: 0.5, "epoch")
