"""Acceptance tests of docs/contract-changes.md: every documented change of DESIGN.md's contract.

Written from docs/contract-changes.md, DESIGN.md, docs/loop.md, docs/distributed.md,
docs/architecture.md and the public docstrings only, without reading the package's source.
For each change: the new behaviour is what the page says, and where the page says DESIGN's form
still works, it does with DESIGN's meaning. Expected numbers come from plain float64 PyTorch
loops written here (``torch.optim.SGD``, ``torch.nn.utils.clip_grad_norm_``, ``BatchNorm1d``),
never from lamploop alone. Everything runs in this process (ranks as in-process replicas over
Gloo, as ``local_data_parallel_training_loop`` and ``local_control`` make them).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import inspect
import json
import logging
import math
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch
import torch.nn.functional as F

import lamploop
import lamploop.errors
import lamploop.settings
import lamploop.sync
from lamploop.loop.boundary import EpochStart
from lamploop.state import converter

Batch = tuple[torch.Tensor, torch.Tensor]

_GENERATOR = torch.Generator().manual_seed(20260311)
X = torch.randn(32, 3, generator=_GENERATOR, dtype=torch.float64)
Y = torch.randn(32, 1, generator=_GENERATOR, dtype=torch.float64)
MSE_SUM = lamploop.summed(F.mse_loss)


def make_module() -> torch.nn.Linear:
    module = torch.nn.Linear(3, 1, dtype=torch.float64)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([[0.5, -0.25, 0.125]], dtype=torch.float64))
        module.bias.fill_(0.0625)
    return module


def sgd(lr: float, momentum: float = 0.0) -> Callable[[Any], torch.optim.Optimizer]:
    def factory(parameters: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(parameters, lr=lr, momentum=momentum)

    return factory


def snapshot(module: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    items = module.state_dict() if isinstance(module, torch.nn.Module) else module
    return {name: value.detach().clone() for name, value in items.items()}


def assert_same(actual: Any, expected: Any, *, exact: bool = False) -> None:
    actual, expected = snapshot(actual), snapshot(expected)
    assert actual.keys() == expected.keys()
    for name in expected:
        if exact:
            assert torch.equal(actual[name], expected[name]), name
        else:
            torch.testing.assert_close(actual[name], expected[name], rtol=1e-12, atol=1e-12, msg=name)


def reference_training(
    steps: Sequence[Sequence[Batch]],
    n_epochs: int,
    lr: float,
    *,
    momentum: float = 0.0,
    clip: float | None = None,
    module: torch.nn.Module | None = None,
) -> tuple[torch.nn.Module, list[float]]:
    """Plain torch SGD on the gradient of (step's loss sum) / (step's examples); epoch means."""
    module = make_module() if module is None else module
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
    means = []
    for _ in range(n_epochs):
        total, count = 0.0, 0
        for batches in steps:
            optimizer.zero_grad()
            loss_sum = sum(F.mse_loss(module(x), y, reduction="sum") for x, y in batches)
            examples = sum(len(y) for _, y in batches)
            (loss_sum / examples).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            optimizer.step()
            total += float(loss_sum.detach())
            count += examples
        means.append(total / count)
    return module, means


def per_rank_factory(per_rank: Sequence[Sequence[slice]]) -> Any:
    def make(context: lamploop.BatchContext) -> list[Batch]:
        return [(X[s], Y[s]) for s in per_rank[context.rank]]

    return lamploop.iterable_batches(make)


def steps_of(per_rank: Sequence[Sequence[slice]]) -> list[list[Batch]]:
    n = max(len(slices) for slices in per_rank)
    return [[(X[s], Y[s]) for slices in per_rank for s in slices[i : i + 1]] for i in range(n)]


async def async_batches(batches: Sequence[Batch]):
    for batch in batches:
        yield batch


async def drive_alone(**keywords: Any) -> lamploop.LoopState:
    keywords.setdefault("validation_batches", None)
    keywords.setdefault("optimizer_factory", sgd(0.1))
    with anyio.fail_after(30):
        return await lamploop.drive_distributed_training(nranks=1, device="cpu", control=None, **keywords)


# ---------------------------------------------------------------------------------------------
# "One settings object (0.3)": settings=, the old keywords, one merge with two refusals.
# ---------------------------------------------------------------------------------------------

ONE_RANK_SLICES = [[slice(0, 4), slice(4, 8), slice(8, 12)]]


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_old_setting_keyword_and_settings_object_train_alike_and_match_torch_clipping() -> None:
    """ "The settings keywords the drivers took before are still accepted, one keyword each";
    "The drivers take everything beyond lamp as `settings=`"; 0.3: `max_gradient_norm` clips
    each step's summed gradient to a global L2 norm (checked against clip_grad_norm_)."""
    by_keyword, by_settings = make_module(), make_module()
    await drive_alone(
        model=lamploop.SupervisedModel(by_keyword, MSE_SUM),
        train_batches=per_rank_factory(ONE_RANK_SLICES),
        max_epochs=2,
        max_gradient_norm=0.05,
    )
    await drive_alone(
        model=lamploop.SupervisedModel(by_settings, MSE_SUM),
        train_batches=per_rank_factory(ONE_RANK_SLICES),
        max_epochs=2,
        settings=lamploop.TrainingSettings(max_gradient_norm=0.05),
    )
    reference, _ = reference_training(steps_of(ONE_RANK_SLICES), 2, 0.1, clip=0.05)
    unclipped, _ = reference_training(steps_of(ONE_RANK_SLICES), 2, 0.1)
    assert not torch.allclose(reference.weight, unclipped.weight)  # the clip matters here
    assert_same(by_keyword, reference)
    assert_same(by_settings, by_keyword, exact=True)


@pytest.mark.anyio
async def test_setting_given_both_as_keyword_and_in_settings_is_refused() -> None:
    """ "A setting given both as a keyword and in `settings=` ... [is] a `ConfigurationError`
    naming the function and the keyword"."""
    with (
        anyio.fail_after(30),
        pytest.raises(lamploop.errors.ConfigurationError) as caught,
    ):
        await drive_alone(
            model=lamploop.SupervisedModel(make_module(), MSE_SUM),
            train_batches=per_rank_factory(ONE_RANK_SLICES),
            max_epochs=1,
            settings=lamploop.TrainingSettings(strategy="all_reduce"),
            strategy="all_reduce",
        )
    assert "drive_distributed_training" in str(caught.value)
    assert "strategy" in str(caught.value)


