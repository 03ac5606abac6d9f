"""Acceptance tests of the learning-rate schedules, written from the documentation alone.

Sources: docs/schedules.md, docs/concepts/schedules.md, docs/api/schedules.md,
docs/api/step_schedules.md (the docstrings of ``lamploop.schedules.epoch``,
``lamploop.schedules.step`` and ``lamploop.schedules.torch_scheduler``), docs/api/errors.md
and DESIGN.md.  Every rate is the one the optimizer really used: a recording SGD reads
``param_groups[i]["lr"]`` as its ``step()`` runs, in small real ``lamploop.fit`` runs (one
process, world size 1), and is compared with the documented formula computed here by hand or
with ``torch.optim.lr_scheduler``'s own scheduler stepped as the docs say.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, OneCycleLR, ReduceLROnPlateau, StepLR

import lamploop
from lamploop.errors import ConfigurationError
from lamploop.schedules import (
    PlateauState,
    cyclic,
    decrement,
    from_epoch_count,
    linear,
    noop,
    reduce_lr_on_plateau,
    step_after,
    warmup_cosine,
    warmup_linear,
)
from lamploop.schedules.torch_scheduler import LR_SCHEDULER_KEY

BASE_LRS = (0.1, 0.01)  # two param groups: the weight and the bias of the model
STEPS_PER_EPOCH = 4  # 32 examples in batches of 8


class Crash(Exception):
    """Raised by the recording optimizer to stop a run in the middle of an epoch."""


class Recorder:
    """An optimizer factory whose SGD records every step's rates (and momenta)."""

    def __init__(self, *, momentum: float = 0.0, crash_at: int | None = None) -> None:
        self.rates: list[tuple[float, ...]] = []
        self.momenta: list[tuple[float, ...]] = []
        self.momentum = momentum
        self.crash_at = crash_at
        self.optimizers_made = 0

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        recorder = self

        class RecordedSGD(torch.optim.SGD):
            def step(self, closure: Any = None) -> Any:
                if recorder.crash_at is not None and len(recorder.rates) == recorder.crash_at:
                    raise Crash(f"stopped before step {recorder.crash_at}")
                recorder.rates.append(tuple(group["lr"] for group in self.param_groups))
                recorder.momenta.append(tuple(group["momentum"] for group in self.param_groups))
                return super().step(closure)

        self.optimizers_made += 1
        weight, bias = list(params)
        return RecordedSGD(
            [{"params": [weight], "lr": BASE_LRS[0]}, {"params": [bias], "lr": BASE_LRS[1]}],
            lr=BASE_LRS[0],
            momentum=self.momentum,
        )


def _data(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 4, generator=generator)
    return x, (x[:, 0] > 0).long()


@attrs.frozen
class Run:
    rates: list[tuple[float, ...]]
    momenta: list[tuple[float, ...]]
    state: lamploop.LoopState | None
    parameters: dict[str, torch.Tensor]


def train(
    *,
    max_epochs: int,
    recorder: Recorder | None = None,
    examples: int = 32,
    adversarial_validation: bool = False,
    **options: Any,
) -> Run:
    """One small ``fit`` run; ``adversarial_validation`` validates on the flipped labels."""
    recorder = recorder if recorder is not None else Recorder()
    x, y = _data(examples)
    torch.manual_seed(0)
    model = lamploop.SupervisedModel(torch.nn.Linear(4, 2))
    if adversarial_validation:
        options["validation_batches"] = lamploop.tensor_batches(x, 1 - y, batch_size=len(x), shuffle=False)
    state = lamploop.fit(
        model=model,
        optimizer_factory=recorder,
        train_batches=lamploop.tensor_batches(x, y, batch_size=8, seed=3),
        max_epochs=max_epochs,
        reporters=[],
        device="cpu",
        **options,
    )
    parameters = {name: tensor.detach().clone() for name, tensor in model.module.state_dict().items()}
    return Run(list(recorder.rates), list(recorder.momenta), state, parameters)


def expected_rates(factors: Sequence[float]) -> list[tuple[float, ...]]:
    return [tuple(base * factor for base in BASE_LRS) for factor in factors]


def assert_rates(actual: Sequence[tuple[float, ...]], expected: Sequence[tuple[float, ...]]) -> None:
    assert len(actual) == len(expected), (actual, expected)
    for step, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15), (step, actual, expected)


