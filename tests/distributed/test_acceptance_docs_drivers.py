"""Acceptance tests of the distributed drivers, written from the docs alone.

What is checked: ``drive_distributed_training`` / ``follow_distributed_training`` over the
in-process channel (``local_control``, ranks as tasks of one event loop) and over the TCP
channel (one process per rank), ``fit(world_size=n)`` and ``local_data_parallel_training_loop``
(one process, several CPU replicas), each against a reference written here in plain torch
(float64, a hand-written data-parallel SGD: one optimizer step per step of every rank, its
gradient the mean over every example of the step on every rank).

The contract is /work/shared/DESIGN.md sections 2-5, 7, 8, docs/distributed.md,
docs/concepts/control-channels.md, docs/control-channel.md and the public docstrings; each
test quotes the sentence it checks. Real Gloo process groups on 127.0.0.1, never mocks; every
wait is bounded (anyio.fail_after, subprocess timeouts, pytest-timeout).
"""

from __future__ import annotations

import copy
import logging
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from support import WORKERS
from workers import acceptance_drivers_rank as worker
from workers.records import load_record, save_record

import lamploop
from lamploop.control import TcpControlRoot, local_control
from lamploop.distributed import (
    drive_distributed_training,
    follow_distributed_training,
    local_data_parallel_training_loop,
)
from lamploop.errors import (
    BatchError,
    ConfigurationError,
    DistributedError,
    HandshakeError,
    LamploopError,
)
from lamploop.state import converter

F64 = torch.float64
HIDDEN = 4
LR = 0.05
MOMENTUM = 0.9
WORKER = WORKERS / "acceptance_drivers_rank.py"

Batch = tuple[torch.Tensor, torch.Tensor]
PerRankEpochs = list[list[list[Batch]]]  # [rank][epoch] -> batches


# ----------------------------------------------------------------------------------------
# data and the plain-torch reference
# ----------------------------------------------------------------------------------------


def make_batches(generator: torch.Generator, sizes: Sequence[int], *, shift: float = 0.0) -> list[Batch]:
    batches = []
    for size in sizes:
        features = torch.randn(size, 3, generator=generator, dtype=F64)
        target = torch.sin(features.sum(dim=1, keepdim=True)) + shift
        target = target + 0.1 * torch.randn(size, 1, generator=generator, dtype=F64)
        batches.append((features, target))
    return batches


def make_per_rank(
    seed: int, sizes: Sequence[Sequence[Sequence[int]]], *, shift: float = 0.0
) -> PerRankEpochs:
    """``sizes[rank][epoch]`` lists the batch sizes of that rank's stream in that epoch."""
    generator = torch.Generator().manual_seed(seed)
    return [[make_batches(generator, epoch, shift=shift) for epoch in rank] for rank in sizes]


# Uneven on purpose: ranks with different numbers of batches and different batch sizes, a
# rank with no batch at all in epoch 0, and counts that end in the middle of a group of k=2.
UNEVEN_TRAIN_SIZES = [
    [[4, 4, 4, 4, 3], [4, 4, 4], [4, 2, 4, 4, 4], [4, 4]],  # rank 0
    [[3, 3], [3, 3, 3, 3, 3, 3], [3], [3, 3, 3]],  # rank 1
    [[], [2, 2, 2], [5, 5], [2]],  # rank 2
]
UNEVEN_VALID_SIZES = [
    [[5, 5]] * 4,
    [[3]] * 4,
    [[4, 2]] * 4,
]
FACTORS = [1.0, 0.5, 0.25, 0.0, 1.0, 1.0]  # epoch 3's factor 0 ends the run after 3 epochs


def factor_of_epoch(epoch: int) -> float:
    return FACTORS[epoch]


def initial_state(seed: int = 0) -> dict[str, torch.Tensor]:
    return {
        name: value.clone() for name, value in worker.build_module(HIDDEN, seed=seed).state_dict().items()
    }


def fresh_model(init: dict[str, torch.Tensor] | None, seed: int) -> lamploop.SupervisedModel:
    module = worker.build_module(HIDDEN, seed=seed)
    if init is not None:
        module.load_state_dict(init)
    return lamploop.SupervisedModel(module, loss=worker.squared_error)


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def steps_of_epoch(train: PerRankEpochs, epoch: int, k: int) -> list[Batch]:
    """Step j is every rank's batches j*k .. j*k+k-1 (an exhausted rank adds none), concatenated."""
    per_rank = [rank[epoch] for rank in train]
    n_steps = max((math.ceil(len(batches) / k) for batches in per_rank), default=0)
    steps = []
    for j in range(n_steps):
        parts = [batch for batches in per_rank for batch in batches[j * k : (j + 1) * k]]
        steps.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    return steps


def mean_loss(module: torch.nn.Module, batches: Sequence[Batch]) -> float:
    with torch.no_grad():
        total = sum(float(((module(x) - y) ** 2).sum()) for x, y in batches)
    return total / sum(int(y.shape[0]) for _, y in batches)