@pytest.mark.parametrize("function", ["drive", "follow", "local"])
@pytest.mark.anyio
async def test_unknown_keyword_is_a_configuration_error_naming_function_and_keyword(function: str) -> None:
    """ "a keyword the function does not take, are a `ConfigurationError` naming the function and
    the keyword (an unknown keyword was Python's `TypeError`)"."""
    model = lamploop.SupervisedModel(make_module(), MSE_SUM)
    train = per_rank_factory(ONE_RANK_SLICES)

    async def call() -> None:
        if function == "drive":
            await drive_alone(model=model, train_batches=train, max_epochs=1, no_such_setting=3)
        elif function == "follow":
            root, (follower,) = lamploop.local_control(2)
            async with root, follower:
                await lamploop.follow_distributed_training(
                    rank=1,
                    nranks=2,
                    device="cpu",
                    control=follower,
                    model=model,
                    train_batches=train,
                    validation_batches=None,
                    no_such_setting=3,
                )
        else:
            await lamploop.local_data_parallel_training_loop(
                [(model, train, None)], sgd(0.1), 1, no_such_setting=3
            )

    name = {
        "drive": "drive_distributed_training",
        "follow": "follow_distributed_training",
        "local": "local_data_parallel_training_loop",
    }[function]
    with anyio.fail_after(30), pytest.raises(lamploop.errors.ConfigurationError) as caught:
        await call()
    assert name in str(caught.value)
    assert "no_such_setting" in str(caught.value)


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_lamp_keyword_at_default_takes_settings_value_and_a_different_one_is_refused() -> None:
    """ "A lamp keyword left at its default takes the settings' value; one given and different
    from a value set in `settings=` is refused.\""""
    valid = per_rank_factory([[slice(20, 24)]])
    final = await drive_alone(
        model=lamploop.SupervisedModel(make_module(), MSE_SUM),
        train_batches=per_rank_factory([[slice(0, 4)]]),
        validation_batches=valid,
        max_epochs=3,
        settings=lamploop.TrainingSettings(validation_frequency=2),
    )
    assert [entry.validation_loss is not None for entry in final.learning_curve] == [True, False, True]
    with pytest.raises(lamploop.errors.ConfigurationError, match="validation_frequency"):
        await drive_alone(
            model=lamploop.SupervisedModel(make_module(), MSE_SUM),
            train_batches=per_rank_factory([[slice(0, 4)]]),
            validation_batches=valid,
            max_epochs=3,
            validation_frequency=3,
            settings=lamploop.TrainingSettings(validation_frequency=2),
        )


def test_settings_keyword_typeddicts_are_the_documented_sets() -> None:
    """ "they are declared once, as the TypedDicts `RankSettingKeywords` (followers),
    `LocalSettingKeywords` and `SettingKeywords`"; "`follow_distributed_training` reads only
    the settings every rank holds (`TrainingSettings.EVERY_RANK`)"; the drivers accept
    `strategy=, bucket_cap_mb=, collective_timeout=` and the 0.3 training keywords."""
    settings = lamploop.settings
    rank = set(settings.RankSettingKeywords.__optional_keys__)
    local = set(settings.LocalSettingKeywords.__optional_keys__)
    root = set(settings.SettingKeywords.__optional_keys__)
    every_rank_0_3 = {
        "strategy",
        "bucket_cap_mb",
        "collective_timeout",
        "on_non_finite_loss",
        "max_gradient_norm",
        "precision",
        "step_schedule",
        "lr_scheduler",
        "lr_scheduler_interval",
    }
    assert every_rank_0_3 <= rank
    assert rank <= set(lamploop.TrainingSettings.EVERY_RANK)
    root_only = {"model_selection_metric", "model_selection_mode", "early_stopping_patience", "averaging"}
    assert rank | root_only <= local
    assert local | {"checkpoint_every_n_steps", "checkpoint_every_seconds"} <= root
    fields = {field.name for field in attrs.fields(lamploop.TrainingSettings)}
    assert root <= fields


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_local_data_parallel_accepts_host_like_the_driver() -> None:
    """ "`drive_distributed_training(..., strategy=, host=, bucket_cap_mb=, collective_timeout=)`,
    and the same keyword-only options on `local_data_parallel_training_loop`"."""
    models = [lamploop.SupervisedModel(make_module(), MSE_SUM) for _ in range(2)]
    slices = [[slice(0, 4)], [slice(4, 8)]]
    with anyio.fail_after(40):
        await lamploop.local_data_parallel_training_loop(
            [(model, per_rank_factory(slices), None) for model in models],
            sgd(0.1),
            1,
            strategy="all_reduce",
            bucket_cap_mb=1.0,
            collective_timeout=60.0,
            host="127.0.0.1",
        )
    reference, _ = reference_training(steps_of(slices), 1, 0.1)
    assert_same(models[0].module, reference)


# ---------------------------------------------------------------------------------------------
# "Drivers": strategy="auto", agreement, registered strategies, one thread per rank.
# ---------------------------------------------------------------------------------------------


async def drive_and_follow(
    per_rank: Sequence[Sequence[slice]],
    *,
    root_keywords: Mapping[str, Any] = {},
    follower_keywords: Mapping[str, Any] = {},
    max_epochs: int = 1,
    lr: float = 0.1,
) -> tuple[list[Any], list[torch.nn.Module]]:
    """Rank 0 drives, ranks 1.. follow over the in-process control channel; each rank's outcome
    (its return value or the exception it raised) and each rank's module."""
    nranks = len(per_rank)
    root, followers = lamploop.local_control(nranks)
    modules = [make_module() for _ in range(nranks)]
    train = per_rank_factory(per_rank)
    outcomes: list[Any] = [None] * nranks

    async def run(rank: int, call: Callable[[], Any]) -> None:
        try:
            outcomes[rank] = await call()
        except Exception as error:
            outcomes[rank] = error

    with anyio.fail_after(45):
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(root)
            for follower in followers:
                await stack.enter_async_context(follower)
            async with anyio.create_task_group() as group:
                for rank, follower in enumerate(followers, start=1):
                    group.start_soon(
                        run,
                        rank,
                        partial(
                            lamploop.follow_distributed_training,
                            rank=rank,
                            nranks=nranks,
                            device="cpu",
                            control=follower,
                            model=lamploop.SupervisedModel(modules[rank], MSE_SUM),
                            train_batches=train,
                            validation_batches=None,
                            **follower_keywords,
                        ),
                    )
                await run(
                    0,
                    partial(
                        lamploop.drive_distributed_training,
                        nranks=nranks,
                        device="cpu",
                        control=root,
                        model=lamploop.SupervisedModel(modules[0], MSE_SUM),
                        optimizer_factory=sgd(lr),
                        train_batches=train,
                        validation_batches=None,
                        max_epochs=max_epochs,
                        **root_keywords,
                    ),
                )
    return outcomes, modules


