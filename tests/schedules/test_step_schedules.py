"""Per-step learning rates: base * epoch factor * step factor, at every optimizer step."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from workers import rank as worker

import lamploop
from lamploop.errors import ConfigurationError
from lamploop.schedules.step import warmup_cosine, warmup_linear

LR = 0.1
STEPS_PER_EPOCH = 6  # 48 examples in batches of 8


def _recording_sgd(seen: list[float]) -> Any:
    def factory(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(params, lr=LR)
        step = optimizer.step

        def recorded(*args: Any, **kwargs: Any) -> Any:
            seen.append(optimizer.param_groups[0]["lr"])
            return step(*args, **kwargs)

        optimizer.step = recorded  # type: ignore[method-assign]
        return optimizer

    return factory


def _fit(seen: list[float], max_epochs: int, **kwargs: Any) -> lamploop.LoopState | None:
    (x, y), _ = worker.fit_data()
    return lamploop.fit(
        model=lamploop.SupervisedModel(worker.make_module({"seed": 2}, 0)),
        optimizer_factory=_recording_sgd(seen),
        train_batches=lamploop.tensor_batches(x[:48], y[:48], batch_size=8),
        max_epochs=max_epochs,
        learning_rate_schedule=lamploop.decrement(1, 0.5),
        step_schedule=warmup_cosine(warmup_steps=4, total_steps=15, steps_per_epoch=STEPS_PER_EPOCH),
        reporters=[],
        **kwargs,
    )


def test_every_step_gets_base_times_epoch_factor_times_step_factor(tmp_path: Path) -> None:
    seen: list[float] = []
    _fit(seen, 3)
    schedule = warmup_cosine(warmup_steps=4, total_steps=15, steps_per_epoch=STEPS_PER_EPOCH)
    expected = [LR * 0.5**e * schedule.factor(e, s) for e in range(3) for s in range(STEPS_PER_EPOCH)]
    assert seen == pytest.approx(expected, rel=1e-12, abs=0)
    assert seen[0] == pytest.approx(LR / 4)  # warm-up starts low
    assert seen[-1] == 0.0  # and the cosine has reached 0 at step 15
    # a run resumed after epoch 1 asks for exactly the rest
    first: list[float] = []
    _fit(first, 1, checkpoint_dir=tmp_path)
    rest: list[float] = []
    _fit(rest, 3, checkpoint_dir=tmp_path)
    assert first + rest == seen


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["all_reduce", "reduce_to_root"])
async def test_two_ranks_step_like_one_rank_on_the_union(strategy: str) -> None:
    data = {"seed": 9, "batches": [5, 5]}
    schedule = warmup_linear(warmup_steps=3, total_steps=10, steps_per_epoch=5)
    modules = [worker.make_module({"seed": 2}, rank) for rank in range(2)]
    with anyio.fail_after(50):
        await lamploop.local_data_parallel_training_loop(
            [
                (
                    lamploop.SupervisedModel(m),
                    worker.stream_factory(lambda e, r: worker.train_batches_of(data, e, r)),
                    None,
                )
                for m in modules
            ],
            worker.optimizer_factory({"name": "sgd", "lr": 0.2}),
            2,
            strategy=strategy,
            step_schedule=schedule,
        )
    reference = worker.make_module({"seed": 2}, 0)
    await lamploop.drive_distributed_training(
        nranks=1,
        device="cpu",
        control=None,
        model=lamploop.SupervisedModel(reference),
        optimizer_factory=worker.optimizer_factory({"name": "sgd", "lr": 0.2}),
        train_batches=worker.stream_factory(lambda e, r: worker.union_train_batches(data, e, 2, 1)),
        validation_batches=None,
        max_epochs=2,
        step_schedule=schedule,
    )
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(modules[0].state_dict()[name], value, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("bad", [float("nan"), -0.5, math.inf])
def test_a_bad_step_factor_is_named(bad: float) -> None:
    class Broken:
        def factor(self, epoch: int, step: int) -> float:
            return bad if step == 2 else 1.0

    (x, y), _ = worker.fit_data()
    with pytest.raises(
        ConfigurationError, match=f"the step schedule Broken gave the factor {bad!r} for epoch 0, step 2"
    ):
        lamploop.fit(
            model=lamploop.SupervisedModel(worker.make_module({"seed": 2}, 0)),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=lamploop.tensor_batches(x, y, batch_size=8),
            max_epochs=1,
            step_schedule=Broken(),
            reporters=[],
        )


def test_bad_step_schedules_are_refused_up_front() -> None:
    with pytest.raises(ConfigurationError, match="step_schedule must have factor"):
        lamploop.settings.TrainingSettings(step_schedule=lambda e, s: 1.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="warmup_cosine: needs warmup_steps <= total_steps"):
        warmup_cosine(warmup_steps=10, total_steps=5, steps_per_epoch=3)
    with pytest.raises(ConfigurationError, match="warmup_linear: steps_per_epoch must be an int >= 1"):
        warmup_linear(warmup_steps=1, total_steps=5, steps_per_epoch=0)