class Reference:
    """Data-parallel SGD in plain torch, float64, with lamp's epoch loop written out by hand."""

    def __init__(
        self,
        *,
        init: dict[str, torch.Tensor],
        train: PerRankEpochs,
        valid: PerRankEpochs | None,
        k: int,
        max_epochs: int,
        factor: Callable[[int], float] = lambda epoch: 1.0,
        smoothing: float = 1.0,
        validation_frequency: int = 1,
        eligible: Callable[[int], bool] = lambda epoch: False,
        module_factory: Callable[[], torch.nn.Module] = lambda: worker.build_module(HIDDEN),
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        lr: float = LR,
        momentum: float = MOMENTUM,
    ) -> None:
        module = module_factory()
        module.load_state_dict(init)
        optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum)
        self.after_epoch: list[dict[str, torch.Tensor]] = []
        self.momentum_after_epoch: list[list[torch.Tensor]] = []
        self.training_losses: list[float] = []
        self.validation: list[tuple[float, float] | None] = []  # (smoothed, raw)
        self.factors: list[float] = []
        self.best_epoch: int | None = None
        self.best_loss: float | None = None
        self.best_weights: dict[str, torch.Tensor] | None = None
        smoothed: float | None = None
        for epoch in range(max_epochs):
            lr_factor = factor(epoch)
            if lr_factor <= 0:
                break
            self.factors.append(lr_factor)
            for group in optimizer.param_groups:
                group["lr"] = lr * lr_factor
            loss_sum, count = 0.0, 0
            for features, target in steps_of_epoch(train, epoch, k):
                optimizer.zero_grad()
                output = module(features)
                step_sum = ((output - target) ** 2).sum() if loss is None else loss(output, target)
                (step_sum / target.shape[0]).backward()
                optimizer.step()
                loss_sum += float(step_sum.detach())
                count += int(target.shape[0])
            self.training_losses.append(loss_sum / count)
            self.after_epoch.append(weights(module))
            self.momentum_after_epoch.append(
                [optimizer.state[p]["momentum_buffer"].clone() for p in module.parameters() if momentum]
            )
            if valid is not None and epoch % validation_frequency == 0:
                raw = mean_loss(module, [batch for rank in valid for batch in rank[epoch]])
                smoothed = raw if smoothed is None else raw * smoothing + smoothed * (1 - smoothing)
                self.validation.append((smoothed, raw))
                if eligible(epoch) and (self.best_loss is None or smoothed < self.best_loss):
                    self.best_epoch, self.best_loss = epoch, smoothed
                    self.best_weights = weights(module)
            else:
                self.validation.append(None)
        self.last_smoothed = smoothed
        self.epochs_run = len(self.after_epoch)
        self.final = self.after_epoch[-1]


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Equal to float64 round-off (the docs promise 1e-6; the same arithmetic gives far less)."""
    assert list(actual) == list(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-9, atol=1e-10)


def assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for name in expected:
        assert torch.equal(actual[name], expected[name]), name


def assert_loop_state_matches(state: lamploop.LoopState, reference: Reference) -> None:
    assert isinstance(state, lamploop.LoopState)
    assert state.epoch == reference.epochs_run
    curve = state.learning_curve
    assert [entry.epoch for entry in curve] == list(range(reference.epochs_run))
    for entry, train_loss, validation, lr_factor in zip(
        curve, reference.training_losses, reference.validation, reference.factors, strict=True
    ):
        assert isinstance(entry, lamploop.LearningCurveEntry)
        assert entry.training_loss == pytest.approx(train_loss, rel=1e-9)
        assert entry.learning_rate_factor == pytest.approx(lr_factor)
        if validation is None:
            assert entry.validation_loss is None
        else:
            assert entry.validation_loss == pytest.approx(validation, rel=1e-9)
    if reference.last_smoothed is None:
        assert state.last_validation_loss is None
    else:
        assert state.last_validation_loss == pytest.approx(reference.last_smoothed, rel=1e-9)
    assert state.min_validation_epoch == reference.best_epoch
    if reference.best_loss is None:
        assert state.min_validation_loss is None
    else:
        assert state.min_validation_loss == pytest.approx(reference.best_loss, rel=1e-9)


class Recorder:
    """A stream factory over ``per_rank[rank][epoch]`` that records every context it is called with."""

    def __init__(self, per_rank: PerRankEpochs) -> None:
        self.per_rank = per_rank
        self.calls: list[tuple[int, int, int]] = []

    def __call__(self, context: lamploop.BatchContext) -> Any:
        self.calls.append((context.epoch, context.rank, context.nranks))
        batches = list(self.per_rank[context.rank][context.epoch])
        return lamploop.iterable_batches(lambda _context: batches)(context)


async def run_local_ranks(
    nranks: int,
    root: Callable[[Any], Any],
    follower: Callable[[int, Any], Any],
    *,
    limit: float = 30.0,
) -> dict[int, Any]:
    """Root and followers as tasks of this event loop over ``local_control``: each rank's result or error."""
    root_control, followers = local_control(nranks, join_timeout=10.0)
    results: dict[int, Any] = {}

    async def one_rank(rank: int, control: Any, body: Callable[[Any], Any]) -> None:
        try:
            async with control:
                results[rank] = await body(control)
        except Exception as error:  # every rank's outcome is what the test checks
            results[rank] = error

    with anyio.fail_after(limit):
        async with anyio.create_task_group() as tasks:
            for control in followers:
                tasks.start_soon(one_rank, control.rank, control, lambda c, r=control.rank: follower(r, c))
            tasks.start_soon(one_rank, 0, root_control, root)
    return results


def unwrap(error: BaseException) -> BaseException:
    """The first leaf of an exception group (anyio task groups may wrap a rank's error)."""
    while getattr(error, "exceptions", None):
        error = error.exceptions[0]  # type: ignore[attr-defined]
    return error