TWO_RANKS = [[slice(0, 2), slice(2, 5)], [slice(5, 6), slice(6, 8)]]


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_auto_strategy_with_optimizer_on_every_rank_steps_every_rank() -> None:
    """ "every entry point defaults to `strategy="auto"`: `all_reduce` when every rank passed an
    optimizer factory" (all_reduce: "replicated: every rank steps" its own optimizer). A
    follower given lr 0 therefore keeps the parameters it started with, the root trains."""
    outcomes, modules = await drive_and_follow(TWO_RANKS, follower_keywords={"optimizer_factory": sgd(0.0)})
    assert isinstance(outcomes[0], lamploop.LoopState), outcomes
    assert outcomes[1] is None, outcomes
    assert_same(modules[1], make_module())  # stepped by its own optimizer (lr 0), not broadcast
    assert not torch.equal(modules[0].weight, make_module().weight)  # the root stepped with lr 0.1


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_auto_strategy_without_follower_optimizer_is_lamps_reduce_to_root() -> None:
    """ "Code written against the contract (followers without an optimizer) therefore still gets
    lamp's strategy" (reduce_to_root: "only rank 0 steps", parameters "broadcast from rank 0")."""
    outcomes, modules = await drive_and_follow(TWO_RANKS, max_epochs=2)
    assert isinstance(outcomes[0], lamploop.LoopState), outcomes
    assert outcomes[1] is None, outcomes
    reference, losses = reference_training(steps_of(TWO_RANKS), 2, 0.1)
    assert_same(modules[0], reference)
    assert_same(modules[1], reference)
    assert [e.training_loss for e in outcomes[0].learning_curve] == pytest.approx(losses, rel=1e-12)


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_ranks_that_disagree_on_the_strategy_fail_on_every_rank_at_start() -> None:
    """ "The ranks check at start that they agree" (docs/distributed.md: "a mismatch fails on
    every rank with `DistributedError` at start")."""
    outcomes, modules = await drive_and_follow(
        TWO_RANKS,
        root_keywords={"strategy": "reduce_to_root"},
        follower_keywords={"strategy": "all_reduce", "optimizer_factory": sgd(0.1)},
    )
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, lamploop.errors.DistributedError), (rank, outcome)
    assert_same(modules[0], make_module())  # "at start": no step was taken


class RecordingSync:
    """A float64 sum of gradients (architecture.md's plug-in) that records what it is handed."""

    def __init__(self, collectives: Any, parameters: Sequence[torch.nn.Parameter], log: list) -> None:
        self.collectives = collectives
        self.parameters = [p for p in parameters if p.requires_grad]
        self.log = log

    def begin_pass(self) -> None:
        for p in self.parameters:
            p.grad = None

    def last_backward(self) -> None:
        pass

    def reduce(self, scale: float) -> None:
        handed = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone() for p in self.parameters
        ]
        self.log.append((scale, handed))
        for p, local in zip(self.parameters, handed, strict=True):
            wide = local.double().clone()  # the logged copy stays what was handed
            self.collectives.wait(self.collectives.all_reduce([wide]), "recording gradient sum")
            p.grad = (wide * scale).to(p.dtype)

    def after_step(self) -> None:
        self.begin_pass()

    def end_pass(self) -> None:
        pass

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        pass

    def close(self, *, abandon: bool) -> None:
        pass


class LinearRecordingSync(RecordingSync):
    reduces_linearly = True


class RecordingStrategy:
    def __init__(self, name: str, sync_type: type) -> None:
        self.name = name
        self.steps_on_every_rank = True
        self.sync_type = sync_type
        self.logs: list[list] = []

    def gradient_sync(self, collectives: Any, parameters: Any, modules: Any, *, bucket_cap_mb: float) -> Any:
        log: list = []
        self.logs.append(log)
        return self.sync_type(collectives, parameters, log)


# step sizes 3, 5, 2: the loop's guess of a step's count (the previous one, 1 at the first) misses
UNEVEN_TWO_RANKS = [[slice(0, 2), slice(2, 5), slice(5, 6)], [slice(6, 7), slice(7, 9), slice(9, 10)]]


def reference_step_gradients(
    steps: Sequence[Sequence[Batch]], n_epochs: int, lr: float
) -> list[list[torch.Tensor]]:
    """The gradient of each step's mean loss, in a plain SGD run."""
    module = make_module()
    gradients = []
    for _ in range(n_epochs):
        for batches in steps:
            module.zero_grad()
            loss_sum = sum(F.mse_loss(module(x), y, reduction="sum") for x, y in batches)
            (loss_sum / sum(len(y) for _, y in batches)).backward()
            gradients.append([p.grad.detach().clone() for p in module.parameters()])
            with torch.no_grad():
                for p in module.parameters():
                    p -= lr * p.grad
    return gradients


@pytest.mark.parametrize("linear", [False, True], ids=["default-exact-units", "reduces_linearly"])
@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_registered_strategy_by_name_gets_exact_units_unless_linear(linear: bool) -> None:
    """ "Strategies are registered by name (`lamploop.register_strategy`,
    `lamploop.strategy_names()`), so `strategy` takes any registered name"; "`GradientSync.reduce
    (scale)` gets `scale == 1.0` unless the sync says `reduces_linearly = True`": "a sync is handed
    the gradient of the step's mean loss"; a linear sync that multiplies by `scale` trains alike."""
    name = f"acceptance_recording_{'linear' if linear else 'exact'}"
    strategy = RecordingStrategy(name, LinearRecordingSync if linear else RecordingSync)
    lamploop.register_strategy(strategy, replace=True)
    assert name in lamploop.strategy_names()
    models = [lamploop.SupervisedModel(make_module(), MSE_SUM) for _ in range(2)]
    with anyio.fail_after(45):
        final = await lamploop.local_data_parallel_training_loop(
            [(model, per_rank_factory(UNEVEN_TWO_RANKS), None) for model in models],
            sgd(0.1),
            2,
            strategy=name,
        )
    steps = steps_of(UNEVEN_TWO_RANKS)
    reference, losses = reference_training(steps, 2, 0.1)
    assert_same(models[0].module, reference)
    assert [e.training_loss for e in final.learning_curve] == pytest.approx(losses, rel=1e-12)
    assert len(strategy.logs) == 2
    assert all(len(log) == 6 for log in strategy.logs)
    if not linear:
        expected = reference_step_gradients(steps, 2, 0.1)
        for step in range(6):
            assert [log[step][0] for log in strategy.logs] == [1.0, 1.0], step
            summed = [
                a + b for a, b in zip(strategy.logs[0][step][1], strategy.logs[1][step][1], strict=True)
            ]
            for got, want in zip(summed, expected[step], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_every_rank_runs_its_epochs_on_one_worker_thread_of_its_own() -> None:
    """ "Every rank's epochs run on a worker thread in runs of several ranks ... A batch stream is
    iterated in that thread's own event loop. It is one thread per rank for the whole run"."""
    main_thread = threading.get_ident()
    seen: dict[int, set[int]] = {0: set(), 1: set()}
    loops: dict[int, set[int]] = {0: set(), 1: set()}
    main_loop = id(asyncio.get_running_loop())

    def factory(context: lamploop.BatchContext) -> Any:
        async def stream():
            for s in TWO_RANKS[context.rank]:
                seen[context.rank].add(threading.get_ident())
                loops[context.rank].add(id(asyncio.get_running_loop()))
                yield X[s], Y[s]

        return stream()

    models = [lamploop.SupervisedModel(make_module(), MSE_SUM) for _ in range(2)]
    with anyio.fail_after(45):
        await lamploop.local_data_parallel_training_loop(
            [(model, factory, None) for model in models], sgd(0.1), 3
        )
    assert [len(seen[r]) for r in (0, 1)] == [1, 1], seen
    assert seen[0].isdisjoint(seen[1])
    assert main_thread not in seen[0] | seen[1]
    assert main_loop not in loops[0] | loops[1]
    reference, _ = reference_training(steps_of(TWO_RANKS), 3, 0.1)
    assert_same(models[0].module, reference)


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_buffers_are_averaged_over_ranks_at_the_end_of_a_training_pass() -> None:
    """ "Buffers (e.g. BatchNorm running statistics) are averaged over the ranks at the end of each
    training pass ... (integer buffers take the root's)"."""

    def make_bn() -> torch.nn.Module:
        torch.manual_seed(3)
        return torch.nn.Sequential(
            torch.nn.BatchNorm1d(3, dtype=torch.float64), torch.nn.Linear(3, 1, dtype=torch.float64)
        )

    per_rank = [[slice(0, 4), slice(4, 8)], [slice(8, 14)]]
    models = [lamploop.SupervisedModel(make_bn(), MSE_SUM) for _ in range(2)]
    with anyio.fail_after(45):
        await lamploop.local_data_parallel_training_loop(
            [(model, per_rank_factory(per_rank), None) for model in models], sgd(0.0), 1
        )
    # BatchNorm comes first, so its statistics depend on the inputs only: each rank's own
    running = []
    for slices in per_rank:
        bn = make_bn()[0].train()
        with torch.no_grad():
            for s in slices:
                bn(X[s])
        running.append(bn)
    got = models[0].module[0]
    torch.testing.assert_close(got.running_mean, (running[0].running_mean + running[1].running_mean) / 2)
    torch.testing.assert_close(got.running_var, (running[0].running_var + running[1].running_var) / 2)
    assert int(got.num_batches_tracked) == int(running[0].num_batches_tracked) == 2


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_a_nan_every_rank_sees_is_raised_by_every_rank_not_a_peer_lost_error() -> None:
    """ "An error every rank detects itself wins over the abort it causes ... (a NaN loss ...) every
    rank raises that error, with its epoch, step and ranks, instead of the `PeerLostError`"."""
    x_bad = X.clone()
    x_bad[6, 0] = float("nan")  # rank 1's batch 1 (slice 6:8), step 1

    def factory(context: lamploop.BatchContext) -> list[Batch]:
        return [(x_bad[s], Y[s]) for s in TWO_RANKS_NAN[context.rank]]

    root, (follower,) = lamploop.local_control(2)
    outcomes: list[Any] = [None, None]

    async def run(rank: int, call: Callable[[], Any]) -> None:
        try:
            outcomes[rank] = await call()
        except Exception as error:
            outcomes[rank] = error

    train = lamploop.iterable_batches(factory)
    with anyio.fail_after(45):
        async with root, follower, anyio.create_task_group() as group:
            group.start_soon(
                run,
                1,
                partial(
                    lamploop.follow_distributed_training,
                    rank=1,
                    nranks=2,
                    device="cpu",
                    control=follower,
                    model=lamploop.SupervisedModel(make_module(), MSE_SUM),
                    train_batches=train,
                    validation_batches=None,
                ),
            )
            await run(
                0,
                partial(
                    lamploop.drive_distributed_training,
                    nranks=2,
                    device="cpu",
                    control=root,
                    model=lamploop.SupervisedModel(make_module(), MSE_SUM),
                    optimizer_factory=sgd(0.1),
                    train_batches=train,
                    validation_batches=None,
                    max_epochs=2,
                ),
            )
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, lamploop.errors.NonFiniteLossError), (rank, repr(outcome))
        assert not isinstance(outcome, lamploop.errors.PeerLostError)
        assert (outcome.epoch, outcome.step, tuple(outcome.ranks)) == (0, 1, (1,)), rank
    assert outcomes[1].batch == 1