def per_step(epoch_factors: Sequence[float], steps: int = STEPS_PER_EPOCH) -> list[float]:
    return [factor for factor in epoch_factors for _ in range(steps)]


def torch_reference(
    factory: Callable[[torch.optim.Optimizer], Any],
    *,
    epochs: int,
    interval: str,
    momentum: float = 0.0,
    steps: int = STEPS_PER_EPOCH,
) -> tuple[list[tuple[float, ...]], list[tuple[float, ...]]]:
    """The rates (and momenta) of PyTorch's own scheduler, stepped per step or per epoch."""
    parameters = [torch.nn.Parameter(torch.zeros(1)) for _ in BASE_LRS]
    optimizer = torch.optim.SGD(
        [{"params": [p], "lr": lr} for p, lr in zip(parameters, BASE_LRS, strict=True)],
        lr=BASE_LRS[0],
        momentum=momentum,
    )
    scheduler = factory(optimizer)
    rates, momenta = [], []
    for _ in range(epochs):
        for _ in range(steps):
            rates.append(tuple(group["lr"] for group in optimizer.param_groups))
            momenta.append(tuple(group["momentum"] for group in optimizer.param_groups))
            optimizer.step()
            if interval == "step":
                scheduler.step()
        if interval == "epoch":
            scheduler.step()
    return rates, momenta


def crash_and_resume(
    directory: Path, *, max_epochs: int, crash_at: int, every: int = 2, **options: Any
) -> tuple[lamploop.Checkpoint, Run]:
    """Run until the optimizer step ``crash_at`` fails, then resume in the same directory."""
    with pytest.raises(Exception) as raised:  # noqa: PT011 - the crash may come back wrapped
        train(
            max_epochs=max_epochs,
            recorder=Recorder(momentum=options.get("momentum_", 0.0), crash_at=crash_at),
            checkpoint_dir=directory,
            checkpoint_every_n_steps=every,
            keep_last=None,
            **{k: v for k, v in options.items() if k != "momentum_"},
        )
    assert "Crash" in repr(raised.value) or raised.group_contains(Crash)
    checkpoint = lamploop.load_checkpoint(directory)
    resumed = train(
        max_epochs=max_epochs,
        recorder=Recorder(momentum=options.get("momentum_", 0.0)),
        checkpoint_dir=directory,
        checkpoint_every_n_steps=every,
        keep_last=None,
        **{k: v for k, v in options.items() if k != "momentum_"},
    )
    return checkpoint, resumed


def assert_same_parameters(a: Run, b: Run) -> None:
    assert a.parameters.keys() == b.parameters.keys()
    for name in a.parameters:
        assert torch.equal(a.parameters[name], b.parameters[name]), name


# ----------------------------------------------------------------------------------------------
# Epoch schedules by hand (pure functions)


def test_modules_and_names_are_where_the_docs_say() -> None:
    import lamploop.schedules.epoch as epoch_module
    import lamploop.schedules.step as step_module
    import lamploop.schedules.torch_scheduler as torch_module

    assert lamploop.schedules.linear is epoch_module.linear
    assert lamploop.linear is epoch_module.linear
    assert lamploop.schedules.warmup_cosine is step_module.warmup_cosine
    assert callable(torch_module.make_lr_scheduler)
    assert LR_SCHEDULER_KEY == "lamploop_lr_scheduler"