# ----------------------------------------------------------------------------------------
# drive / follow over the in-process channel
# ----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("followers_have_optimizer", "strategy_logged"),
    [(True, "all_reduce"), (False, "reduce_to_root")],
    ids=["followers_with_optimizer", "followers_without_optimizer"],
)
def test_drive_follow_local_uneven_streams_match_reference(
    followers_have_optimizer: bool, strategy_logged: str, caplog: pytest.LogCaptureFixture
) -> None:
    """DESIGN.md 3: "Uneven streams: ... a rank whose stream is exhausted contributes zero
    examples until every rank is exhausted; no example is dropped and nothing hangs." and
    "one optimizer step uses the gradient of (sum of losses of every example in the step, over
    all ranks and all accumulated batches) / (number of those examples)"; "An epoch that ends
    in the middle of an accumulation group still steps with what it has."; "Global losses: the
    training and validation losses reported are the mean over all examples of all ranks".
    DESIGN.md 2: "checkpoint_state ... called after every epoch with LoopState(epoch + 1, ...)";
    "A factor <= 0 ends training (early stopping). The factor multiplies every param group's
    base lr."; "train_batches / validation_batches are factories called once per epoch with a
    context (epoch, rank, nranks)". docs/distributed.md: "followers always start from the
    root's state"; "the ranks count at start how many of them have an optimizer, and use
    "all_reduce" when all do ..., else lamp's "reduce_to_root" ... The choice is logged on the
    root."
    """
    nranks, k = 3, 2
    init = initial_state(seed=0)
    train = make_per_rank(1, UNEVEN_TRAIN_SIZES)
    valid = make_per_rank(2, UNEVEN_VALID_SIZES)
    reference = Reference(
        init=init, train=train, valid=valid, k=k, max_epochs=6, factor=factor_of_epoch, smoothing=0.5
    )
    assert reference.epochs_run == 3
    models = {0: fresh_model(init, seed=0)} | {r: fresh_model(None, seed=10 + r) for r in (1, 2)}
    train_factories = {r: Recorder(train) for r in range(nranks)}
    valid_factories = {r: Recorder(valid) for r in range(nranks)}
    checkpoints: list[tuple[lamploop.LoopStateWithModelAndOptimizerData, Any]] = []

    async def checkpoint_state(
        data: lamploop.LoopStateWithModelAndOptimizerData, schedule_state: Any
    ) -> None:
        checkpoints.append((copy.deepcopy(data), schedule_state))

    async def root(control: Any) -> lamploop.LoopState:
        return await drive_distributed_training(
            nranks=nranks,
            device="cpu",
            control=control,
            model=models[0],
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
            train_batches=train_factories[0],
            validation_batches=valid_factories[0],
            max_epochs=6,
            checkpoint_state=checkpoint_state,
            learning_rate_schedule=lamploop.from_epoch_count(factor_of_epoch),
            accumulate_gradient_over_n_batches=k,
            validation_loss_exponential_smoothing_factor=0.5,
        )

    async def follower(rank: int, control: Any) -> None:
        extra: dict[str, Any] = {}
        if followers_have_optimizer:
            extra["optimizer_factory"] = lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
        await follow_distributed_training(
            rank=rank,
            nranks=nranks,
            device="cpu",
            control=control,
            model=models[rank],
            train_batches=train_factories[rank],
            validation_batches=valid_factories[rank],
            accumulate_gradient_over_n_batches=k,
            **extra,
        )

    with caplog.at_level(logging.INFO, logger="lamploop"):
        results = anyio.run(run_local_ranks, nranks, root, follower)
    for rank in range(nranks):
        assert not isinstance(results[rank], BaseException), (rank, results[rank])

    state = results[0]
    assert results[1] is None
    assert results[2] is None
    assert_loop_state_matches(state, reference)
    # every rank holds the same weights, bit for bit, and they are the reference's
    final = weights(models[0].module)
    assert_close(final, reference.final)
    for rank in (1, 2):
        assert_bitwise(weights(models[rank].module), final)
    # checkpoint_state: after every epoch e, with LoopState(e + 1), the live model and optimizer
    assert [data.loop_state.epoch for data, _ in checkpoints] == [1, 2, 3]
    for epoch, (data, _schedule_state) in enumerate(checkpoints):
        assert isinstance(data, lamploop.LoopStateWithModelAndOptimizerData)
        assert data.loop_state.learning_curve == state.learning_curve[: epoch + 1]
        assert_close(dict(data.model), reference.after_epoch[epoch])
        buffers = [data.optimizer["state"][i]["momentum_buffer"] for i in range(4)]
        for got, expected in zip(buffers, reference.momentum_after_epoch[epoch], strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)
        assert len(data.best_model) == 0  # no epoch was eligible
    # each factory was called once per epoch (validation once per validated epoch) with its context
    for rank in range(nranks):
        expected_calls = [(epoch, rank, nranks) for epoch in range(3)]
        assert train_factories[rank].calls == expected_calls
        assert valid_factories[rank].calls == expected_calls
    logged = " ".join(record.getMessage() for record in caplog.records if record.name.startswith("lamploop"))
    assert strategy_logged in logged


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("root_keywords", "follower_keywords", "named"),
    [
        ({"strategy": "all_reduce"}, {"strategy": "reduce_to_root"}, "strategy"),
        ({"accumulate_gradient_over_n_batches": 2}, {"accumulate_gradient_over_n_batches": 3}, "accumulate"),
    ],
    ids=["strategy", "accumulate_gradient_over_n_batches"],
)
def test_drive_follow_ranks_that_disagree_fail_at_start(
    root_keywords: dict[str, Any], follower_keywords: dict[str, Any], named: str
) -> None:
    """docs/distributed.md: "Every rank must ask for the same strategy; a mismatch fails on
    every rank with DistributedError at start." drive_distributed_training's docstring: "the
    settings every rank holds (TrainingSettings.EVERY_RANK) must equal the followers'";
    "DistributedError: the tensor channel failed or the ranks disagree."
    """
    train = make_per_rank(3, [[[4, 4]], [[4, 4]]])
    calls = Recorder(train)
    models = {0: fresh_model(initial_state(), seed=0), 1: fresh_model(None, seed=11)}
    before = {rank: weights(model.module) for rank, model in models.items()}

    async def root(control: Any) -> Any:
        return await drive_distributed_training(
            nranks=2,
            device="cpu",
            control=control,
            model=models[0],
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
            train_batches=calls,
            validation_batches=None,
            max_epochs=1,
            **root_keywords,
        )

    async def follower(rank: int, control: Any) -> None:
        await follow_distributed_training(
            rank=rank,
            nranks=2,
            device="cpu",
            control=control,
            model=models[rank],
            train_batches=calls,
            validation_batches=None,
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
            **follower_keywords,
        )

    started = time.monotonic()
    results = anyio.run(run_local_ranks, 2, root, follower)
    assert time.monotonic() - started < 20
    for rank in (0, 1):
        error = unwrap(results[rank])
        assert isinstance(error, DistributedError), (rank, repr(error))
        assert named in str(error), (rank, str(error))
    assert calls.calls == []  # no training pass began
    assert_bitwise(weights(models[0].module), before[0])


