"""Acceptance tests from the docs alone, round 5: custom batch streams and reporters, multi-node,
the concept pages, the schedules page and the API pages of settings, state, sync, step schedules
and metrics.

Every test quotes the sentence it checks.  References are written here, apart from lamploop: a
float64 SGD loop over the union of each step's batches, torch's own ``StepLR``, and the
schedules' factors asked by hand.  The multi-process tests (marked ``soak``) run the page's "By
hand" recipe: the root in this process, the followers in tests/workers/acceptance_r5_worker.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch

import lamploop
from lamploop import BatchContext
from lamploop.control import Rendezvous, Stop, Train
from lamploop.errors import BatchError, LamploopError
from lamploop.schedules import linear, warmup_cosine
from lamploop.settings import TrainingSettings
from lamploop.state import converter

sys.path.insert(0, str(Path(__file__).resolve().parent))

from support import WORKERS, free_port
from workers import acceptance_r5_worker as worker
from workers.records import load_record

LR = 0.1

# ----------------------------------------------------------------------------------------------
# helpers written apart from lamploop


def _data64(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, generator=generator, dtype=torch.float64)
    y = torch.randn(n, 2, generator=generator, dtype=torch.float64)
    return x, y


def _linear64(seed: int = 1) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2).double()


def _mse_sum(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """docs: `mse_loss`: "an example's loss is the sum over its output elements"; a sum over the batch."""
    return ((module(x) - y) ** 2).sum()


def _reference_sgd(
    initial: dict[str, torch.Tensor], steps: list[tuple[torch.Tensor, torch.Tensor]], rates: list[float]
) -> dict[str, torch.Tensor]:
    """Plain SGD, one step per (x, y) with the rate given: the gradient of the step's mean loss."""
    module = torch.nn.Linear(3, 2).double()
    module.load_state_dict(initial)
    optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    for (x, y), rate in zip(steps, rates, strict=True):
        for group in optimizer.param_groups:
            group["lr"] = rate
        optimizer.zero_grad()
        (_mse_sum(module, x, y) / len(y)).backward()
        optimizer.step()
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-12) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name].double(), b[name].double(), rtol=0, atol=tol, msg=name)


class _Uneven:
    """Rank ``r`` yields the batches ``shares[r]`` (index ranges into x, y): uneven streams."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, shares: dict[int, list[tuple[int, int]]]) -> None:
        self.x, self.y, self.shares = x, y, shares

    def of(self, rank: int) -> lamploop.BatchStreamFactory:
        async def stream(context: BatchContext) -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
            for a, b in self.shares[rank]:
                yield self.x[a:b], self.y[a:b]

        return stream


def _recording_sgd(rates: dict[int, list[float]]) -> type[torch.optim.SGD]:
    class RecordingSGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            rates.setdefault(id(self), []).append(self.param_groups[0]["lr"])
            return super().step(closure)

    return RecordingSGD


def _local_run(
    shares: dict[int, list[tuple[int, int]]],
    initial: dict[str, torch.Tensor],
    max_epochs: int,
    **keywords: Any,
) -> tuple[list[torch.nn.Module], dict[int, list[float]]]:
    x, y = _data64(28)
    streams = _Uneven(x, y, shares)
    rates: dict[int, list[float]] = {}
    sgd = _recording_sgd(rates)
    replicas = []
    modules = []
    for rank in range(len(shares)):
        module = torch.nn.Linear(3, 2).double()
        module.load_state_dict(initial)
        modules.append(module)
        replicas.append((lamploop.SupervisedModel(module, lamploop.mse_loss), streams.of(rank), None))
    anyio.run(
        lambda: lamploop.local_data_parallel_training_loop(
            replicas, lambda params: sgd(params, lr=LR), max_epochs, **keywords
        )
    )
    return modules, rates


# rank 0: five batches of 4 from examples 0..19; rank 1: two batches of 4 from 20..27
UNEVEN = {0: [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20)], 1: [(20, 24), (24, 28)]}


def _union_steps(shares: dict[int, list[tuple[int, int]]], accumulate: int) -> list[list[tuple[int, int]]]:
    """Step ``s`` holds every rank's batches ``s*k .. s*k+k-1``; steps run until every rank ran out."""
    steps = max(math.ceil(len(batches) / accumulate) for batches in shares.values())
    return [
        [batch for rank in sorted(shares) for batch in shares[rank][s * accumulate : (s + 1) * accumulate]]
        for s in range(steps)
    ]