TWO_RANKS_NAN = [[slice(0, 2), slice(2, 5), slice(10, 12)], [slice(5, 6), slice(6, 8), slice(12, 13)]]


# ---------------------------------------------------------------------------------------------
# "Step boundaries": checkpoint_position, checkpoint_every_n_steps, init_position, stop.
# ---------------------------------------------------------------------------------------------


def boundary_run_keywords(records: list, stop: Any = None, stop_at: tuple[int, int] | None = None) -> dict:
    order = torch.Generator()

    def factory(context: lamploop.BatchContext) -> Any:
        async def stream():
            order.manual_seed(100 + context.epoch)  # a pure function of (seed, epoch)
            permutation = torch.randperm(16, generator=order)
            for i in range(4):
                index = permutation[4 * i : 4 * i + 4]
                yield X[index], Y[index]
                if stop is not None and (context.epoch, i) == stop_at:
                    stop.request("acceptance test")

        return stream()

    async def checkpoint_position(state: Any, schedule_state: Any, position: Any, rank_rngs: Any) -> None:
        records.append((copy.deepcopy(state), schedule_state, position, rank_rngs))

    return {
        "train_batches": factory,
        "optimizer_factory": sgd(0.05, momentum=0.9),
        "checkpoint_position": checkpoint_position,
        "learning_rate_schedule": lamploop.decrement(1, 0.5),
    }


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_step_boundary_checkpoints_and_a_bitwise_resume_from_one() -> None:
    """ "`checkpoint_position(state, schedule_state, position, rank_rngs)` writes a checkpoint with
    the position in the epoch and every rank's RNG states ...; it is called after every epoch too
    (position: step 0 of the next epoch)"; DESIGN section 6: "resuming from it is bitwise equal to
    the uninterrupted run on CPU"."""
    records: list = []
    module = make_module()
    final = await drive_alone(
        model=lamploop.SupervisedModel(module, MSE_SUM),
        max_epochs=3,
        checkpoint_every_n_steps=2,
        **boundary_run_keywords(records),
    )
    positions = [(p.epoch, p.steps_done) for _, _, p, _ in records]
    for epoch in range(3):
        assert (epoch, 2) in positions, positions
        assert (epoch + 1, 0) in positions, positions
    assert all(len(rngs) >= 1 for *_, rngs in records)

    data, schedule_state, position, rank_rngs = records[positions.index((1, 2))]
    assert data.loop_state.epoch == 1
    resumed = make_module()
    again = await drive_alone(
        model=lamploop.SupervisedModel(resumed, MSE_SUM),
        max_epochs=3,
        init_state=data,
        learning_rate_schedule_init_state=schedule_state,
        init_position=position,
        init_rank_rngs=rank_rngs,
        **boundary_run_keywords([]),
    )
    assert_same(resumed, module, exact=True)
    assert again.learning_curve == final.learning_curve


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_stop_request_stops_after_a_step_raises_training_interrupted_and_resumes() -> None:
    """ "Setting `stop` (a `StopRequest` ...) stops every rank after the same step and raises
    `lamploop.errors.TrainingInterrupted` on the root" (the boundary's checkpoint is written)."""
    from lamploop.loop.stop_request import StopRequest

    uninterrupted = make_module()
    await drive_alone(
        model=lamploop.SupervisedModel(uninterrupted, MSE_SUM), max_epochs=2, **boundary_run_keywords([])
    )
    records: list = []
    stop = StopRequest()
    stopped = make_module()
    with pytest.raises(lamploop.errors.TrainingInterrupted):
        await drive_alone(
            model=lamploop.SupervisedModel(stopped, MSE_SUM),
            max_epochs=2,
            stop=stop,
            **boundary_run_keywords(records, stop=stop, stop_at=(1, 1)),
        )
    data, schedule_state, position, rank_rngs = records[-1]
    assert position.epoch == 1, position
    assert 1 <= position.steps_done < 4, position
    resumed = make_module()
    await drive_alone(
        model=lamploop.SupervisedModel(resumed, MSE_SUM),
        max_epochs=2,
        init_state=data,
        learning_rate_schedule_init_state=schedule_state,
        init_position=position,
        init_rank_rngs=rank_rngs,
        **boundary_run_keywords([]),
    )
    assert_same(resumed, uninterrupted, exact=True)