@pytest.mark.timeout(60)
def test_drive_with_nranks_other_than_the_control_channel_fails_at_start(tmp_path: Path) -> None:
    """docs/concepts/control-channels.md: "The handshake checks ... that every rank was started
    with the same world size ..., so a mismatch fails at start with a message naming it rather
    than hanging in the first collective." drive_distributed_training: "nranks: the number of
    ranks, this one included"; "ConfigurationError: bad arguments".

    Run in a process of its own (the ranks' threads cannot be cancelled): the run is given 8 s
    from its start; the process 45 s, its imports included (a loaded machine once took more
    than 8 s for those alone).
    """
    out = tmp_path / "results.pt"
    process = subprocess.Popen(
        [sys.executable, str(WORKER), "local-nranks", "3", "2", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        process.communicate(timeout=45)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail("drive(nranks=3) over a 2-rank channel still ran after 45 s")
    results = load_record(out)
    assert results[0]["took_s"] < 8, results[0]
    assert results[0]["error_type"] == "ConfigurationError", results[0]
    assert "nranks" in results[0]["message"], results[0]
    assert "LamploopError" in results[1]["error_mro"], results.get(1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("rank", "nranks"),
    [(0, 2), (2, 2), (-1, 2), (1, 1)],
    ids=["rank_0_is_the_root", "rank_equal_to_nranks", "negative_rank", "nranks_1_has_no_follower"],
)
def test_follow_refuses_a_rank_out_of_range(rank: int, nranks: int) -> None:
    """follow_distributed_training: "rank: this rank, 1 .. nranks - 1."; "ConfigurationError:
    bad arguments"; lamploop.errors: "Each message names the offending value and where it came
    from."
    """
    calls = Recorder(make_per_rank(3, [[[4]], [[4]]]))
    model = fresh_model(None, seed=1)

    async def main() -> BaseException | None:
        root, followers = local_control(2, join_timeout=5.0)
        try:
            with anyio.fail_after(10):
                async with root, followers[0] as control:
                    await follow_distributed_training(
                        rank=rank,
                        nranks=nranks,
                        device="cpu",
                        control=control,
                        model=model,
                        train_batches=calls,
                        validation_batches=None,
                    )
        except Exception as error:
            return error
        return None

    error = unwrap(anyio.run(main))
    assert isinstance(error, ConfigurationError), repr(error)
    assert "rank" in str(error)
    assert calls.calls == []


# ----------------------------------------------------------------------------------------
# bad arguments of drive_distributed_training (alone: nranks=1, control=None)
# ----------------------------------------------------------------------------------------


def _drive_arguments(calls: Recorder, model: lamploop.SupervisedModel) -> dict[str, Any]:
    return {
        "nranks": 1,
        "device": "cpu",
        "control": None,
        "model": model,
        "optimizer_factory": lambda params: torch.optim.SGD(params, lr=LR),
        "train_batches": calls,
        "validation_batches": None,
        "max_epochs": 2,
    }


BAD_DRIVE_ARGUMENTS: list[tuple[str, dict[str, Any], str]] = [
    ("nranks_0", {"nranks": 0}, "nranks"),
    ("nranks_str", {"nranks": "1"}, "nranks"),
    ("nranks_2_without_control", {"nranks": 2}, "control"),
    ("max_epochs_str", {"max_epochs": "2"}, "max_epochs"),
    ("max_epochs_negative", {"max_epochs": -1}, "max_epochs"),
    ("accumulate_0", {"accumulate_gradient_over_n_batches": 0}, "accumulate_gradient_over_n_batches"),
    ("accumulate_float", {"accumulate_gradient_over_n_batches": 2.0}, "accumulate_gradient_over_n_batches"),
    ("validation_frequency_0", {"validation_frequency": 0}, "validation_frequency"),
    ("smoothing_str", {"validation_loss_exponential_smoothing_factor": "0.5"}, "smoothing"),
    ("optimizer_factory_not_callable", {"optimizer_factory": "sgd"}, "optimizer_factory"),
    ("train_batches_a_list", {"train_batches": [(torch.zeros(1, 3), torch.zeros(1, 1))]}, "train_batches"),
    ("validation_batches_not_callable", {"validation_batches": 3}, "validation_batches"),
    ("model_a_bare_module", {"model": torch.nn.Linear(3, 1)}, "model"),
    ("checkpoint_state_not_callable", {"checkpoint_state": 3}, "checkpoint_state"),
    ("init_state_a_loop_state", {"init_state": lamploop.LoopState()}, "init_state"),
    ("unknown_keyword", {"no_such_setting": 1}, "no_such_setting"),
    ("unknown_strategy", {"strategy": "no_such_strategy"}, "no_such_strategy"),
    (
        "settings_and_keyword",
        {"settings": lamploop.TrainingSettings(), "strategy": "all_reduce"},
        "strategy",
    ),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("changes", "named"),
    [(changes, named) for _, changes, named in BAD_DRIVE_ARGUMENTS],
    ids=[name for name, _, _ in BAD_DRIVE_ARGUMENTS],
)
def test_drive_bad_arguments_raise_configuration_error_before_training(
    changes: dict[str, Any], named: str
) -> None:
    """drive_distributed_training: "ConfigurationError: bad arguments; an unknown keyword, or a
    setting given both as a keyword and in settings="; "control: ... None only when nranks ==
    1"; lamploop.errors: "Each message names the offending value and where it came from." and
    "Errors about bad arguments also derive from ValueError".
    """
    calls = Recorder(make_per_rank(3, [[[4], [4]]]))
    model = fresh_model(initial_state(), seed=0)
    before = weights(model.module)
    arguments = _drive_arguments(calls, model) | changes

    async def main() -> Any:
        with anyio.fail_after(15):
            return await drive_distributed_training(**arguments)

    with pytest.raises(ConfigurationError) as caught:
        anyio.run(main)
    assert isinstance(caught.value, ValueError)
    assert named in str(caught.value), str(caught.value)
    assert calls.calls == []  # before training starts
    assert_bitwise(weights(model.module), before)


# ----------------------------------------------------------------------------------------
# local_data_parallel_training_loop: one process, one replica per (CPU) device
# ----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_local_data_parallel_r_ranks_k_batches_equal_one_rank_big_batch() -> None:
    """DESIGN.md 3: "R ranks x k accumulated batches of size b gives the same parameters (to
    float tolerance) as 1 rank x 1 batch of size R*k*b over the same examples. This
    equivalence is the core test." docs/distributed.md: "(tested to 1e-6 in float64)".
    tensor_batches: "batch i goes to rank i % nranks".
    """
    nranks, k, b, epochs = 2, 3, 2, 2
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(48, 3, generator=generator, dtype=F64)
    target = torch.cos(features[:, :1]) + 0.1 * torch.randn(48, 1, generator=generator, dtype=F64)
    init = initial_state(seed=3)
    stream = lamploop.tensor_batches(features, target, batch_size=b, shuffle=False)
    replicas = [(fresh_model(init, seed=3), stream, None)] + [
        (fresh_model(None, seed=20 + r), stream, None) for r in range(1, nranks)
    ]

    state = anyio.run(
        lambda: local_data_parallel_training_loop(
            replicas,
            lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
            epochs,
            accumulate_gradient_over_n_batches=k,
        )
    )

    big = worker.build_module(HIDDEN)
    big.load_state_dict(init)
    optimizer = torch.optim.SGD(big.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for start in range(0, 48, nranks * k * b):
            x, y = features[start : start + nranks * k * b], target[start : start + nranks * k * b]
            optimizer.zero_grad()
            loss_sum = ((big(x) - y) ** 2).sum()
            (loss_sum / y.shape[0]).backward()
            optimizer.step()
            total += float(loss_sum.detach())
        losses.append(total / 48)
    assert state.epoch == epochs
    for entry, expected in zip(state.learning_curve, losses, strict=True):
        assert entry.training_loss == pytest.approx(expected, rel=1e-9)
    trained = weights(replicas[0][0].module)
    for name, value in weights(big).items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-6)
        torch.testing.assert_close(trained[name], value, rtol=1e-9, atol=1e-10)
    for replica in replicas[1:]:
        assert_bitwise(weights(replica[0].module), trained)


def _linear_selection_data() -> tuple[PerRankEpochs, PerRankEpochs]:
    # Training pulls w from -1 towards 1; validation prefers w = 0.3: the validation loss falls,
    # then rises again; smoothing moves its minimum to a later epoch than the raw one.
    generator = torch.Generator().manual_seed(7)
    train: PerRankEpochs = [[], []]
    valid: PerRankEpochs = [[], []]
    for rank, sizes in enumerate(([4, 4, 4], [3, 3])):
        for _epoch in range(8):
            batches = []
            for size in sizes:
                x = torch.randn(size, 1, generator=generator, dtype=F64)
                batches.append((x, 1.0 * x))
            train[rank].append(batches)
            x = torch.linspace(-1, 1, 5 + rank, dtype=F64).unsqueeze(1)
            valid[rank].append([(x, 0.3 * x)])
    return train, valid


def _linear_module() -> torch.nn.Module:
    module = torch.nn.Linear(1, 1, bias=False).to(F64)
    with torch.no_grad():
        module.weight.fill_(-1.0)
    return module


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("validation_frequency", "eligible", "smoothing"),
    [
        (1, None, 0.3),
        (1, (0, 1, 2, 6, 7), 0.3),
        (2, None, 0.5),
    ],
    ids=["every_epoch_all_eligible", "every_epoch_some_eligible", "every_other_epoch_all_eligible"],
)
def test_local_data_parallel_best_model_by_smoothed_validation_loss(
    validation_frequency: int, eligible: tuple[int, ...] | None, smoothing: float
) -> None:
    """DESIGN.md 3: "Smoothing: smoothed = raw * a + previous_smoothed * (1 - a), previous
    defaulting to raw. The last smoothed validation loss carries over epochs in which
    validation does not run"; "Model selection: only epochs listed in
    return_min_validation_loss_model ... may become the best; the best model is snapshotted
    when the smoothed loss improves strictly." DESIGN.md 2: "When training ends the best model
    (if any epoch was eligible) is copied into the model." docs/distributed.md: "The trained
    model ends in the *first* model."
    """
    train, valid = _linear_selection_data()
    epochs = 8
    eligible_epochs = lamploop.ALL_EPOCHS if eligible is None else eligible
    reference = Reference(
        init=_linear_module().state_dict(),
        train=train,
        valid=valid,
        k=1,
        max_epochs=epochs,
        smoothing=smoothing,
        validation_frequency=validation_frequency,
        eligible=lambda epoch: eligible is None or epoch in eligible,
        module_factory=_linear_module,
        lr=0.05,
        momentum=0.0,
    )
    raws = [(e, v[1]) for e, v in enumerate(reference.validation) if v is not None]
    raw_argmin = min(raws, key=lambda item: item[1])[0]
    assert reference.best_epoch is not None
    if eligible is None and validation_frequency == 1:
        assert raw_argmin != reference.best_epoch  # the data makes smoothing matter
    if eligible is not None:
        assert raw_argmin not in eligible or reference.best_epoch != raw_argmin

    replicas = []
    for rank in range(2):
        module = _linear_module()
        if rank:
            with torch.no_grad():
                module.weight.fill_(5.0)  # replaced by the first replica's values at start
        replicas.append(
            (
                lamploop.SupervisedModel(module, loss=worker.squared_error),
                worker.listed_batches(train),
                worker.listed_batches(valid),
            )
        )
    checkpoints: list[lamploop.LoopStateWithModelAndOptimizerData] = []

    async def checkpoint_state(data: lamploop.LoopStateWithModelAndOptimizerData, _schedule: Any) -> None:
        checkpoints.append(copy.deepcopy(data))

    state = anyio.run(
        lambda: local_data_parallel_training_loop(
            replicas,
            lambda params: torch.optim.SGD(params, lr=0.05),
            epochs,
            checkpoint_state=checkpoint_state,
            validation_frequency=validation_frequency,
            return_min_validation_loss_model=eligible_epochs,
            validation_loss_exponential_smoothing_factor=smoothing,
        )
    )

    assert_loop_state_matches(state, reference)
    assert reference.best_weights is not None
    assert_close(weights(replicas[0][0].module), reference.best_weights)
    # the checkpoints carry the best model so far, and the live model
    for epoch, data in enumerate(checkpoints):
        assert data.loop_state.epoch == epoch + 1
        assert_close(dict(data.model), reference.after_epoch[epoch])
        best_so_far = [
            e
            for e in range(epoch + 1)
            if reference.validation[e] is not None and (eligible is None or e in eligible)
        ]
        if best_so_far:
            best = min(best_so_far, key=lambda e: (reference.validation[e][0], e))  # type: ignore[index]
            assert data.loop_state.min_validation_epoch == best
            assert_close(dict(data.best_model), reference.after_epoch[best])
        else:
            assert data.loop_state.min_validation_epoch is None
    assert len(checkpoints) == epochs


@pytest.mark.timeout(60)
def test_local_data_parallel_resume_from_checkpoint_state_equals_uninterrupted_run() -> None:
    """DESIGN.md 2: checkpoint_state is "called after every epoch with LoopState(epoch + 1,
    ...), so that resuming from it continues at the next epoch." docs/distributed.md: "followers
    always start from the root's state, also on resume." local_data_parallel_training_loop: "The
    other arguments are those of drive_distributed_training".
    """
    init = initial_state(seed=4)
    train = make_per_rank(8, [[[4, 4, 3]] * 4, [[3, 3]] * 4])
    valid = make_per_rank(9, [[[4]] * 4, [[4]] * 4])
    schedule = lamploop.from_epoch_count(lambda epoch: 1.0 / (1 + epoch))

    def replicas(seed: int, with_init: bool) -> list[Any]:
        return [
            (
                fresh_model(init if with_init and r == 0 else None, seed=seed + r),
                worker.listed_batches(train),
                worker.listed_batches(valid),
            )
            for r in range(2)
        ]

    checkpoints: list[tuple[lamploop.LoopStateWithModelAndOptimizerData, Any]] = []

    async def checkpoint_state(
        data: lamploop.LoopStateWithModelAndOptimizerData, schedule_state: Any
    ) -> None:
        checkpoints.append((copy.deepcopy(data), copy.deepcopy(schedule_state)))

    def optimizer(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)

    whole = replicas(30, with_init=True)
    state = anyio.run(
        lambda: local_data_parallel_training_loop(
            whole,
            optimizer,
            4,
            checkpoint_state=checkpoint_state,
            learning_rate_schedule=schedule,
            return_min_validation_loss_model=lamploop.ALL_EPOCHS,
        )
    )
    data, schedule_state = checkpoints[1]
    assert data.loop_state.epoch == 2
    resumed = replicas(40, with_init=False)  # no replica starts from the checkpoint's values
    resumed_state = anyio.run(
        lambda: local_data_parallel_training_loop(
            resumed,
            optimizer,
            4,
            learning_rate_schedule=schedule,
            init_state=data,
            learning_rate_schedule_init_state=schedule_state,
            return_min_validation_loss_model=lamploop.ALL_EPOCHS,
        )
    )
    assert resumed_state == state
    assert_bitwise(weights(resumed[0][0].module), weights(whole[0][0].module))


@pytest.mark.timeout(60)
def test_local_data_parallel_empty_batch_is_a_batch_error_naming_the_rank() -> None:
    """DESIGN.md 3: "A stream that yields an empty batch is an error with a clear message."
    one_epoch: "BatchError: an empty or malformed batch (says which epoch, batch and rank)".
    local_data_parallel_training_loop: "LamploopError: the first error of any replica (the
    others are ended within seconds)."
    """
    good = make_batches(torch.Generator().manual_seed(1), [4, 4, 4])
    empty = (torch.zeros(0, 3, dtype=F64), torch.zeros(0, 1, dtype=F64))
    per_rank: PerRankEpochs = [[good], [[good[0], empty, good[1]]]]
    replicas = [
        (fresh_model(initial_state(), seed=0), worker.listed_batches(per_rank), None),
        (fresh_model(None, seed=1), worker.listed_batches(per_rank), None),
    ]

    async def main() -> Any:
        with anyio.fail_after(30):
            return await local_data_parallel_training_loop(replicas, lambda p: torch.optim.SGD(p, lr=LR), 1)

    started = time.monotonic()
    with pytest.raises(BatchError) as caught:
        anyio.run(main)
    assert time.monotonic() - started < 20
    message = str(caught.value)
    assert "rank 1" in message, message
    assert "empty" in message, message


def _wider_module() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)).to(F64)