def _cat(
    x: torch.Tensor, y: torch.Tensor, ranges: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([x[a:b] for a, b in ranges]), torch.cat([y[a:b] for a, b in ranges])


# ----------------------------------------------------------------------------------------------
# step schedules and torch schedulers over several uneven ranks


@attrs.frozen
class _RecordedStepFactor:
    """A step schedule of one's own: ``factor(epoch, step)``, recording what it is asked."""

    asked: list[tuple[int, int]] = attrs.field(factory=list, eq=False, hash=False)

    def factor(self, epoch: int, step: int) -> float:
        self.asked.append((epoch, step))
        return 1.0 / (1 + 10 * epoch + step)


@pytest.mark.timeout(60)
def test_step_schedule_steps_run_over_the_rank_with_the_most_batches_float64() -> None:
    """api/step_schedules.md (lamploop.schedules.step): "A step schedule is a pure function of
    ``(epoch, step)``, ``step`` being the step's index within its epoch"; "``steps_per_epoch`` is the
    number of optimizer steps of a full epoch (with several ranks, of the rank with the most batches,
    divided by the accumulation)"; "the learning rate of a step is ``base_lr * epoch_factor *
    step_factor``"; concepts/sync-strategies.md: "R ranks with batches of b train like one rank with
    batches of R * b" (a rank that runs out takes part with zero examples).

    Two replicas, 5 and 2 batches, 2 batches accumulated a step: 3 steps an epoch on both ranks,
    each at the rate of its index; the model ends as a float64 SGD loop over each step's union."""
    initial = _state(_linear64())
    schedule = _RecordedStepFactor()
    modules, rates = _local_run(
        UNEVEN, initial, 2, accumulate_gradient_over_n_batches=2, step_schedule=schedule
    )
    assert sorted(set(schedule.asked)) == [(e, s) for e in range(2) for s in range(3)]
    expected_rates = [LR / (1 + 10 * e + s) for e in range(2) for s in range(3)]
    assert len(rates) == 2, "all_reduce ('auto' here): every replica steps its own optimizer"
    for got in rates.values():
        assert got == pytest.approx(expected_rates, rel=1e-15, abs=0)
    x, y = _data64(28)
    steps = [_cat(x, y, ranges) for ranges in _union_steps(UNEVEN, 2)] * 2
    reference = _reference_sgd(initial, steps, expected_rates)
    for module in modules:
        _assert_close(_state(module), reference)


@pytest.mark.timeout(60)
def test_step_schedule_is_asked_for_every_step_index_of_the_longest_rank() -> None:
    """api/step_schedules.md: "``step`` being the step's index within its epoch"; "``steps_per_epoch``
    is the number of optimizer steps of a full epoch (with several ranks, of the rank with the most
    batches, divided by the accumulation)".  Ranks of 5 and 2 batches, no accumulation: the schedule
    is asked for steps 0..4 of each epoch (and for nothing else)."""
    initial = _state(_linear64())
    schedule = _RecordedStepFactor()
    _local_run(UNEVEN, initial, 2, step_schedule=schedule)
    assert sorted(set(schedule.asked)) == [(e, s) for e in range(2) for s in range(5)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["all_reduce", "reduce_to_root"])
def test_per_step_torch_scheduler_over_uneven_replicas_is_torchs_own_float64(strategy: str) -> None:
    """schedules.md: "`lr_scheduler=` (+ `lr_scheduler_interval=`)", "the rate changes: every step or
    every epoch", "PyTorch's, through a factory `optimizer -> scheduler`"; api/step_schedules.md
    (torch_scheduler): "``lr_scheduler_interval="step"`` (after every optimizer step)"; concepts/
    sync-strategies.md: "Whatever the strategy, one optimizer step uses the gradient of (sum of the
    losses of every example of the step, on every rank) / (number of those examples)".

    Two replicas of 5 and 2 batches, StepLR(step_size=1, gamma=0.5) per step, 2 epochs: the rates
    are torch's own StepLR's, on every replica that steps, and the model ends as a float64 loop over
    each step's union stepped by torch's StepLR."""
    initial = _state(_linear64())
    modules, rates = _local_run(
        UNEVEN,
        initial,
        2,
        strategy=strategy,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
        lr_scheduler_interval="step",
    )
    # torch's own loop with torch's own scheduler
    x, y = _data64(28)
    module = torch.nn.Linear(3, 2).double()
    module.load_state_dict(initial)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    torch_rates = []
    for _ in range(2):
        for ranges in _union_steps(UNEVEN, 1):
            bx, by = _cat(x, y, ranges)
            optimizer.zero_grad()
            (_mse_sum(module, bx, by) / len(by)).backward()
            torch_rates.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    stepping = 2 if strategy == "all_reduce" else 1
    assert len(rates) == stepping
    for got in rates.values():
        assert got == pytest.approx(torch_rates, rel=1e-15, abs=0)
    for replica in modules:
        _assert_close(_state(replica), _state(module))


@pytest.mark.timeout(60)
def test_auto_in_the_local_loop_is_all_reduce_every_replica_steps() -> None:
    """concepts/sync-strategies.md: "Every entry point takes `strategy=` and defaults to `"auto"`:
    ... use `all_reduce` if all of them do (always so under `fit` and
    `local_data_parallel_training_loop`), else `reduce_to_root`"; the table: `all_reduce`: "every
    rank steps its own copy"; `reduce_to_root`: "only rank 0 steps".

    Counted on the optimizers themselves: with the default every replica's optimizer steps 5 times
    an epoch; with `reduce_to_root` (the contrast) only one optimizer steps."""
    initial = _state(_linear64())
    _, default_rates = _local_run(UNEVEN, initial, 1)
    assert sorted(len(r) for r in default_rates.values()) == [5, 5]
    _, root_rates = _local_run(UNEVEN, initial, 1, strategy="reduce_to_root")
    assert [len(r) for r in root_rates.values()] == [5]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["all_reduce", "reduce_to_root"])