# ---------------------------------------------------------------------------------------------
# "`one_epoch`": start=, sequential float64 loss sum, NaN policy, cleared gradients, BatchError.
# ---------------------------------------------------------------------------------------------

FOUR_BATCHES = [(X[0:3], Y[0:3]), (X[3:5], Y[3:5]), (X[5:9], Y[5:9]), (X[9:10], Y[9:10])]


@pytest.mark.anyio
async def test_one_epoch_resumes_at_a_step_boundary_with_epoch_start() -> None:
    """ "`one_epoch(..., start=None, ...)`: resume a training pass at a step boundary
    (`lamploop.loop.boundary.EpochStart`)" (it skips the steps done and carries the sums on)."""
    reference, (mean,) = reference_training([[b] for b in FOUR_BATCHES], 1, 0.1)
    # the state after two steps, by plain torch
    halfway, _ = reference_training([[b] for b in FOUR_BATCHES[:2]], 1, 0.1)
    done_sum = 0.0
    probe = make_module()
    optimizer = torch.optim.SGD(probe.parameters(), lr=0.1)
    for x, y in FOUR_BATCHES[:2]:
        optimizer.zero_grad()
        loss = F.mse_loss(probe(x), y, reduction="sum")
        done_sum += float(loss.detach())
        (loss / len(y)).backward()
        optimizer.step()
    module = copy.deepcopy(halfway)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    result = await lamploop.one_epoch(
        model=lamploop.SupervisedModel(module, MSE_SUM),
        batches=async_batches(FOUR_BATCHES),
        step_optimizer=optimizer.step,
        start=EpochStart(steps_done=2, loss_sum=done_sum, example_count=5, last_step_examples=2),
    )
    assert_same(module, reference)
    assert result == pytest.approx(mean, rel=1e-12)


@pytest.mark.anyio
async def test_one_epoch_training_loss_is_a_sequential_float64_sum_of_batch_sums() -> None:
    """ "A pass's training-loss sum is a sequential float64 sum of the batches' loss sums"."""
    module = torch.nn.Linear(3, 1)  # float32: each batch's loss sum is a float32 number
    with torch.no_grad():
        module.weight.zero_()
        module.bias.zero_()
    targets = [1.0e4, 1.0, 1.0e-3, 3.0e3, 7.0e-1]
    batches = [(torch.zeros(1, 3), torch.tensor([[t]], dtype=torch.float32)) for t in targets]
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
    result = await lamploop.one_epoch(
        model=lamploop.SupervisedModel(module, lamploop.summed(F.mse_loss)),
        batches=async_batches(batches),
        step_optimizer=optimizer.step,
    )
    total = 0.0
    for t in targets:
        total += float(torch.tensor(t, dtype=torch.float32) ** 2)  # each batch's float32 loss sum
    assert result == total / len(targets)


@pytest.mark.anyio
async def test_gradients_left_before_a_pass_are_cleared() -> None:
    """ "Gradients left on the parameters before a training pass are cleared, as a loop that calls
    `zero_grad()` before each step would"."""
    module = make_module()
    for p in module.parameters():
        p.grad = torch.full_like(p, 1000.0)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    await lamploop.one_epoch(
        model=lamploop.SupervisedModel(module, MSE_SUM),
        batches=async_batches(FOUR_BATCHES),
        step_optimizer=optimizer.step,
    )
    reference, _ = reference_training([[b] for b in FOUR_BATCHES], 1, 0.1)
    assert_same(module, reference)


def nan_batches() -> list[Batch]:
    batches = [(x.clone(), y) for x, y in FOUR_BATCHES]
    batches[2][0][1, 0] = float("nan")
    return batches


@pytest.mark.anyio
async def test_non_finite_loss_raises_at_the_step_before_the_optimizer_steps() -> None:
    """ "Non-finite losses are detected at the step, before the optimizer steps ... `"raise"`, the
    default ...; the error names the epoch, step, batch and ranks (`.step`, `.ranks` are new)"."""
    module = make_module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with pytest.raises(lamploop.errors.NonFiniteLossError) as caught:
        await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module, MSE_SUM),
            batches=async_batches(nan_batches()),
            step_optimizer=optimizer.step,
            epoch=4,
        )
    error = caught.value
    assert (error.epoch, error.step, error.batch, tuple(error.ranks)) == (4, 2, 2, (0,))
    reference, _ = reference_training([[b] for b in FOUR_BATCHES[:2]], 1, 0.1)
    assert_same(module, reference)  # steps 0 and 1 taken, step 2 not


@pytest.mark.anyio
async def test_skip_step_drops_the_step_and_equals_a_run_without_its_batches() -> None:
    """`on_non_finite_loss="skip_step"` (docs/loop.md: "no optimizer step, its gradients cleared,
    its batches left out of the epoch's mean loss ... The result equals a run that never saw those
    batches")."""
    module = make_module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = await lamploop.one_epoch(
            model=lamploop.SupervisedModel(module, MSE_SUM),
            batches=async_batches(nan_batches()),
            step_optimizer=optimizer.step,
            on_non_finite_loss="skip_step",
        )
    kept = [FOUR_BATCHES[i] for i in (0, 1, 3)]
    reference, (mean,) = reference_training([[b] for b in kept], 1, 0.1)
    assert_same(module, reference)
    assert result == pytest.approx(mean, rel=1e-12)


@pytest.mark.anyio
async def test_model_error_on_a_batch_is_a_batch_error_naming_epoch_and_batch() -> None:
    """ "A model or loss that raises on a batch now raises `BatchError` naming the epoch and batch
    (torch's error as the cause) instead of the raw error"; `epoch` is "only for error messages"."""
    batches = [
        FOUR_BATCHES[0],
        (torch.zeros(2, 5, dtype=torch.float64), torch.zeros(2, 1, dtype=torch.float64)),
    ]
    with pytest.raises(lamploop.errors.BatchError) as caught:
        await lamploop.one_epoch(
            model=lamploop.SupervisedModel(make_module(), MSE_SUM),
            batches=async_batches(batches),
            step_optimizer=lambda: None,
            epoch=7,
        )
    message = str(caught.value)
    assert "7" in message, message
    assert "1" in message, message
    assert isinstance(caught.value.__cause__, RuntimeError)