def _float32_module() -> torch.nn.Module:
    return worker.build_module(HIDDEN, dtype=torch.float32)


def _renamed_module() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, HIDDEN), torch.nn.Linear(HIDDEN, 1)).to(F64)


def _run_mismatched(other: Callable[[], torch.nn.Module]) -> tuple[BaseException, Recorder, float]:
    calls = Recorder([[[]], [[]]])
    replicas = [
        (fresh_model(initial_state(), seed=0), calls, None),
        (lamploop.SupervisedModel(other(), loss=worker.squared_error), calls, None),
    ]

    async def main() -> Any:
        with anyio.fail_after(30):
            return await local_data_parallel_training_loop(replicas, lambda p: torch.optim.SGD(p, lr=LR), 1)

    started = time.monotonic()
    with pytest.raises(LamploopError) as caught:
        anyio.run(main)
    return caught.value, calls, time.monotonic() - started


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "other", [_wider_module, _float32_module, _renamed_module], ids=["shape", "dtype", "names"]
)
def test_local_data_parallel_mismatched_models_fail_before_training(
    other: Callable[[], torch.nn.Module],
) -> None:
    """docs/distributed.md start-up: "the ranks check they agree on the strategy and the model,
    then the root's parameters and buffers are broadcast"; drive_distributed_training:
    "DistributedError: the tensor channel failed or the ranks disagree."
    """
    error, calls, elapsed = _run_mismatched(other)
    assert isinstance(error, DistributedError), repr(error)
    assert elapsed < 20
    assert calls.calls == []  # before training starts