def test_one_rank_trains_alone_without_a_process_group(strategy: str) -> None:
    """concepts/sync-strategies.md: "With one rank (`nranks == 1`) the drivers train alone: no
    process group, nothing to sync."  `drive_distributed_training(nranks=1, control=None)`: while
    its batches are read, no `torch.distributed` process group exists; it trains as plain SGD."""
    x, y = _data64(16)
    seen: list[bool] = []

    async def stream(context: BatchContext) -> AsyncIterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, 16, 4):
            seen.append(torch.distributed.is_available() and torch.distributed.is_initialized())
            yield x[start : start + 4], y[start : start + 4]

    initial = _state(_linear64())
    module = torch.nn.Linear(3, 2).double()
    module.load_state_dict(initial)
    state = anyio.run(
        lambda: lamploop.drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=lamploop.SupervisedModel(module, lamploop.mse_loss),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
            train_batches=stream,
            validation_batches=None,
            max_epochs=1,
            strategy=strategy,
        )
    )
    assert state.epoch == 1
    assert seen == [False] * 4
    steps = [(x[s : s + 4], y[s : s + 4]) for s in range(0, 16, 4)]
    _assert_close(_state(module), _reference_sgd(initial, steps, [LR] * 4))


# ----------------------------------------------------------------------------------------------
# resuming the rates; the schedule state and the weight average in checkpoints