@pytest.mark.anyio
async def test_after_step_gets_each_steps_examples_and_loss_sum() -> None:
    """ "`one_epoch` gains `after_step=`: called after every step with the step's example count and
    loss sum over every rank"."""
    calls: list[tuple[int, float]] = []
    module = make_module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    await lamploop.one_epoch(
        model=lamploop.SupervisedModel(module, MSE_SUM),
        batches=async_batches(FOUR_BATCHES),
        step_optimizer=optimizer.step,
        accumulate_gradient_over_n_batches=2,
        after_step=lambda examples, loss_sum: calls.append((examples, float(loss_sum))),
    )
    reference = make_module()
    expected = []
    for group in (FOUR_BATCHES[:2], FOUR_BATCHES[2:]):
        reference.zero_grad()
        loss_sum = sum(F.mse_loss(reference(x), y, reduction="sum") for x, y in group)
        count = sum(len(y) for _, y in group)
        (loss_sum / count).backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
        expected.append((count, float(loss_sum.detach())))
    assert [c for c, _ in calls] == [c for c, _ in expected]
    assert [s for _, s in calls] == pytest.approx([s for _, s in expected], rel=1e-12)


# ---------------------------------------------------------------------------------------------
# "Schedules", "Model selection", learning-curve entries.
# ---------------------------------------------------------------------------------------------


class Effects:
    def __init__(self, validation: Sequence[float]) -> None:
        self.validation = validation
        self.epoch = -1
        self.factors: list[float] = []
        self.saved: list[int] = []

    async def train(self, factor: float) -> float:
        self.epoch += 1
        self.factors.append(factor)
        return 1.0

    async def valid(self) -> float:
        return self.validation[self.epoch]

    async def save(self) -> None:
        self.saved.append(self.epoch)


def test_schedules_say_whether_they_need_a_validation_loss_and_their_state_type() -> None:
    """ "A schedule also has `needs_validation_loss` ... and `state_type` (so a checkpoint can read
    the schedule state back from JSON)"."""
    plateau = lamploop.reduce_lr_on_plateau(patience=1)
    assert plateau.needs_validation_loss is True
    for schedule in (
        lamploop.noop(),
        lamploop.decrement(2, 0.5),
        lamploop.linear(1.0, 0.0, 4),
        lamploop.step_after(2, 0.1),
    ):
        assert schedule.needs_validation_loss is False, schedule
        assert hasattr(schedule, "state_type")
    state, _ = plateau.learning_rate_factor(plateau.init(), 0, None)
    state, _ = plateau.learning_rate_factor(state, 1, 1.0)
    back = converter.structure(json.loads(json.dumps(converter.unstructure(state))), plateau.state_type)
    assert back == state


@pytest.mark.anyio
async def test_epochs_refuses_a_plateau_schedule_without_validation() -> None:
    """ "so `epochs` can refuse to run a plateau schedule without a validation epoch, instead of
    silently never reducing\""""
    effects = Effects([1.0] * 3)
    with pytest.raises(lamploop.errors.ConfigurationError):
        await lamploop.epochs(
            max_epochs=3,
            train_epoch=effects.train,
            validation_epoch=None,
            save_min_validation_loss_model=effects.save,
            learning_rate_schedule=lamploop.reduce_lr_on_plateau(patience=0),
        )
    assert effects.factors == []


@pytest.mark.anyio
async def test_plateau_patience_counts_validations_with_validation_frequency_three() -> None:
    """ "Patience therefore counts validations by position ... `validation_frequency > 1` neither
    shortens nor stretches the patience" (docs/loop.md: "multiplied by `reduce_factor` after more
    than `patience` validations without `v < best - threshold * abs(best)`"): checked against
    torch's ReduceLROnPlateau (relative threshold) fed the same validation losses."""
    validations = [1.0, 0.9, 0.95, 0.96, 0.97, 0.5, 0.5, 0.5, 0.5, 0.5]
    frequency = 3
    effects = Effects([v for v in validations for _ in range(frequency)])
    await lamploop.epochs(
        max_epochs=len(validations) * frequency,
        train_epoch=effects.train,
        validation_epoch=effects.valid,
        save_min_validation_loss_model=effects.save,
        validation_frequency=frequency,
        learning_rate_schedule=lamploop.reduce_lr_on_plateau(patience=1, validation_frequency=frequency),
    )
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizer, mode="min", factor=0.5, patience=1, threshold=1e-4, threshold_mode="rel"
    )
    expected = [1.0]
    for v in validations:
        scheduler.step(v)
        expected += [optimizer.param_groups[0]["lr"]] * frequency
    assert effects.factors == expected[: len(effects.factors)]
    assert min(effects.factors) < 1.0  # the plateau reduced


@pytest.mark.parametrize(
    "eligible",
    [range(1, 3), frozenset({1, 2}), [1, 2]],
    ids=["range", "frozenset", "list"],
)
@pytest.mark.anyio
async def test_return_min_validation_loss_model_accepts_any_container(eligible: Any) -> None:
    """ "`return_min_validation_loss_model` accepts any container of epochs"."""
    effects = Effects([0.5, 1.0, 0.75, 0.25])
    final = await lamploop.epochs(
        max_epochs=4,
        train_epoch=effects.train,
        validation_epoch=effects.valid,
        save_min_validation_loss_model=effects.save,
        return_min_validation_loss_model=eligible,
    )
    assert effects.saved == [1, 2]
    assert (final.min_validation_loss, final.min_validation_epoch) == (0.75, 2)


class OnlyContains:
    def __contains__(self, epoch: object) -> bool:
        return epoch in (0, 3)


@pytest.mark.anyio
async def test_return_min_validation_loss_model_accepts_a_bare_container() -> None:
    """ "accepts any container of epochs" (an object with only `__contains__`)."""
    effects = Effects([0.5, 0.25, 0.75, 0.125])
    final = await lamploop.epochs(
        max_epochs=4,
        train_epoch=effects.train,
        validation_epoch=effects.valid,
        save_min_validation_loss_model=effects.save,
        return_min_validation_loss_model=OnlyContains(),
    )
    assert effects.saved == [0, 3]
    assert final.min_validation_epoch == 3


def test_learning_curve_entry_additions_keep_old_json_and_equality() -> None:
    """ "`LearningCurveEntry` gains `training_metrics` and `validation_metrics` (left out of the JSON
    when empty ...)"; "`learning_rate_factor` (... `None` in older checkpoints, left out of the JSON
    when `None`). It is left out of `==`"."""
    old = lamploop.LearningCurveEntry(epoch=1, training_loss=0.5, validation_loss=(0.25, 0.125))
    assert set(converter.unstructure(old)) == {"epoch", "training_loss", "validation_loss"}
    with_factor = attrs.evolve(old, learning_rate_factor=0.5)
    assert with_factor == old
    assert converter.unstructure(with_factor)["learning_rate_factor"] == 0.5
    back = converter.structure(converter.unstructure(with_factor), lamploop.LearningCurveEntry)
    assert back.learning_rate_factor == 0.5
    assert (
        converter.structure(
            {"epoch": 1, "training_loss": 0.5, "validation_loss": None}, lamploop.LearningCurveEntry
        ).learning_rate_factor
        is None
    )