@pytest.mark.timeout(60)
def test_local_data_parallel_mismatched_model_error_names_rank_and_tensor() -> None:
    """lamploop.errors: "Each message names the offending value and where it came from."
    docs/control-channel.md (the same check over TCP): "rank 1's model differs: tensor
    'fc.weight': root shape (10, 4), rank 1 shape (10, 5)"; docs/concepts/control-channels.md: "a
    mismatch fails at start with a message naming it".
    """
    error, _calls, _elapsed = _run_mismatched(_wider_module)
    assert isinstance(error, DistributedError), repr(error)
    assert "rank 1" in str(error), str(error)
    assert "0.weight" in str(error), str(error)


def _triple(seed: int) -> tuple[lamploop.SupervisedModel, Any, Any]:
    return (fresh_model(None, seed=seed), worker.listed_batches([[[]]]), None)


def _no_replicas(tmp: Path) -> tuple[list[Any], dict[str, Any]]:
    return [], {}


def _shared_module(tmp: Path) -> tuple[list[Any], dict[str, Any]]:
    first = _triple(1)
    return [first, (lamploop.SupervisedModel(first[0].module, loss=worker.squared_error), first[1], None)], {}


def _pair_not_triple(tmp: Path) -> tuple[list[Any], dict[str, Any]]:
    return [_triple(1)[:2], _triple(2)], {}


def _bare_module(tmp: Path) -> tuple[list[Any], dict[str, Any]]:
    return [(torch.nn.Linear(3, 1), worker.listed_batches([[[]]]), None), _triple(2)], {}


def _with_keywords(**keywords: Any) -> Callable[[Path], tuple[list[Any], dict[str, Any]]]:
    return lambda tmp: ([_triple(1), _triple(2)], keywords)


def _with_profile(tmp: Path) -> tuple[list[Any], dict[str, Any]]:
    profile = lamploop.Profile(out_dir=tmp / "traces")
    return [_triple(1), _triple(2)], {"settings": lamploop.TrainingSettings(max_epochs=1, profile=profile)}


BAD_LOCAL_ARGUMENTS: list[tuple[str, Callable[[Path], tuple[list[Any], dict[str, Any]]], str]] = [
    ("no_replicas", _no_replicas, "models_with_data_streams"),
    ("shared_module", _shared_module, "module"),
    ("pair_not_triple", _pair_not_triple, "triple"),
    ("bare_module", _bare_module, "SupervisedModel"),
    ("unknown_keyword", _with_keywords(no_such_setting=1), "no_such_setting"),
    (
        "settings_and_keyword",
        _with_keywords(settings=lamploop.TrainingSettings(), strategy="all_reduce"),
        "strategy",
    ),
    ("profile", _with_profile, "fit(world_size"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("make", "named"),
    [(make, named) for _, make, named in BAD_LOCAL_ARGUMENTS],
    ids=[name for name, _, _ in BAD_LOCAL_ARGUMENTS],
)
def test_local_data_parallel_bad_arguments(
    make: Callable[[Path], tuple[list[Any], dict[str, Any]]], named: str, tmp_path: Path
) -> None:
    """local_data_parallel_training_loop: "ConfigurationError: no replicas, or replicas on one
    CUDA device; a replica that is not a (model, train_batches, validation_batches) triple of a
    SupervisedModel and batch factories, or two replicas sharing one module; an unknown keyword,
    or a setting given both as a keyword and in settings=; a profile". lamploop.errors: "Each
    message names the offending value".
    """
    replicas, keywords = make(tmp_path)

    async def main() -> Any:
        with anyio.fail_after(15):
            return await local_data_parallel_training_loop(
                replicas, lambda p: torch.optim.SGD(p, lr=LR), 1, **keywords
            )

    with pytest.raises(ConfigurationError) as caught:
        anyio.run(main)
    assert named.lower() in str(caught.value).lower(), str(caught.value)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("optimizer_factory", "max_epochs", "named"),
    [
        ("sgd", 1, "optimizer_factory"),
        (None, 1, "optimizer_factory"),
        ("ok", "1", "max_epochs"),
        ("ok", -2, "max_epochs"),
    ],
    ids=["optimizer_factory_str", "optimizer_factory_none", "max_epochs_str", "max_epochs_negative"],
)
def test_local_data_parallel_bad_optimizer_factory_or_max_epochs(
    optimizer_factory: Any, max_epochs: Any, named: str
) -> None:
    """local_data_parallel_training_loop: "The other arguments are those of
    drive_distributed_training"; drive_distributed_training: "ConfigurationError: bad
    arguments"; lamploop.errors: "Each message names the offending value and where it came from."
    """
    calls = Recorder([[[(torch.zeros(2, 3, dtype=F64), torch.zeros(2, 1, dtype=F64))]]] * 2)
    replicas = [(fresh_model(None, seed=1), calls, None), (fresh_model(None, seed=2), calls, None)]
    factory = (lambda p: torch.optim.SGD(p, lr=LR)) if optimizer_factory == "ok" else optimizer_factory

    async def main() -> Any:
        with anyio.fail_after(15):
            return await local_data_parallel_training_loop(replicas, factory, max_epochs)

    with pytest.raises(ConfigurationError, match=named):
        anyio.run(main)
    assert calls.calls == []