def _classification(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(n, 5, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _rates_run(
    directory: Path, crash_at: tuple[int, int] | None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """3 epochs of 4 steps, a linear epoch schedule times a warm-up cosine step schedule, a
    step-boundary checkpoint every 2 steps.  ``crash_at=(epoch, batch)``: the stream fails there."""
    x, y = _classification()
    inner = lamploop.tensor_batches(x, y, batch_size=16, seed=4)
    rates: dict[int, list[float]] = {}
    sgd = _recording_sgd(rates)

    def train(context: BatchContext) -> Any:
        async def stream() -> AsyncIterator[Any]:
            index = 0
            async for batch in inner(context):
                if crash_at == (context.epoch, index):
                    raise RuntimeError("the disk went away")
                index += 1
                yield batch

        return stream()

    torch.manual_seed(0)
    module = torch.nn.Linear(5, 3)
    lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: sgd(params, lr=LR, momentum=0.9),
        train_batches=train,
        max_epochs=3,
        learning_rate_schedule=linear(start=1.0, end=0.5, max_steps=2),
        step_schedule=warmup_cosine(warmup_steps=3, total_steps=12, steps_per_epoch=4),
        checkpoint_dir=directory,
        checkpoint_every_n_steps=2,
        keep_last=None,
        reporters=[],
    )
    (only,) = rates.values()
    return only, _state(module)


@pytest.mark.timeout(60)
def test_epoch_times_step_schedule_resumed_inside_an_epoch_sets_the_same_rates(tmp_path: Path) -> None:
    """schedules.md: "Every one of them resumes exactly: a run stopped and resumed (at an epoch's end
    or inside an epoch) sets the same rate at every step as the run that never stopped"; "combines
    with: a step schedule: the step's rate is `base_lr * epoch factor * step factor`".

    A run whose stream fails at batch 3 of epoch 1 (after the step checkpoint of step 2), called
    again: it resumes at that step and sets, step for step, the uninterrupted run's rates, which
    are base_lr * linear's factor * warmup_cosine's factor; it ends with the same weights."""
    whole_rates, whole_weights = _rates_run(tmp_path / "whole", None)
    epoch_factors = [
        linear(start=1.0, end=0.5, max_steps=2).learning_rate_factor(None, e, None)[1] for e in range(3)
    ]
    steps = warmup_cosine(warmup_steps=3, total_steps=12, steps_per_epoch=4)
    expected = [LR * epoch_factors[e] * steps.factor(e, s) for e in range(3) for s in range(4)]
    assert whole_rates == pytest.approx(expected, rel=1e-12, abs=0)

    with pytest.raises(Exception, match="the disk went away"):
        _rates_run(tmp_path / "cut", (1, 3))
    resumed_rates, resumed_weights = _rates_run(tmp_path / "cut", None)
    # resumed at epoch 1 after its 2nd step: the steps 6..11 of the whole run
    assert resumed_rates == whole_rates[6:]
    for name in whole_weights:
        assert torch.equal(resumed_weights[name], whole_weights[name]), name


@pytest.fixture(scope="module")
def plateau_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One fit: reduce_lr_on_plateau, smoothing 0.5, an EMA, 2 batches accumulated a step (4 optimizer
    steps an epoch), a step checkpoint every 3 steps, every checkpoint kept."""
    directory = tmp_path_factory.mktemp("plateau")
    x, y = _classification()
    torch.manual_seed(0)
    module = torch.nn.Linear(5, 3)
    schedule = lamploop.reduce_lr_on_plateau(patience=0, reduce_factor=0.5)
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.5),
        train_batches=lamploop.tensor_batches(x, y, batch_size=8, seed=2),
        validation_batches=lamploop.tensor_batches(x[:32], y[:32], batch_size=32, shuffle=False),
        max_epochs=4,
        validation_loss_exponential_smoothing_factor=0.5,
        learning_rate_schedule=schedule,
        accumulate_gradient_over_n_batches=2,
        averaging=lamploop.ema(0.9),
        checkpoint_dir=directory,
        checkpoint_every_n_steps=3,
        keep_last=None,
        reporters=[],
    )
    return {"directory": directory, "state": state, "schedule": schedule, "module": module}


def test_schedule_state_is_plain_json_in_every_checkpoint(plateau_run: dict[str, Any]) -> None:
    """schedules.md, the table: an epoch schedule's "state: a plain value (`None`, `PlateauState`), in
    every checkpoint's JSON"; concepts/loop-state.md: "`checkpoint_state` receives the state *and*
    the schedule state of the next epoch, so a resumed run asks the schedule exactly what the
    uninterrupted run asked".

    Every checkpoint (epoch ends and step boundaries) holds the PlateauState as a plain JSON object;
    each epoch-end checkpoint's is what asking the schedule by hand, epoch after epoch with the
    curve's smoothed losses, gives before the epoch it resumes at."""
    directory: Path = plateau_run["directory"]
    state: lamploop.LoopState = plateau_run["state"]
    schedule = plateau_run["schedule"]
    names = sorted(p.name for p in directory.iterdir() if p.is_dir())
    assert [n for n in names if "step" not in n] == [f"epoch-{e:06d}" for e in range(1, 5)]
    assert any("step" in n for n in names)
    # by hand: the state before asking epoch e, for e = 1..4
    by_hand: dict[int, Any] = {}
    schedule_state = schedule.init()
    last = None
    for entry in state.learning_curve:
        schedule_state, _ = schedule.learning_rate_factor(schedule_state, entry.epoch, last)
        last = entry.validation_loss[0]
        by_hand[entry.epoch + 1] = schedule_state
    for name in names:
        saved = json.loads((directory / name / "checkpoint.json").read_text())["schedule_state"]
        assert isinstance(saved, dict), name
        assert set(saved) == {"factor", "best", "bad_validations"}, name
        json.dumps(saved, allow_nan=False)
        if "step" not in name:
            epoch = int(name.split("-")[1])
            assert converter.structure(saved, type(schedule.init())) == by_hand[epoch], name


def test_checkpoint_data_holds_the_weight_average_with_averaging(plateau_run: dict[str, Any]) -> None:
    """concepts/loop-state.md: "`LoopStateWithModelAndOptimizerData` adds what a resume needs beside
    it: the model's `state_dict`, the optimizer's, the best model's (and a weight average's, with
    `averaging=`)"; api/state.md: "averaged_count: how many updates the average has had";
    "best_model: the state_dict() at the minimum smoothed validation loss".

    With an EMA and 4 optimizer steps an epoch, the checkpoint at the start of epoch e holds an
    average of the model's tensors updated 4 * e times, and the best model is the best epoch's."""
    directory: Path = plateau_run["directory"]
    module: torch.nn.Module = plateau_run["module"]
    for epoch in range(1, 5):
        checkpoint = lamploop.load_checkpoint(directory / f"epoch-{epoch:06d}")
        data = checkpoint.state
        assert data.loop_state.epoch == epoch
        assert set(data.averaged_model) == set(module.state_dict()), epoch
        assert data.averaged_count == 4 * epoch, epoch
        assert set(data.best_model) == set(module.state_dict())
        assert not all(torch.equal(data.averaged_model[k], data.model[k]) for k in data.model)


# ----------------------------------------------------------------------------------------------
# settings


class _OwnSteps:
    """A step schedule of one's own, not an attrs value."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def factor(self, epoch: int, step: int) -> float:
        return self.scale


class _OtherSteps(_OwnSteps):
    pass


def test_every_rank_fingerprint_numbers_alike_and_own_objects_by_type() -> None:
    """api/settings.md, every_rank_fingerprint: "Numbers (``25`` and ``25.0`` alike), strings and
    frozen attrs values (schedules) by value; anything else (an ``lr_scheduler`` factory, a step
    schedule of your own) by whether it is set and its type's name"; multi-node.md: "the same
    per-rank settings (`lamploop.TrainingSettings.EVERY_RANK`: accumulation, strategy, precision,
    clipping, step schedule, torch scheduler...)"."""
    every = set(TrainingSettings.EVERY_RANK)
    assert {
        "accumulate_gradient_over_n_batches",
        "strategy",
        "precision",
        "max_gradient_norm",
        "step_schedule",
        "lr_scheduler",
    } <= every
    assert not {"max_epochs", "validation_frequency", "learning_rate_schedule"} & every

    def fingerprint(**keywords: Any) -> str:
        return TrainingSettings(**keywords).every_rank_fingerprint()

    assert fingerprint(bucket_cap_mb=25) == fingerprint(bucket_cap_mb=25.0)
    assert fingerprint(max_gradient_norm=1) == fingerprint(max_gradient_norm=1.0)
    assert fingerprint(collective_timeout=60) == fingerprint(collective_timeout=60.0)
    assert fingerprint(max_gradient_norm=1.0) != fingerprint(max_gradient_norm=2.0)
    assert fingerprint(accumulate_gradient_over_n_batches=2) != fingerprint()
    assert fingerprint(step_schedule=_OwnSteps(0.5)) == fingerprint(step_schedule=_OwnSteps(0.25))
    assert fingerprint(step_schedule=_OwnSteps(0.5)) != fingerprint(step_schedule=_OtherSteps(0.5))
    assert fingerprint(step_schedule=_OwnSteps(0.5)) != fingerprint()


# ----------------------------------------------------------------------------------------------
# batch errors on one rank


@pytest.mark.parametrize(
    "kind", ["sizes_differ", "not_a_pair", "empty", "nested_sizes_differ"], ids=lambda kind: kind
)
def test_one_rank_batch_error_names_epoch_and_batch_and_leaves_the_rank_out(kind: str) -> None:
    """how-to/custom-batch-streams.md: "A batch whose features and target disagree in size, an item
    that is not a pair, or an empty batch raises `lamploop.errors.BatchError` naming the epoch, the
    batch and the rank (on rank 0, the only rank of a one-process run, the rank is left out: "epoch
    0, batch 3: ...")"; "lamploop checks that every tensor in it has the target's batch size".

    The bad item is batch 3 of epoch 1 (epoch 0 is fine)."""
    x, y = torch.randn(4, 2), torch.randint(0, 2, (4,))
    bad: Any = {
        "sizes_differ": (x[:3], y),
        "not_a_pair": (x, y, y),
        "empty": (x[:0], y[:0]),
        "nested_sizes_differ": ({"a": x, "b": (x[:2],)}, y),
    }[kind]

    class Both(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def forward(self, features: Any) -> torch.Tensor:
            if isinstance(features, dict):
                return self.layer(features["a"]) + self.layer(features["b"][0]).sum() * 0
            return self.layer(features)

    async def stream(context: BatchContext) -> AsyncIterator[Any]:
        for index in range(5):
            if context.epoch == 1 and index == 3:
                yield bad
            elif kind == "nested_sizes_differ":
                yield {"a": x, "b": (x,)}, y
            else:
                yield x, y

    with pytest.raises(BatchError) as caught:
        lamploop.fit(
            model=lamploop.SupervisedModel(Both()),
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
            train_batches=stream,
            max_epochs=2,
            reporters=[],
        )
    message = str(caught.value)
    assert message.startswith("epoch 1, batch 3: "), message
    assert "rank" not in message, message


# ----------------------------------------------------------------------------------------------
# the control channel over TCP


@pytest.mark.timeout(60)
def test_tcp_peers_are_sorted_whatever_order_the_followers_join_in() -> None:
    """concepts/control-channels.md: "`peers() -> tuple[int, ...]`  # the followers that joined,
    sorted"; "`await broadcast(command)`  # to every follower, in call order"; "`Stop(reason)`:
    training is over; the followers' command iterators end after it"; "`TcpControlRoot` /
    `TcpControlFollower`: one process per rank, over TCP".

    Three ranks over real sockets on 127.0.0.1; rank 2 joins first, rank 1 a moment later."""
    port, token = free_port(), secrets.token_hex(16)
    spec = lamploop.model_spec(torch.nn.Linear(2, 2))
    seen: dict[int, list[Any]] = {1: [], 2: []}
    result: dict[str, Any] = {}

    async def follow(rank: int, delay: float) -> None:
        await anyio.sleep(delay)
        async with lamploop.TcpControlFollower(
            host="127.0.0.1", port=port, rank=rank, nranks=3, token=token, model_spec=spec, connect_timeout=20
        ) as follower:
            rendezvous, commands = await follower.join()
            seen[rank].append(rendezvous)
            async for command in commands:
                seen[rank].append(command)

    async def main() -> None:
        root = lamploop.TcpControlRoot(
            host="127.0.0.1", port=port, nranks=3, token=token, model_spec=spec, join_timeout=20
        )
        with anyio.fail_after(40):
            async with anyio.create_task_group() as tasks, root:
                tasks.start_soon(follow, 2, 0.0)
                tasks.start_soon(follow, 1, 0.6)
                await root.on_rendezvous_ready(Rendezvous(host="127.0.0.1", port=29500))
                result["peers"] = root.peers()
                await root.broadcast(Train(epoch=0, lr_factor=0.5))
                await root.broadcast(Stop(reason="done"))

    anyio.run(main)
    assert result["peers"] == (1, 2)
    for rank in (1, 2):
        assert seen[rank][1:] == [Train(epoch=0, lr_factor=0.5), Stop(reason="done")], rank


# ----------------------------------------------------------------------------------------------
# multi-node, by hand (several processes)


def _start_follower(tmp_path: Path, port: int, token: str, rank: int, nranks: int, accumulate: int) -> Any:
    config = {
        "port": port,
        "rank": rank,
        "nranks": nranks,
        "accumulate": accumulate,
        "record": str(tmp_path / f"rank{rank}.record"),
    }
    path = tmp_path / f"rank{rank}.json"
    path.write_text(json.dumps(config))
    env = {**os.environ, "LAMPLOOP_TOKEN": token, "OMP_NUM_THREADS": "1"}
    with (tmp_path / f"rank{rank}.err").open("w") as err:
        return subprocess.Popen(
            [sys.executable, str(WORKERS / "acceptance_r5_worker.py"), str(path)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )


def _end(proc: Any) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


async def _root(port: int, token: str, nranks: int, model: lamploop.SupervisedModel, accumulate: int) -> Any:
    async with lamploop.TcpControlRoot(
        host="127.0.0.1",
        port=port,
        nranks=nranks,
        token=token,
        model_spec=lamploop.model_spec(model.module),
        join_timeout=40,
    ) as control:
        return await lamploop.drive_distributed_training(
            nranks=nranks,
            device="cpu",
            control=control,
            host="127.0.0.1",
            model=model,
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=worker.LEARNING_RATE),
            train_batches=worker.train_batches(),
            validation_batches=None,
            max_epochs=2,
            accumulate_gradient_over_n_batches=accumulate,
        )


@pytest.mark.soak
@pytest.mark.timeout(120)
def test_by_hand_three_ranks_train_as_one_rank_and_followers_return_none(tmp_path: Path) -> None:
    """multi-node.md, "By hand": the page's three ranks (`NRANKS = 3`), a root over `TcpControlRoot`
    with `drive_distributed_training`, followers over `TcpControlFollower` with
    `follow_distributed_training` (token through the environment); "Only rank 0 checkpoints, reports
    and gets the state back; the others return `None`"; "the root's weights are then broadcast, so
    the initial weights may differ"; concepts/sync-strategies.md: "R ranks with batches of b train
    like one rank with batches of R * b".  float64: every rank ends as SGD over batches of 12."""
    port, token = free_port(), secrets.token_hex(16)
    procs = [_start_follower(tmp_path, port, token, rank, 3, 1) for rank in (1, 2)]
    try:
        model = worker.make_model(seed=100)
        initial = _state(model.module)
        state = anyio.run(lambda: _root(port, token, 3, model, 1))
        for proc in procs:
            assert proc.wait(timeout=60) == 0, (tmp_path / "rank1.err").read_text()[-3000:]
    finally:
        for proc in procs:
            _end(proc)
    assert state.epoch == 2
    x, y = worker.data()
    steps = [(x[s : s + 12], y[s : s + 12]) for s in (0, 12)] * 2
    reference = _reference_sgd(initial, steps, [worker.LEARNING_RATE] * 4)
    _assert_close(_state(model.module), reference)
    for rank in (1, 2):
        record = load_record(tmp_path / f"rank{rank}.record")
        assert record["outcome"] == "done", record
        assert record["returned_none"] is True
        _assert_close(record["params"], reference)


@pytest.mark.soak
@pytest.mark.timeout(120)
def test_by_hand_a_rank_with_another_accumulation_fails_the_run_at_start(tmp_path: Path) -> None:
    """multi-node.md: "What must hold on every rank: ... the same per-rank settings
    (`lamploop.TrainingSettings.EVERY_RANK`: accumulation, strategy, ...): the same script gives them,
    and a rank that asks for another strategy fails the run at start"; api/settings.md,
    every_rank_fingerprint: "The EVERY_RANK settings as one string that the ranks compare when they
    meet".  The follower accumulates 2 batches, the root 1: both fail before training, naming the
    setting, rather than train apart or hang."""
    port, token = free_port(), secrets.token_hex(16)
    proc = _start_follower(tmp_path, port, token, 1, 2, 2)
    try:
        model = worker.make_model(seed=100)
        with pytest.raises(LamploopError) as caught:
            anyio.run(lambda: _root(port, token, 2, model, 1))
        status = proc.wait(timeout=60)
    finally:
        _end(proc)
    assert "accumulate_gradient_over_n_batches" in str(caught.value), str(caught.value)
    assert status != 0
    record = load_record(tmp_path / "rank1.record")
    assert record["outcome"] == "error", record
    assert "accumulate_gradient_over_n_batches" in record["message"], record


# ----------------------------------------------------------------------------------------------
# events with accumulation and step checkpoints; the by-hand channel's waits


class _Recorder:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def report(self, event: Any) -> None:
        self.events.append(event)


def test_epoch_started_expects_the_previous_epochs_optimizer_steps(tmp_path: Path) -> None:
    """how-to/custom-reporters.md, the table: `EpochStarted`: "`expected_steps` (the previous epoch's
    step count, or `None`)"; `EpochFinished`: "`steps`, `examples`"; `CheckpointWritten`: "`epoch`,
    `steps_done` (0: the start of `epoch`), `path`"; the order: "CheckpointWritten inside the epoch,
    when a step-boundary checkpoint is written ... EpochFinished, CheckpointWritten the end-of-epoch
    checkpoint".  9 batches, 2 accumulated a step: 5 optimizer steps an epoch (the last one of a
    single batch); a step checkpoint every 2 steps."""
    from lamploop.reporting.events import CheckpointWritten, EpochFinished, EpochStarted

    x, y = _classification(36)
    recorder = _Recorder()
    torch.manual_seed(0)
    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(5, 3)),
        optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
        train_batches=lamploop.tensor_batches(x, y, batch_size=4),
        max_epochs=2,
        accumulate_gradient_over_n_batches=2,
        checkpoint_dir=tmp_path,
        checkpoint_every_n_steps=2,
        keep_last=None,
        reporters=[recorder],
    )
    shown = [
        (type(e).__name__, e.epoch, e.steps_done, e.expected_steps)
        if isinstance(e, EpochStarted)
        else (type(e).__name__, e.epoch, e.steps_done, Path(e.path).name)
        if isinstance(e, CheckpointWritten)
        else (type(e).__name__, e.steps, e.examples)
        for e in recorder.events
        if isinstance(e, EpochStarted | CheckpointWritten | EpochFinished)
    ]
    assert shown == [
        ("EpochStarted", 0, 0, None),
        ("CheckpointWritten", 0, 2, "epoch-000000-step-000002"),
        ("CheckpointWritten", 0, 4, "epoch-000000-step-000004"),
        ("EpochFinished", 5, 36),
        ("CheckpointWritten", 1, 0, "epoch-000001"),
        ("EpochStarted", 1, 0, 5),
        ("CheckpointWritten", 1, 2, "epoch-000001-step-000002"),
        ("CheckpointWritten", 1, 4, "epoch-000001-step-000004"),
        ("EpochFinished", 5, 36),
        ("CheckpointWritten", 2, 0, "epoch-000002"),
    ]


def test_by_hand_channel_waits_sixty_seconds_by_default() -> None:
    """multi-node.md: "Followers may start first: they retry connecting for `connect_timeout` (60 s).
    The root waits `join_timeout` (60 s) for all of them"; "the heartbeat timeout (4 s by default,
    `heartbeat_timeout=`)"."""
    import inspect

    follower = inspect.signature(lamploop.TcpControlFollower).parameters
    root = inspect.signature(lamploop.TcpControlRoot).parameters
    assert follower["connect_timeout"].default == 60
    assert root["join_timeout"].default == 60
    assert follower["heartbeat_timeout"].default == root["heartbeat_timeout"].default == 4


_DEFAULT_REPORTER_SCRIPT = """
import torch, lamploop
torch.manual_seed(0)
x, y = torch.randn(32, 3), torch.randint(0, 2, (32,))
lamploop.fit(
    model=lamploop.SupervisedModel(torch.nn.Linear(3, 2)),
    optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
    train_batches=lamploop.tensor_batches(x, y, batch_size=8),
    max_epochs=2,
)
"""


@pytest.mark.timeout(90)
def test_the_default_reporter_on_a_terminal_draws_progress_bars() -> None:
    """how-to/custom-reporters.md: "`fit(reporters=[...])` replaces the default: live progress bars
    (a `ProgressReporter` on stderr) when stderr is a terminal and rich is installed, else one
    `LoggingReporter`".  (This test's first version, from the page's earlier text, found the page
    silent on the terminal case.)  A script that calls `fit` without `reporters=`, its stderr a
    real pseudo-terminal, rich installed (the test extra): the bars, drawn with escape codes."""
    import pty
    import select
    import time

    master, slave = pty.openpty()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "xterm"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _DEFAULT_REPORTER_SCRIPT],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    out = b""
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the terminal closed: the process ended
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(timeout=20) == 0, out[-2000:]
    finally:
        os.close(master)
        _end(proc)
    text = out.decode(errors="replace")
    assert "\x1b[" in text, text[-2000:]
    assert re.search(r"epochs .*2/2", text), text[-2000:]  # the bar of the run's epochs, filled