@pytest.mark.anyio
async def test_metric_selected_by_max_holds_best_metric_in_min_validation_loss() -> None:
    """ "With a metric selected by its maximum, `LoopState.min_validation_loss` holds the best
    (largest) smoothed metric ... and `last_validation_loss` (what schedules see) stays the loss"."""
    from lamploop.metrics import PassResult

    losses = [1.0, 0.5, 0.25]
    accuracy = [0.5, 0.9, 0.7]
    effects = Effects(losses)

    async def valid() -> float:
        e = effects.epoch
        return PassResult(losses[e], metrics={"accuracy": accuracy[e]})

    final = await lamploop.epochs(
        max_epochs=3,
        train_epoch=effects.train,
        validation_epoch=valid,
        save_min_validation_loss_model=effects.save,
        return_min_validation_loss_model=lamploop.ALL_EPOCHS,
        model_selection_metric="accuracy",
        model_selection_mode="max",
    )
    assert (final.min_validation_loss, final.min_validation_epoch) == (0.9, 1)
    assert final.last_validation_loss == 0.25
    assert effects.saved == [0, 1]


# ---------------------------------------------------------------------------------------------
# "Checkpoints": format 2, step names, save sequence for keep_last and the fallback.
# ---------------------------------------------------------------------------------------------


def checkpoint_state(epoch: int, value: float) -> lamploop.LoopStateWithModelAndOptimizerData:
    return lamploop.LoopStateWithModelAndOptimizerData(
        loop_state=lamploop.LoopState(epoch=epoch),
        model={"w": torch.full((2,), value)},
        optimizer={"state": {}, "param_groups": []},
        best_model={},
    )


def checkpoint_names(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("epoch-")}


def test_keep_last_prunes_by_save_sequence_not_by_epoch(tmp_path: Path) -> None:
    """ "a save `sequence` that orders checkpoints for `keep_last` ... after resuming from an older
    checkpoint the later epochs belong to an abandoned run: ordering by position would keep them"."""
    for epoch in range(1, 6):
        lamploop.save_checkpoint(tmp_path, checkpoint_state(epoch, epoch), keep_last=None)
    # resumed from epoch 1: epochs 2 and 3 again
    lamploop.save_checkpoint(tmp_path, checkpoint_state(2, 20.0), keep_last=2)
    lamploop.save_checkpoint(tmp_path, checkpoint_state(3, 30.0), keep_last=2)
    assert checkpoint_names(tmp_path) == {"epoch-000002", "epoch-000003"}
    loaded = lamploop.load_checkpoint(tmp_path)
    assert loaded.state.loop_state.epoch == 3
    assert torch.equal(loaded.state.model["w"], torch.full((2,), 30.0))


def test_fallback_to_newest_valid_by_sequence_and_never_for_an_explicit_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ "`load_checkpoint(root)` falls back to the newest valid checkpoint when `latest` names a
    missing or invalid one (a warning names it); an explicitly named checkpoint never does"."""
    for epoch in range(1, 6):
        lamploop.save_checkpoint(tmp_path, checkpoint_state(epoch, epoch), keep_last=None)
    lamploop.save_checkpoint(tmp_path, checkpoint_state(2, 20.0), keep_last=None)
    latest = lamploop.save_checkpoint(tmp_path, checkpoint_state(3, 30.0), keep_last=None)
    for tensors in latest.glob("*.safetensors"):
        tensors.write_bytes(tensors.read_bytes()[:10])
    with pytest.raises(lamploop.errors.CheckpointError):
        lamploop.load_checkpoint(latest)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        loaded = lamploop.load_checkpoint(tmp_path)
    # by sequence the newest valid one is the resumed run's epoch 2, not the abandoned epoch 5
    assert loaded.state.loop_state.epoch == 2
    assert torch.equal(loaded.state.model["w"], torch.full((2,), 20.0))
    said = " ".join(str(w.message) for w in caught) + caplog.text
    assert latest.name in said


def test_step_boundary_checkpoint_name_position_and_rank_rngs(tmp_path: Path) -> None:
    """ "step-boundary checkpoints (`epoch-000005-step-000120`, with `Checkpoint.position`), every
    rank's RNG states (`Checkpoint.rank_rngs`)"."""
    from lamploop.loop.boundary import EpochPosition

    position = EpochPosition(
        epoch=5,
        lr_factor=0.5,
        steps_done=120,
        last_step_examples=4,
        loss_sums=(1.5, 2.5),
        example_counts=(480, 480),
    )
    written = lamploop.save_checkpoint(tmp_path, checkpoint_state(5, 1.0), position=position)
    assert written.name == "epoch-000005-step-000120"
    loaded = lamploop.load_checkpoint(tmp_path)
    assert loaded.position == position


# ---------------------------------------------------------------------------------------------
# "Public names", "Where things live", "fit".
# ---------------------------------------------------------------------------------------------


def test_moved_names_still_resolve_outside_all() -> None:
    """ "`lamploop.converter` moved to `lamploop.state.converter`, and `SingleProcessChannel` /
    `TensorChannel` to `lamploop.sync` ... The old names still resolve (not in `__all__`)"."""
    assert lamploop.converter is lamploop.state.converter
    assert lamploop.SingleProcessChannel is lamploop.sync.SingleProcessChannel
    assert lamploop.TensorChannel is lamploop.sync.TensorChannel
    for name in ("converter", "SingleProcessChannel", "TensorChannel"):
        assert name not in lamploop.__all__
    for name in (
        "TcpControlRoot",
        "TcpControlFollower",
        "local_control",
        "register_strategy",
        "strategy_names",
    ):
        assert name in lamploop.__all__


@pytest.mark.parametrize(
    "module",
    [
        "lamploop.epoch",
        "lamploop.tensors",
        "lamploop.process_group",
        "lamploop.replica",
        "lamploop.launch",
        "lamploop.step_schedules",
        "lamploop.torch_schedulers",
        "lamploop.config",
    ],
)
def test_removed_modules_are_gone(module: str) -> None:
    """ "`lamploop.epoch`, `lamploop.tensors`, `lamploop.process_group`, `lamploop.replica` and
    `lamploop.launch` are gone"; `lamploop.step_schedules`, `lamploop.torch_schedulers` "gone:
    import them from the package"; "`lamploop.config` is `lamploop.demo.config`"."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(module)


def test_modules_live_where_the_page_says() -> None:
    """ "Where things live (0.3)"."""
    from lamploop.schedules import linear

    assert linear is lamploop.linear
    assert lamploop.schedules.epoch.linear is lamploop.linear
    for module in (
        "lamploop.schedules.step",
        "lamploop.schedules.torch_scheduler",
        "lamploop.demo.config",
        "lamploop.distributed.placement",
        "lamploop.checkpoint.resume",
        "lamploop.distributed.launch",
        "lamploop.stopping",
        "lamploop.arguments",
        "lamploop.loop.stop_aware",
        "lamploop.reporting.events",
    ):
        importlib.import_module(module)
    demo = importlib.import_module("lamploop.demo")
    assert demo.config is importlib.import_module("lamploop.demo.config")
    from lamploop.distributed.boundaries import StopRequest as FromBoundaries
    from lamploop.loop.stop_request import StopRequest

    assert FromBoundaries is StopRequest
    from lamploop.distributed.launch import open_root  # noqa: F401
    from lamploop.fit import AUTO_DEVICE  # noqa: F401
    from lamploop.loop.stop_aware import stop_aware_batches  # noqa: F401
    from lamploop.stopping import reported_run  # noqa: F401

    assert lamploop.schedules.epoch.PlateauState.__module__ == "lamploop.schedules.epoch"


def test_plateau_checkpoint_names_its_state_type_in_the_new_module(tmp_path: Path) -> None:
    """ "A checkpoint's informational `schedule_state_type` now reads
    `lamploop.schedules.epoch.PlateauState`"."""
    schedule = lamploop.reduce_lr_on_plateau(patience=1)
    state, _ = schedule.learning_rate_factor(schedule.init(), 0, None)
    written = lamploop.save_checkpoint(tmp_path, checkpoint_state(1, 1.0), schedule_state=state)
    assert "lamploop.schedules.epoch.PlateauState" in "".join(p.read_text() for p in written.glob("*.json"))
    assert lamploop.load_checkpoint(tmp_path, schedule=schedule).schedule_state == state