# ----------------------------------------------------------------------------------------
# drive / follow over TCP, one process per follower
# ----------------------------------------------------------------------------------------


def _start_follower(spec_path: Path, out: Path, rank: int, port: int, token: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), "follow", str(spec_path), str(out), str(rank), str(port), token],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _finish(process: subprocess.Popen[bytes], timeout: float) -> str:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise AssertionError(
            f"worker still running after {timeout} s:\n{output.decode(errors='replace')}"
        ) from None
    return output.decode(errors="replace")


@pytest.mark.timeout(90)
def test_drive_follow_over_tcp_in_separate_processes_match_reference(tmp_path: Path) -> None:
    """docs/distributed.md "Drive and follow by hand": "One process per rank, each with its end
    of the TCP control channel"; "followers always start from the root's state"; DESIGN.md 3:
    "a rank whose stream is exhausted contributes zero examples until every rank is exhausted;
    no example is dropped and nothing hangs." (lamp's reduce_to_root: "followers need ...
    nothing but the model".)
    """
    nranks, k = 3, 2
    init = initial_state(seed=0)
    train = make_per_rank(1, UNEVEN_TRAIN_SIZES)
    valid = make_per_rank(2, UNEVEN_VALID_SIZES)
    reference = Reference(
        init=init, train=train, valid=valid, k=k, max_epochs=6, factor=factor_of_epoch, smoothing=0.5
    )
    spec_path = tmp_path / "spec.pt"
    save_record(
        {
            "nranks": nranks,
            "hidden": HIDDEN,
            "train": train,
            "valid": valid,
            "follower_optimizer": None,
            "follower_keywords": {"accumulate_gradient_over_n_batches": k},
        },
        spec_path,
    )
    token = "acceptance-drivers-token"
    model = fresh_model(init, seed=0)
    outs = {rank: tmp_path / f"rank{rank}.pt" for rank in (1, 2)}
    processes: dict[int, subprocess.Popen[bytes]] = {}

    async def root() -> lamploop.LoopState:
        with anyio.fail_after(60):
            async with TcpControlRoot(
                port=0,
                nranks=nranks,
                token=token,
                model_spec=lamploop.model_spec(model.module),
                join_timeout=30,
            ) as control:
                _host, port = control.address
                for rank in (1, 2):
                    processes[rank] = _start_follower(spec_path, outs[rank], rank, port, token)
                return await drive_distributed_training(
                    nranks=nranks,
                    device="cpu",
                    control=control,
                    model=model,
                    optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
                    train_batches=worker.listed_batches(train),
                    validation_batches=worker.listed_batches(valid),
                    max_epochs=6,
                    learning_rate_schedule=lamploop.from_epoch_count(factor_of_epoch),
                    accumulate_gradient_over_n_batches=k,
                    validation_loss_exponential_smoothing_factor=0.5,
                )

    try:
        state = anyio.run(root)
    finally:
        logs = {rank: _finish(process, 30) for rank, process in processes.items()}
    for rank, process in processes.items():
        assert process.returncode == 0, logs[rank]
    assert_loop_state_matches(state, reference)
    final = weights(model.module)
    assert_close(final, reference.final)
    for rank in (1, 2):
        record = load_record(outs[rank])
        assert "state_dict" in record, record
        assert_bitwise(record["state_dict"], final)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("follower_spec", "follower_says", "root_says"),
    [
        (
            {"hidden": HIDDEN + 1},
            r"rank 1 refused by root: rank 1's model differs: "
            r"tensor '0\.weight': root shape \(4, 3\), rank 1 shape \(5, 3\)",
            r"refused rank 1 \(.*\): rank 1's model differs",
        ),
        (
            {"follower_nranks": 3},
            r"rank 1 refused by root: rank 1 was started with nranks=3, the root with nranks=2",
            r"refused rank 1 \(.*\): rank 1 was started with nranks=3, the root with nranks=2",
        ),
    ],
    ids=["model_shape", "world_size"],
)
def test_tcp_handshake_refuses_a_follower_that_does_not_fit(
    tmp_path: Path, follower_spec: dict[str, Any], follower_says: str, root_says: str
) -> None:
    """docs/control-channel.md: "rank 1 was started with nranks=3, the root with nranks=2";
    "rank 1's model differs: tensor 'fc.weight': root shape (10, 4), rank 1 shape (10, 5)";
    "The follower raises HandshakeError("rank 1 refused by root: <reason>"), and since the job
    cannot succeed the root fails too, with HandshakeError("refused rank 1 (host:port):
    <reason>")." docs/concepts/control-channels.md: "a mismatch fails at start with a message
    naming it rather than hanging in the first collective."
    """
    spec_path = tmp_path / "spec.pt"
    calls = Recorder([[[(torch.zeros(2, 3, dtype=F64), torch.zeros(2, 1, dtype=F64))]]] * 3)
    save_record(
        {"nranks": 2, "hidden": HIDDEN, "train": calls.per_rank, "valid": None, "follower_optimizer": None}
        | follower_spec,
        spec_path,
    )
    token = "acceptance-drivers-token"
    model = fresh_model(initial_state(), seed=0)
    out = tmp_path / "rank1.pt"
    processes: list[subprocess.Popen[bytes]] = []

    async def root() -> None:
        with anyio.fail_after(40):
            async with TcpControlRoot(
                port=0, nranks=2, token=token, model_spec=lamploop.model_spec(model.module), join_timeout=30
            ) as control:
                processes.append(_start_follower(spec_path, out, 1, control.address[1], token))
                await drive_distributed_training(
                    nranks=2,
                    device="cpu",
                    control=control,
                    model=model,
                    optimizer_factory=lambda params: torch.optim.SGD(params, lr=LR),
                    train_batches=calls,
                    validation_batches=None,
                    max_epochs=1,
                )

    started = time.monotonic()
    try:
        with pytest.raises(Exception) as caught:  # noqa: PT011 - the leaf is checked below
            anyio.run(root)
    finally:
        logs = [_finish(process, 30) for process in processes]
    assert time.monotonic() - started < 25
    error = unwrap(caught.value)
    assert isinstance(error, HandshakeError), repr(error)
    assert_matches(root_says, str(error))
    record = load_record(out)
    assert record.get("error_type") == "HandshakeError", (record, logs)
    assert_matches(follower_says, record["message"])
    assert calls.calls == []