@pytest.mark.parametrize(
    ("schedule", "factors"),
    [
        (noop(), [1.0] * 6),
        (decrement(every=2, fraction=0.5), [0.5 ** (e // 2) for e in range(6)]),
        (linear(start=2.0, end=0.5, max_steps=3), [2.0, 1.5, 1.0, 0.5, 0.5, 0.5]),
        (step_after(steps=2, factor=0.1), [1.0, 1.0, 0.1, 0.1, 0.1, 0.1]),
        (cyclic(max_factor=3.0, period_length=4), [1.0, 2.0, 3.0, 2.0, 1.0, 2.0]),
        (from_epoch_count(lambda e: 1 / (e + 1)), [1 / (e + 1) for e in range(6)]),
    ],
    ids=["noop", "decrement", "linear", "step_after", "cyclic", "from_epoch_count"],
)
def test_built_in_epoch_schedule_factors_by_hand(schedule: Any, factors: list[float]) -> None:
    state = schedule.init()
    assert state is None  # stateless: a plain None
    got = []
    for epoch in range(6):
        again = schedule.learning_rate_factor(state, epoch, 0.5)
        state, factor = schedule.learning_rate_factor(state, epoch, 0.5)
        assert again == (state, factor)  # pure
        got.append(factor)
    assert got == pytest.approx(factors, rel=1e-12)


def test_reduce_lr_on_plateau_by_hand_follows_the_documented_rule() -> None:
    # docs/concepts/schedules.md, "Calling one by hand"
    schedule = reduce_lr_on_plateau(patience=1, reduce_factor=0.5)
    state = schedule.init()
    factors = []
    for epoch, loss in enumerate([None, 1.0, 0.9, 0.95, 0.96, 0.97]):
        state, factor = schedule.learning_rate_factor(state, epoch, loss)
        factors.append(factor)
    assert factors == [1.0, 1.0, 1.0, 1.0, 0.5, 0.5]
    # After the reduction at epoch 4 "the count restarts", and 0.97 is one more validation
    # without improvement (the comment in the docs prints bad_validations=0: see the report).
    assert state == PlateauState(factor=0.5, best=0.9, bad_validations=1)
    # threshold: an improvement must beat best - threshold * |best|; min_factor is a floor
    schedule = reduce_lr_on_plateau(
        patience=0, reduce_factor=0.1, threshold=0.1, min_factor=0.05, start_factor=2.0
    )
    state = schedule.init()
    factors = []
    for epoch, loss in enumerate([None, 1.0, 0.95, 0.85, 0.8, 0.7]):
        state, factor = schedule.learning_rate_factor(state, epoch, loss)
        factors.append(factor)
    # 0.95 is not below 1.0 - 0.1: reduce (2 -> 0.2); 0.85 is; 0.8 is not below 0.85 - 0.085:
    # reduce (0.2 -> 0.05, floored); 0.7 is below 0.85 - 0.085.
    assert factors == pytest.approx([2.0, 2.0, 0.2, 0.2, 0.05, 0.05])
    assert state.best == pytest.approx(0.7)


def plateau_reference(
    asked_losses: Sequence[float | None],
    *,
    patience: int,
    reduce_factor: float,
    threshold: float,
    frequency: int,
    start_factor: float = 1.0,
    min_factor: float = 0.0,
) -> tuple[list[float], list[PlateauState]]:
    """The documented plateau rule: factors per epoch and the state after each ask."""
    factor, best, bad = start_factor, None, 0
    factors, states = [], []
    for epoch, loss in enumerate(asked_losses):
        new_validation = loss is not None and (epoch - 1) % frequency == 0
        if new_validation:
            if best is None or loss < best - threshold * abs(best):
                best, bad = loss, 0
            else:
                bad += 1
                if bad > patience:
                    factor, bad = max(factor * reduce_factor, min_factor), 0
        factors.append(factor)
        states.append(PlateauState(factor=factor, best=best, bad_validations=bad))
    return factors, states


# ----------------------------------------------------------------------------------------------
# Epoch schedules in a real run


@pytest.mark.parametrize(
    ("schedule", "factors"),
    [
        (decrement(every=2, fraction=0.5), [1.0, 1.0, 0.5, 0.5]),
        (cyclic(max_factor=3.0, period_length=4), [1.0, 2.0, 3.0, 2.0]),
        (step_after(steps=1, factor=0.1), [1.0, 0.1, 0.1, 0.1]),
    ],
    ids=["decrement", "cyclic", "step_after"],
)
def test_epoch_schedule_sets_every_param_group_rate_for_the_whole_epoch(
    schedule: Any, factors: list[float]
) -> None:
    run = train(max_epochs=4, learning_rate_schedule=schedule)
    assert_rates(run.rates, expected_rates(per_step(factors)))
    assert run.state is not None
    assert [entry.learning_rate_factor for entry in run.state.learning_curve] == pytest.approx(factors)


def test_a_factor_at_or_below_zero_ends_training() -> None:
    # linear with end=0: "training stops at epoch max_steps"
    run = train(max_epochs=6, learning_rate_schedule=linear(start=1.0, end=0.0, max_steps=2))
    assert_rates(run.rates, expected_rates(per_step([1.0, 0.5])))
    assert run.state is not None
    assert run.state.epoch == 2
    assert len(run.state.learning_curve) == 2
    # a negative factor stops too, at the first epoch whose factor is <= 0
    run = train(max_epochs=6, learning_rate_schedule=from_epoch_count(lambda e: [1.0, 0.25, -1.0, 1.0][e]))
    assert_rates(run.rates, expected_rates(per_step([1.0, 0.25])))
    assert run.state is not None
    assert run.state.epoch == 2


@functools.cache
def plateau_uninterrupted() -> Run:
    return train(max_epochs=6, **plateau_options())


def plateau_options() -> dict[str, Any]:
    return {
        "learning_rate_schedule": reduce_lr_on_plateau(
            patience=0, reduce_factor=0.5, threshold=0.0, validation_frequency=2
        ),
        "validation_frequency": 2,
        "adversarial_validation": True,
    }


def asked_losses(state: lamploop.LoopState, epochs: int) -> list[float | None]:
    """The smoothed validation loss carried into each epoch (None before any validation)."""
    carried: float | None = None
    asked = []
    entries = {entry.epoch: entry for entry in state.learning_curve}
    for epoch in range(epochs):
        asked.append(carried)
        entry = entries[epoch]
        if entry.validation_loss is not None:
            carried = entry.validation_loss[0]
    return asked


def test_reduce_lr_on_plateau_in_a_run_with_validation_every_other_epoch() -> None:
    run = plateau_uninterrupted()
    assert run.state is not None
    validated = [entry.validation_loss is not None for entry in run.state.learning_curve]
    assert validated == [True, False, True, False, True, False]
    factors, _ = plateau_reference(
        asked_losses(run.state, 6), patience=0, reduce_factor=0.5, threshold=0.0, frequency=2
    )
    # validating on flipped labels makes the loss worse every time: two reductions, and
    # the loss carried over the epochs without validation is not counted again
    assert factors == [1.0, 1.0, 1.0, 0.5, 0.5, 0.25]
    assert_rates(run.rates, expected_rates(per_step(factors)))


def test_reduce_lr_on_plateau_resumed_at_an_epoch_end_asks_what_the_uninterrupted_run_asked(
    tmp_path: Path,
) -> None:
    reference = plateau_uninterrupted()
    assert reference.state is not None
    first = train(max_epochs=3, checkpoint_dir=tmp_path, **plateau_options())
    schedule = plateau_options()["learning_rate_schedule"]
    checkpoint = lamploop.load_checkpoint(tmp_path, schedule=schedule)
    # the state the next epoch (3) will use, typed, and plain JSON without the schedule
    _, states = plateau_reference(
        asked_losses(reference.state, 6), patience=0, reduce_factor=0.5, threshold=0.0, frequency=2
    )
    assert isinstance(checkpoint.schedule_state, PlateauState)
    assert checkpoint.schedule_state == states[2]
    raw = lamploop.load_checkpoint(tmp_path).schedule_state
    assert isinstance(raw, dict)
    assert raw["factor"] == states[2].factor
    resumed = train(max_epochs=6, checkpoint_dir=tmp_path, **plateau_options())
    assert_rates(first.rates + resumed.rates, reference.rates)
    assert_same_parameters(resumed, reference)


def test_reduce_lr_on_plateau_resumed_inside_an_epoch_sets_the_same_rates(tmp_path: Path) -> None:
    reference = plateau_uninterrupted()
    # the crash comes before step 15: the latest checkpoint is epoch 3's, after 2 of its steps
    checkpoint, resumed = crash_and_resume(tmp_path, max_epochs=6, crash_at=15, **plateau_options())
    assert checkpoint.position is not None
    assert checkpoint.state.loop_state.epoch == 3
    assert_rates(resumed.rates, reference.rates[14:])
    assert_same_parameters(resumed, reference)


@attrs.frozen
class Count:
    asked: int = 0


@attrs.define
class CountingSchedule:
    """Its factor depends on how often it was asked: a double ask on resume shows."""

    calls: list[tuple[Count, int, float | None]] = attrs.field(factory=list)
    needs_validation_loss = False

    def init(self) -> Count:
        return Count()

    def learning_rate_factor(
        self, state: Count, epoch: int, last_validation_loss: float | None
    ) -> tuple[Count, float]:
        self.calls.append((state, epoch, last_validation_loss))
        return Count(state.asked + 1), 1.0 / (1 + state.asked)


def test_custom_schedule_state_travels_through_the_checkpoint_and_is_not_asked_twice(
    tmp_path: Path,
) -> None:
    whole = CountingSchedule()
    reference = train(max_epochs=4, learning_rate_schedule=whole)
    assert_rates(reference.rates, expected_rates(per_step([1.0, 1 / 2, 1 / 3, 1 / 4])))
    # asked before every epoch and once more when it stops
    assert [(state.asked, epoch) for state, epoch, _ in whole.calls] == [(e, e) for e in range(5)]

    first_part = CountingSchedule()
    first = train(max_epochs=2, learning_rate_schedule=first_part, checkpoint_dir=tmp_path)
    checkpoint = lamploop.load_checkpoint(tmp_path, schedule=first_part)
    assert checkpoint.schedule_state == Count(2)  # the state epoch 2 will use
    second_part = CountingSchedule()
    second = train(max_epochs=4, learning_rate_schedule=second_part, checkpoint_dir=tmp_path)
    assert first_part.calls == whole.calls[:3]
    assert second_part.calls == whole.calls[2:]
    assert_rates(first.rates + second.rates, reference.rates)


# ----------------------------------------------------------------------------------------------
# Step schedules


def warmup_reference(kind: str, warmup: int, total: int, final: float, step: int) -> float:
    """Linear warm-up to 1 over ``warmup`` steps, then down to ``final`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    if step >= total:
        return final
    progress = (step - warmup) / (total - warmup)
    if kind == "linear":
        return 1 - (1 - final) * progress
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_step_schedule_is_final_at_total_steps_also_when_it_is_all_warm_up(kind: str) -> None:
    make = warmup_cosine if kind == "cosine" else warmup_linear
    schedule = make(warmup_steps=2, total_steps=2, steps_per_epoch=2)
    got = [schedule.factor(epoch, step) for epoch in range(3) for step in range(2)]
    assert got == [0.5, 1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_step_schedule_factors_by_hand(kind: str) -> None:
    make = warmup_cosine if kind == "cosine" else warmup_linear
    schedule = make(warmup_steps=3, total_steps=10, steps_per_epoch=4, final=0.2)
    got = [schedule.factor(epoch, step) for epoch in range(4) for step in range(4)]
    want = [warmup_reference(kind, 3, 10, 0.2, g) for g in range(16)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[-1] == pytest.approx(0.2)  # final at total_steps and after
    # the docs' example
    example = warmup_linear(warmup_steps=2, total_steps=6, steps_per_epoch=3)
    assert [round(example.factor(e, s), 3) for e in range(3) for s in range(3)] == [
        0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0
    ]  # fmt: skip


def test_step_schedule_times_epoch_schedule_in_a_run() -> None:
    epoch_schedule = decrement(every=1, fraction=0.5)
    step_schedule = warmup_cosine(warmup_steps=3, total_steps=10, steps_per_epoch=4, final=0.1)
    run = train(max_epochs=3, learning_rate_schedule=epoch_schedule, step_schedule=step_schedule)
    factors = [
        0.5**epoch * warmup_reference("cosine", 3, 10, 0.1, epoch * 4 + step)
        for epoch in range(3)
        for step in range(4)
    ]
    assert_rates(run.rates, expected_rates(factors))


def test_step_schedule_counts_optimizer_steps_with_gradient_accumulation() -> None:
    # 40 examples in batches of 8 = 5 batches, accumulated by 2: 3 optimizer steps per
    # epoch, the last one with the epoch's single remaining batch
    schedule = warmup_linear(warmup_steps=2, total_steps=6, steps_per_epoch=3)
    run = train(max_epochs=2, examples=40, accumulate_gradient_over_n_batches=2, step_schedule=schedule)
    assert_rates(run.rates, expected_rates([0.5, 1.0, 1.0, 0.75, 0.5, 0.25]))


@attrs.frozen
class ByIndex:
    """A step schedule of one's own: ``factor(epoch, step)``."""

    def factor(self, epoch: int, step: int) -> float:
        return 1.0 / (1 + 10 * epoch + step)


def test_a_step_schedule_of_ones_own_gets_the_epoch_and_the_index_of_the_step() -> None:
    run = train(max_epochs=2, step_schedule=ByIndex())
    factors = [1.0 / (1 + 10 * e + s) for e in range(2) for s in range(STEPS_PER_EPOCH)]
    assert_rates(run.rates, expected_rates(factors))


def test_step_schedule_resumed_mid_epoch_sets_the_same_rates_and_parameters(tmp_path: Path) -> None:
    options = {
        "learning_rate_schedule": decrement(every=1, fraction=0.5),
        "step_schedule": warmup_cosine(warmup_steps=3, total_steps=12, steps_per_epoch=4),
    }
    reference = train(max_epochs=3, recorder=Recorder(momentum=0.9), **options)
    checkpoint, resumed = crash_and_resume(tmp_path, max_epochs=3, crash_at=7, momentum_=0.9, **options)
    assert checkpoint.position is not None  # taken inside epoch 1, after 2 of its steps
    assert checkpoint.state.loop_state.epoch == 1
    assert_rates(resumed.rates, reference.rates[6:])
    assert_same_parameters(resumed, reference)


# ----------------------------------------------------------------------------------------------
# torch.optim.lr_scheduler


def test_torch_scheduler_stepped_every_epoch_by_default() -> None:
    def factory(optimizer: torch.optim.Optimizer) -> Any:
        return CosineAnnealingLR(optimizer, T_max=3, eta_min=0.001)

    run = train(max_epochs=4, lr_scheduler=factory)
    rates, _ = torch_reference(factory, epochs=4, interval="epoch")
    assert_rates(run.rates, rates)
    assert len(set(run.rates[4:8])) == 1
    assert run.rates[4] != run.rates[0]


def test_torch_scheduler_stepped_every_step_cycles_rates_and_momentum() -> None:
    def factory(optimizer: torch.optim.Optimizer) -> Any:
        return OneCycleLR(optimizer, max_lr=[0.2, 0.02], total_steps=12)

    run = train(
        max_epochs=3, recorder=Recorder(momentum=0.9), lr_scheduler=factory, lr_scheduler_interval="step"
    )
    rates, momenta = torch_reference(factory, epochs=3, interval="step", momentum=0.9)
    assert_rates(run.rates, rates)
    assert_rates(run.momenta, momenta)


def test_torch_scheduler_beside_noop_epoch_schedule_is_allowed() -> None:
    def factory(optimizer: torch.optim.Optimizer) -> Any:
        return StepLR(optimizer, step_size=1, gamma=0.5)

    run = train(max_epochs=3, lr_scheduler=factory, learning_rate_schedule=noop())
    assert_rates(run.rates, expected_rates(per_step([1.0, 0.5, 0.25])))


def test_torch_scheduler_rate_of_zero_does_not_end_training() -> None:
    def factory(optimizer: torch.optim.Optimizer) -> Any:
        return LambdaLR(optimizer, lambda epoch: 1.0 if epoch == 0 else 0.0)

    run = train(max_epochs=3, lr_scheduler=factory)
    assert_rates(run.rates, expected_rates(per_step([1.0, 0.0, 0.0])))
    assert run.state is not None
    assert run.state.epoch == 3


def test_torch_scheduler_resumed_at_an_epoch_end_steps_on_exactly(tmp_path: Path) -> None:
    def factory(optimizer: torch.optim.Optimizer) -> Any:
        return StepLR(optimizer, step_size=2, gamma=0.1)

    first = train(max_epochs=2, lr_scheduler=factory, checkpoint_dir=tmp_path)
    resumed = train(max_epochs=4, lr_scheduler=factory, checkpoint_dir=tmp_path)
    rates, _ = torch_reference(factory, epochs=4, interval="epoch")
    assert_rates(first.rates + resumed.rates, rates)
    assert_rates(rates, expected_rates(per_step([1.0, 1.0, 0.1, 0.1])))


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_torch_scheduler_resumed_mid_epoch_steps_on_exactly(tmp_path: Path, interval: str) -> None:
    def factory(optimizer: torch.optim.Optimizer) -> Any:
        if interval == "step":
            return OneCycleLR(optimizer, max_lr=[0.2, 0.02], total_steps=12)
        return StepLR(optimizer, step_size=1, gamma=0.5)

    options = {"lr_scheduler": factory, "lr_scheduler_interval": interval}
    reference = train(max_epochs=3, recorder=Recorder(momentum=0.9), **options)
    rates, momenta = torch_reference(factory, epochs=3, interval=interval, momentum=0.9)
    assert_rates(reference.rates, rates)
    checkpoint, resumed = crash_and_resume(tmp_path, max_epochs=3, crash_at=7, momentum_=0.9, **options)
    # the scheduler's state_dict() is beside the optimizer's, under LR_SCHEDULER_KEY
    saved = checkpoint.state.optimizer[LR_SCHEDULER_KEY]
    assert saved["last_epoch"] == (6 if interval == "step" else 1)
    assert_rates(resumed.rates, reference.rates[6:])
    assert_rates(resumed.momenta, momenta[6:])
    assert_same_parameters(resumed, reference)


# ----------------------------------------------------------------------------------------------
# Refused before anything starts


def assert_refused(
    tmp_path: Path, match: str | None = None, error: type[Exception] = ConfigurationError, **options: Any
) -> ConfigurationError:
    recorder = Recorder()
    with pytest.raises(error, match=match) as raised:
        train(max_epochs=2, recorder=recorder, checkpoint_dir=tmp_path, **options)
    assert recorder.rates == []  # no optimizer step
    assert not tmp_path.exists() or lamploop.latest_checkpoint(tmp_path) is None
    return raised.value


def _step_lr(optimizer: torch.optim.Optimizer) -> Any:
    return StepLR(optimizer, step_size=1)


@pytest.mark.parametrize(
    "beside",
    [
        {"step_schedule": warmup_cosine(warmup_steps=2, total_steps=8, steps_per_epoch=4)},
        {"learning_rate_schedule": linear(start=1.0, end=0.5, max_steps=2)},
        {"learning_rate_schedule": decrement(every=1, fraction=1.0)},
    ],
    ids=["step_schedule", "linear", "decrement"],
)
def test_torch_scheduler_with_another_mechanism_is_refused(tmp_path: Path, beside: dict) -> None:
    assert_refused(tmp_path, match="lr_scheduler owns the learning rates", lr_scheduler=_step_lr, **beside)


def test_bad_lr_scheduler_arguments_are_refused(tmp_path: Path) -> None:
    error = assert_refused(tmp_path / "a", lr_scheduler=_step_lr, lr_scheduler_interval="batch")
    assert "batch" in str(error)
    # a scheduler where a factory is expected
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    error = assert_refused(tmp_path / "b", lr_scheduler=StepLR(optimizer, step_size=1))
    assert "StepLR" in str(error)
    # a factory that gives no scheduler
    error = assert_refused(tmp_path / "c", lr_scheduler=lambda optimizer: optimizer)
    assert "SGD" in str(error)


def test_torch_reduce_lr_on_plateau_is_refused_before_training_or_works(tmp_path: Path) -> None:
    recorder = Recorder()
    error: BaseException | None = None
    try:
        train(
            max_epochs=2,
            recorder=recorder,
            checkpoint_dir=tmp_path,
            lr_scheduler=lambda optimizer: ReduceLROnPlateau(optimizer),
        )
    except Exception as raised:
        error = raised
    if error is not None:  # refused: clearly, and before the first step
        assert isinstance(error, ConfigurationError), repr(error)
        assert recorder.rates == []
        assert "ReduceLROnPlateau" in str(error)


@pytest.mark.parametrize(
    "make",
    [
        lambda: decrement(every=0, fraction=0.5),
        lambda: decrement(every=1, fraction=1.5),
        lambda: decrement(every=1, fraction=-0.1),
        lambda: linear(start=1.0, end=0.0, max_steps=0),
        lambda: step_after(steps=-1, factor=0.5),
        lambda: cyclic(max_factor=2.0, period_length=1),
        lambda: cyclic(max_factor=0.0, period_length=4),
        lambda: reduce_lr_on_plateau(patience=-1),
        lambda: reduce_lr_on_plateau(reduce_factor=-0.5),
        lambda: reduce_lr_on_plateau(validation_frequency=0),
        lambda: reduce_lr_on_plateau(min_factor=-1.0),
        lambda: warmup_cosine(warmup_steps=5, total_steps=4, steps_per_epoch=4),
        lambda: warmup_linear(warmup_steps=5, total_steps=4, steps_per_epoch=4),
        lambda: warmup_cosine(warmup_steps=1, total_steps=0, steps_per_epoch=4),
        lambda: warmup_cosine(warmup_steps=-1, total_steps=4, steps_per_epoch=4),
        lambda: warmup_linear(warmup_steps=1, total_steps=4, steps_per_epoch=0),
    ],
    ids=[
        "decrement-every-0",
        "decrement-fraction-1.5",
        "decrement-fraction-negative",
        "linear-max_steps-0",
        "step_after-negative",
        "cyclic-period-1",
        "cyclic-max-factor-0",
        "plateau-patience",
        "plateau-reduce-factor",
        "plateau-validation-frequency",
        "plateau-min-factor",
        "cosine-warmup-over-total",
        "linear-warmup-over-total",
        "cosine-total-0",
        "cosine-warmup-negative",
        "linear-steps-per-epoch-0",
    ],
)
def test_invalid_schedule_parameters_are_configuration_errors(make: Callable[[], Any]) -> None:
    with pytest.raises(ConfigurationError) as raised:
        make()
    assert isinstance(raised.value, ValueError)  # bad arguments are ValueErrors too
    assert str(raised.value)


def test_plateau_schedule_without_validation_or_with_another_frequency_is_refused(
    tmp_path: Path,
) -> None:
    error = assert_refused(tmp_path / "a", learning_rate_schedule=reduce_lr_on_plateau(patience=1))
    assert "validation" in str(error)
    error = assert_refused(
        tmp_path / "b",
        learning_rate_schedule=reduce_lr_on_plateau(patience=1, validation_frequency=2),
        validation_frequency=1,
        adversarial_validation=True,
    )
    assert "validation_frequency" in str(error) or "frequency" in str(error)

    @attrs.frozen
    class ReadsLoss:
        needs_validation_loss = True

        def init(self) -> None:
            return None

        def learning_rate_factor(self, state: None, epoch: int, loss: float | None) -> tuple[None, float]:
            return None, 1.0

    assert_refused(tmp_path / "c", learning_rate_schedule=ReadsLoss())


@pytest.mark.parametrize(
    "options",
    [
        {"learning_rate_schedule": warmup_cosine(warmup_steps=1, total_steps=8, steps_per_epoch=4)},
        {"step_schedule": linear(start=1.0, end=0.5, max_steps=2)},
        {"step_schedule": lambda epoch, step: 1.0},
        {"learning_rate_schedule": object()},
    ],
    ids=["step-schedule-as-epoch", "epoch-schedule-as-step", "function-as-step", "object-as-epoch"],
)
def test_mechanisms_passed_under_the_wrong_keyword_are_refused(tmp_path: Path, options: dict) -> None:
    error = assert_refused(tmp_path, **options)
    keyword = next(iter(options))
    assert keyword in str(error)


@attrs.frozen
class Returns:
    value: float

    def factor(self, epoch: int, step: int) -> float:
        return self.value if (epoch, step) == (0, 1) else 1.0


@pytest.mark.parametrize("value", [-0.5, math.nan, math.inf])
def test_a_step_factor_that_is_negative_or_not_finite_is_a_configuration_error(value: float) -> None:
    recorder = Recorder()
    with pytest.raises(ConfigurationError):
        train(max_epochs=1, recorder=recorder, step_schedule=Returns(value))
    assert len(recorder.rates) <= 1  # the bad factor was never used


@pytest.mark.parametrize(
    "factor",
    [
        math.nan,
        math.inf,
        None,
    ],
    ids=["nan", "inf", "None"],
)
def test_an_epoch_factor_that_is_not_a_finite_number_is_refused(tmp_path: Path, factor: Any) -> None:
    error = assert_refused(tmp_path, learning_rate_schedule=from_epoch_count(lambda epoch: factor))
    assert "factor" in str(error)


def test_a_step_factor_of_zero_does_not_end_training() -> None:
    run = train(max_epochs=2, step_schedule=Returns(0.0))
    assert_rates(run.rates, expected_rates([1.0, 0.0] + [1.0] * 6))