FIT_KEYWORDS = {
    "heartbeat_interval": 0.5,
    "heartbeat_timeout": 4.0,
    "collective_timeout": 1800.0,
    "bucket_cap_mb": 25.0,
    "reporters": None,
    "strategy": "auto",
    "device": "auto",
    "on_non_finite_loss": "raise",
    "max_gradient_norm": None,
    "precision": "32",
    "averaging": None,
    "model_selection_metric": None,
    "model_selection_mode": "min",
    "early_stopping_patience": None,
}


@pytest.mark.parametrize("name", ["fit", "fit_async"])
def test_fit_has_explicit_keyword_only_signature_with_documented_defaults(name: str) -> None:
    """ "`fit` and `fit_async` have explicit keyword-only signatures (one list ...)"; "Heartbeats
    every 0.5 s, a peer silent for 4 s is lost"; "`device="auto"` is the default"; `fit` defaults
    `return_min_validation_loss_model` to `ALL_EPOCHS`; "every entry point defaults to
    `strategy="auto"`"."""
    parameters = inspect.signature(getattr(lamploop, name)).parameters
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in parameters.values())
    assert list(parameters) == list(inspect.signature(lamploop.fit).parameters)
    for keyword, default in FIT_KEYWORDS.items():
        assert parameters[keyword].default == default, keyword
    assert parameters["return_min_validation_loss_model"].default is lamploop.ALL_EPOCHS
    for function in (lamploop.follow_distributed_training, lamploop.drive_distributed_training):
        assert "settings" in inspect.signature(function).parameters
    assert lamploop.TrainingSettings().strategy == "auto"
    assert (
        inspect.signature(lamploop.follow_distributed_training).parameters["optimizer_factory"].default
        is None
    )


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_fit_inside_a_running_event_loop_runs() -> None:
    """ "`fit` called inside a running event loop (a notebook) runs on a thread of its own instead of
    failing"; fit's default `return_min_validation_loss_model` selects among all epochs."""
    module = make_module()
    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, MSE_SUM),
        optimizer_factory=sgd(0.1),
        train_batches=per_rank_factory(ONE_RANK_SLICES),
        validation_batches=per_rank_factory([[slice(20, 28)]]),
        max_epochs=2,
        device="cpu",
        reporters=[],
    )
    assert isinstance(state, lamploop.LoopState)
    reference, losses = reference_training(steps_of(ONE_RANK_SLICES), 2, 0.1)
    assert [e.training_loss for e in state.learning_curve] == pytest.approx(losses, rel=1e-12)
    assert state.min_validation_epoch is not None  # ALL_EPOCHS by default
    if state.min_validation_epoch == 1:  # the last epoch is the best: the model is the trained one
        assert_same(module, reference)


# ---------------------------------------------------------------------------------------------
# "Streaming on several ranks", "Observability".
# ---------------------------------------------------------------------------------------------


class EndedStream:
    """An `EndingBatchStream` whose source has ended: no batch, `source_ended` True."""

    source_ended = True

    def __aiter__(self) -> EndedStream:
        return self

    async def __anext__(self) -> Batch:
        raise StopAsyncIteration


@pytest.mark.anyio
async def test_an_ended_stream_raises_stream_exhausted_a_batch_error() -> None:
    """ "the first training epoch in which no rank has a batch and every stream says it ended ends
    the run ...: `one_epoch` raises `StreamExhausted` (a `BatchError` ...) ... Other streams that
    are empty on every rank are still a `BatchError`"."""
    model = lamploop.SupervisedModel(make_module(), MSE_SUM)
    with pytest.raises(lamploop.errors.StreamExhausted):
        await lamploop.one_epoch(model=model, batches=EndedStream(), step_optimizer=lambda: None)
    assert issubclass(lamploop.errors.StreamExhausted, lamploop.errors.BatchError)
    with pytest.raises(lamploop.errors.BatchError) as caught:
        await lamploop.one_epoch(model=model, batches=async_batches([]), step_optimizer=lambda: None)
    assert not isinstance(caught.value, lamploop.errors.StreamExhausted)


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_epochs_end_with_the_state_before_the_exhausted_epoch() -> None:
    """ "and `epochs` returns the state of the epochs before it" (through the driver, one rank)."""

    def factory(context: lamploop.BatchContext) -> Any:
        if context.epoch < 2:
            return _ListStream([(X[0:4], Y[0:4])], ended=False)
        return EndedStream()

    module = make_module()
    final = await drive_alone(
        model=lamploop.SupervisedModel(module, MSE_SUM), train_batches=factory, max_epochs=5
    )
    assert final.epoch == 2
    reference, losses = reference_training([[(X[0:4], Y[0:4])]], 2, 0.1)
    assert [e.training_loss for e in final.learning_curve] == pytest.approx(losses, rel=1e-12)
    assert_same(module, reference)


class _ListStream:
    def __init__(self, batches: Sequence[Batch], *, ended: bool) -> None:
        self.batches = list(batches)
        self.source_ended = ended

    def __aiter__(self) -> _ListStream:
        return self

    async def __anext__(self) -> Batch:
        if not self.batches:
            raise StopAsyncIteration
        return self.batches.pop(0)


class Recorder:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def report(self, event: Any) -> None:
        self.events.append(event)


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_driver_reports_events_with_steps_examples_and_time() -> None:
    """ "`drive_distributed_training` gains `reporters=` (default: none): the root reports ... run
    started, ... each epoch's start, ..., epoch end, run finished"; "`EpochFinished` has `seconds`,
    `steps` and `examples`; every event has `time`"."""
    from lamploop.reporting import events

    recorder = Recorder()
    await drive_alone(
        model=lamploop.SupervisedModel(make_module(), MSE_SUM),
        train_batches=per_rank_factory(ONE_RANK_SLICES),
        max_epochs=2,
        reporters=[recorder],
    )
    kinds = [type(e).__name__ for e in recorder.events]
    assert kinds[0] == "RunStarted", kinds
    assert kinds[-1] == "RunFinished", kinds
    assert kinds.count("EpochStarted") == 2
    assert kinds.count("EpochFinished") == 2
    finished = [e for e in recorder.events if isinstance(e, events.EpochFinished)]
    assert [(e.steps, e.examples) for e in finished] == [(3, 12), (3, 12)]
    assert all(e.seconds >= 0 for e in finished)
    times = [e.time for e in recorder.events]
    assert all(isinstance(t, float) and math.isfinite(t) for t in times)
    assert times == sorted(times)