def assert_matches(pattern: str, text: str) -> None:
    assert re.search(pattern, text), f"{pattern!r} not in {text!r}"


# ----------------------------------------------------------------------------------------
# fit(world_size=n)
# ----------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_fit_world_size_2_launches_rank_1_and_matches_reference(tmp_path: Path) -> None:
    """docs/distributed.md: "fit(..., world_size=2) started without a launcher becomes rank 0,
    opens a TCP control channel on 127.0.0.1 with a fresh random token and runs *the same
    command line* again for ranks 1..n-1 (LAMPLOOP_RANK, LAMPLOOP_WORLD_SIZE, LAMPLOOP_CONTROL,
    LAMPLOOP_TOKEN set)." fit: "Only rank 0 checkpoints, reports and returns the state."; "the
    final state (None on followers)"; "on_epoch: called with the LoopState after every epoch
    (rank 0)". tensor_batches: "batch i goes to rank i % nranks".
    """
    generator = torch.Generator().manual_seed(11)
    features = torch.randn(40, 3, generator=generator, dtype=F64)
    target = torch.sin(features[:, :1]) + 0.1 * torch.randn(40, 1, generator=generator, dtype=F64)
    init = initial_state(seed=6)
    batch_size, k, epochs = 3, 2, 2
    spec_path = tmp_path / "spec.pt"
    save_record(
        {
            "hidden": HIDDEN,
            "init": init,
            "features": features,
            "target": target,
            "batch_size": batch_size,
            "k": k,
            "max_epochs": epochs,
            "optimizer": (LR, MOMENTUM),
        },
        spec_path,
    )
    out = tmp_path / "fit"
    process = subprocess.Popen(
        [sys.executable, str(WORKER), "fit", str(spec_path), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    log = _finish(process, 75)
    assert process.returncode == 0, log

    # the reference: global batches of 3 go to ranks 0, 1, 0, 1...; step j takes two of each rank's
    n_batches = math.ceil(40 / batch_size)
    global_batches = [
        (features[i * batch_size : (i + 1) * batch_size], target[i * batch_size : (i + 1) * batch_size])
        for i in range(n_batches)
    ]
    per_rank: PerRankEpochs = [[global_batches[r::2]] * epochs for r in range(2)]
    reference = Reference(init=init, train=per_rank, valid=None, k=k, max_epochs=epochs)

    root = load_record(f"{out}.rank0")
    follower = load_record(f"{out}.rank1")
    assert follower["world_size_env"] == "2"
    assert follower["returned"] is None
    assert follower["on_epoch"] == []
    state = converter.structure(root["returned"], lamploop.LoopState)
    on_epoch = [converter.structure(seen, lamploop.LoopState) for seen in root["on_epoch"]]
    assert_loop_state_matches(state, reference)
    assert [seen.epoch for seen in on_epoch] == [1, 2]
    assert on_epoch[-1] == state
    assert_close(root["state_dict"], reference.final)
    assert_bitwise(follower["state_dict"], root["state_dict"])


def _fit_arguments(tmp_path: Path, marker: Path) -> dict[str, Any]:
    features = torch.randn(8, 3, dtype=F64)
    return {
        "model": fresh_model(None, seed=1),
        "optimizer_factory": lambda params: torch.optim.SGD(params, lr=LR),
        "train_batches": lamploop.tensor_batches(features, features[:, :1], batch_size=2),
        "max_epochs": 1,
        "device": "cpu",
        "reporters": [],
        # if anything were launched, it would only leave this marker behind
        "launch_command": [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"],
    }


BAD_FIT_ARGUMENTS: list[tuple[str, Callable[[], dict[str, Any]], str]] = [
    ("world_size_0", lambda: {"world_size": 0}, "world_size"),
    ("world_size_negative", lambda: {"world_size": -2}, "world_size"),
    ("world_size_str", lambda: {"world_size": "2"}, "world_size"),
    ("world_size_float", lambda: {"world_size": 2.0}, "world_size"),
    (
        "lr_scheduler_with_schedule",
        lambda: {
            "world_size": 2,
            "lr_scheduler": lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1),
            "learning_rate_schedule": lamploop.step_after(1, 0.5),
        },
        "lr_scheduler",
    ),
    (
        "optimizer_factory_not_callable",
        lambda: {"world_size": 2, "optimizer_factory": "sgd"},
        "optimizer_factory",
    ),
    ("unknown_strategy", lambda: {"world_size": 2, "strategy": "no_such_strategy"}, "no_such_strategy"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("changes", "named"),
    [(changes, named) for _, changes, named in BAD_FIT_ARGUMENTS],
    ids=[name for name, _, _ in BAD_FIT_ARGUMENTS],
)
def test_fit_bad_arguments_fail_before_any_rank_is_launched(
    tmp_path: Path, changes: Callable[[], dict[str, Any]], named: str
) -> None:
    """fit: "lr_scheduler ... given with learning_rate_schedule or step_schedule it is a
    ConfigurationError before anything starts"; "world_size: the number of ranks";
    lamploop.errors: "Each message names the offending value and where it came from."
    """
    marker = tmp_path / "launched"
    arguments = _fit_arguments(tmp_path, marker) | changes()
    started = time.monotonic()
    with pytest.raises(ConfigurationError) as caught:
        lamploop.fit(**arguments)
    assert time.monotonic() - started < 15
    assert named in str(caught.value), str(caught.value)
    time.sleep(0.2)
    assert not marker.exists()  # no rank was launched


@pytest.mark.timeout(60)
def test_fit_world_size_2_whose_launched_rank_dies_fails_fast(tmp_path: Path) -> None:
    """docs/distributed.md: "It supervises them: a rank that fails fails the run, and leaving
    kills them." DESIGN.md 8: "Every wait on the outside world (a peer, a producer, a buffer, a
    socket, a child process) is bounded or ends when that side is gone for good"; DESIGN.md 5:
    "naming the rank that failed".
    """
    arguments = _fit_arguments(tmp_path, tmp_path / "unused") | {
        "world_size": 2,
        "launch_command": [sys.executable, "-c", "import sys; sys.exit(3)"],
    }
    started = time.monotonic()
    with pytest.raises(LamploopError) as caught:
        lamploop.fit(**arguments)
    elapsed = time.monotonic() - started
    assert elapsed < 20, f"took {elapsed:.1f} s (the join timeout is 60 s)"
    assert_matches(r"rank 1\b", str(caught.value))
