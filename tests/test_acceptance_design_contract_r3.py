"""Acceptance tests of DESIGN.md sections 2-8, third round: what the first two rounds
(tests/test_acceptance_design_contract.py, tests/test_acceptance_design_contract_r2.py) left.

Written from DESIGN.md, docs/contract-changes.md and the public docstrings, without reading the
package's source.  Every expected number comes from code written here apart from lamploop: a
plain float64 PyTorch loop, or torch's own DistributedDataParallel over Gloo.  What this round
adds: the in-process and the TCP control channels give the same bits; a real second process
trained with the replicated optimizer equals DDP; LoopState's fields after runs that stop early,
select nothing or never validate; resuming a data-parallel run from checkpoint files is bitwise;
the schedules' end of training; a dead root ends its follower; every join and connect is bounded.
Real parts only: processes, sockets on 127.0.0.1, files under tmp_path; every wait bounded.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch
from safetensors.torch import load_file
from support import WORKERS, free_port, wait_until

import lamploop
from lamploop.control import TcpControlFollower, TcpControlRoot
from lamploop.errors import LamploopError, PeerLostError, TrainingInterrupted
from lamploop.loop.stop_request import StopRequest
from lamploop.modelspec import model_spec

WORKER = WORKERS / "design_r3_worker.py"
BOUND_S = 45.0  # generous: two loaded cores
SEED = 3_2026
W0 = [0.5, -0.25, 0.125]
B0 = [0.0625]

Batch = tuple[torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Helpers: data made from a seed (the worker makes the same), a tiny model, references.
# ---------------------------------------------------------------------------------------------


def make_data(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(SEED)
    x = torch.randn(64, 3, generator=generator, dtype=torch.float64).to(dtype)
    y = torch.randn(64, 1, generator=generator, dtype=torch.float64).to(dtype)
    return x, y


X, Y = make_data()


def make_module(dtype: torch.dtype = torch.float64, weight: Sequence[float] = W0, bias: Sequence[float] = B0):
    module = torch.nn.Linear(3, 1, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(torch.tensor([list(weight)], dtype=dtype))
        module.bias.copy_(torch.tensor(list(bias), dtype=dtype))
    return module


def other_module(dtype: torch.dtype = torch.float64) -> torch.nn.Linear:
    """A follower's module with other values than the root's: it must start from the root's."""
    return make_module(dtype, [3.0, 2.0, 1.0], [-1.0])


def squared_error(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
    return ((output - target) ** 2).sum(), int(target.shape[0])


def params(module: torch.nn.Module | dict) -> dict[str, torch.Tensor]:
    items = module.state_dict().items() if isinstance(module, torch.nn.Module) else module.items()
    return {name: value.detach().clone() for name, value in items}


def assert_close(actual: Any, expected: Any, tol: float = 1e-12) -> None:
    actual, expected = params(actual), params(expected)
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=tol, atol=tol, msg=name)


def assert_bitwise(actual: Any, expected: Any) -> None:
    actual, expected = params(actual), params(expected)
    assert actual.keys() == expected.keys()
    for name in expected:
        assert torch.equal(actual[name], expected[name]), (name, actual[name], expected[name])


def sgd(lr: float, momentum: float = 0.0) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda parameters: torch.optim.SGD(parameters, lr=lr, momentum=momentum)


def per_rank_factory(per_rank: Sequence[Sequence[slice]], x: torch.Tensor = X, y: torch.Tensor = Y):
    def make(context: lamploop.BatchContext) -> list[Batch]:
        return [(x[s], y[s]) for s in per_rank[context.rank]]

    return lamploop.iterable_batches(make)


def mean_loss(module: torch.nn.Module, examples: Sequence[slice]) -> float:
    with torch.no_grad():
        total = sum(float(((module(X[s]) - Y[s]) ** 2).sum()) for s in examples)
    return total / sum(len(Y[s]) for s in examples)


@attrs.frozen
class Reference:
    module: torch.nn.Module
    curve: list[tuple[int, float, tuple[float, float] | None]]
    best: dict[str, torch.Tensor] | None
    best_epoch: int | None
    min_loss: float | None
    last_smoothed: float | None
    after_epoch: list[dict[str, torch.Tensor]]


def reference_run(
    steps: Sequence[Sequence[slice]],
    valid: Sequence[slice] | None,
    *,
    factors: Sequence[float],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    a: float = 1.0,
    eligible: Callable[[int], bool] = lambda epoch: True,
    validation_frequency: int = 1,
) -> Reference:
    """DESIGN's loop, written plainly in float64: every group's lr is base * factor of the epoch,
    each step is one optimizer step on the mean gradient of its examples, validation follows
    training in the epochs ``e % validation_frequency == 0``, smoothing and strict selection."""
    module = make_module()
    optimizer = make_optimizer(module.parameters())
    bases = [group["lr"] for group in optimizer.param_groups]
    curve: list = []
    after: list = []
    best = best_epoch = min_loss = smoothed = None
    for epoch, factor in enumerate(factors):
        for group, base in zip(optimizer.param_groups, bases, strict=True):
            group["lr"] = base * factor
        loss_sum, count = 0.0, 0
        for step in steps:
            optimizer.zero_grad()
            total = sum(((module(X[s]) - Y[s]) ** 2).sum() for s in step)
            n = sum(len(Y[s]) for s in step)
            (total / n).backward()
            optimizer.step()
            loss_sum += float(total.detach())
            count += n
        entry = None
        if valid is not None and epoch % validation_frequency == 0:
            raw = mean_loss(module, valid)
            smoothed = raw if smoothed is None else raw * a + smoothed * (1 - a)
            entry = (smoothed, raw)
            if eligible(epoch) and (min_loss is None or smoothed < min_loss):
                min_loss, best_epoch, best = smoothed, epoch, params(module)
        curve.append((epoch, loss_sum / count, entry))
        after.append(params(module))
    return Reference(module, curve, best, best_epoch, min_loss, smoothed, after)


def assert_curve(state: lamploop.LoopState, reference: Reference, rel: float = 1e-12) -> None:
    assert [entry.epoch for entry in state.learning_curve] == [e for e, _, _ in reference.curve]
    for entry, (_, training, validation) in zip(state.learning_curve, reference.curve, strict=True):
        assert entry.training_loss == pytest.approx(training, rel=rel)
        if validation is None:
            assert entry.validation_loss is None
        else:
            assert entry.validation_loss == pytest.approx(validation, rel=rel)


def single(error: BaseException) -> BaseException:
    """The one error inside (nested) exception groups, or the group itself."""
    while len(getattr(error, "exceptions", ())) == 1:
        error = error.exceptions[0]
    return error


class RecordingFollower:
    """A control follower, unchanged, that also notes every command it hands on."""

    def __init__(self, inner: Any, seen: list[tuple[Any, ...]]) -> None:
        self._inner, self.seen = inner, seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def join(self):
        rendezvous, commands = await self._inner.join()
        return rendezvous, RecordedCommands(commands, self.seen)


class RecordedCommands:
    """The follower's command stream, passed through (closing it closes the original)."""

    def __init__(self, inner: Any, seen: list[tuple[Any, ...]]) -> None:
        self._inner, self._iterator, self.seen = inner, inner.__aiter__(), seen

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __aiter__(self) -> RecordedCommands:
        return self

    async def __anext__(self) -> Any:
        command = await self._iterator.__anext__()
        kind = type(command).__name__
        if kind == "Train":
            self.seen.append((kind, command.epoch, command.lr_factor))
        elif kind == "Valid":
            self.seen.append((kind, command.epoch))
        else:
            self.seen.append((kind,))
        return command


# Two ranks, k = 2 accumulated batches of 2 examples each per rank and step, 2 steps per epoch,
# and uneven validation sets (5 and 3 examples): DESIGN section 3's equivalence makes step s the
# 8 examples [s*8, s*8+8).
PAIR_TRAIN = [
    [slice(s * 8 + r * 4 + j * 2, s * 8 + r * 4 + j * 2 + 2) for s in range(2) for j in range(2)]
    for r in range(2)
]
PAIR_STEPS = [[slice(s * 8, s * 8 + 8)] for s in range(2)]
PAIR_VALID = [[slice(40, 45)], [slice(45, 48)]]


async def drive_pair_in_process(
    kind: str,
    *,
    strategy: str | None,
    max_epochs: int,
    schedule: Any,
    eligible: Any = lamploop.ALL_EPOCHS,
    a: float = 1.0,
    validation: bool = True,
    seen: list | None = None,
    root_train_batches: Any = None,
    follower_stop: Any = None,
    bound: float = BOUND_S,
    **root_extra: Any,
) -> tuple[Any, torch.nn.Module, torch.nn.Module, Any]:
    """Rank 0 and rank 1 as two tasks of this process, over ``kind``'s control channel and a
    Gloo group; returns (root's outcome, root module, follower module, follower's outcome)."""
    modules = [make_module(), other_module()]
    follower_keywords: dict[str, Any] = {}
    root_keywords: dict[str, Any] = dict(root_extra)
    if strategy == "all_reduce":
        follower_keywords["optimizer_factory"] = sgd(0.2, momentum=0.5)
    if follower_stop is not None:
        follower_keywords["stop"] = follower_stop
    if strategy is not None:
        follower_keywords["strategy"] = strategy
        root_keywords["strategy"] = strategy
    valid = per_rank_factory(PAIR_VALID) if validation else None
    outcome: list[Any] = [None, "not run"]

    async def follower_run(control: Any) -> None:
        try:
            outcome[1] = await lamploop.follow_distributed_training(
                rank=1,
                nranks=2,
                device="cpu",
                control=RecordingFollower(control, seen) if seen is not None else control,
                model=lamploop.SupervisedModel(modules[1], squared_error),
                train_batches=per_rank_factory(PAIR_TRAIN),
                validation_batches=valid,
                accumulate_gradient_over_n_batches=2,
                **follower_keywords,
            )
        except Exception as error:
            outcome[1] = error

    async def root_run(control: Any) -> None:
        try:
            outcome[0] = await lamploop.drive_distributed_training(
                nranks=2,
                device="cpu",
                control=control,
                model=lamploop.SupervisedModel(modules[0], squared_error),
                optimizer_factory=sgd(0.2, momentum=0.5),
                train_batches=root_train_batches or per_rank_factory(PAIR_TRAIN),
                validation_batches=valid,
                max_epochs=max_epochs,
                accumulate_gradient_over_n_batches=2,
                return_min_validation_loss_model=eligible,
                learning_rate_schedule=schedule,
                validation_loss_exponential_smoothing_factor=a,
                **root_keywords,
            )
        except Exception as error:
            outcome[0] = error

    with anyio.fail_after(bound):
        if kind == "local":
            root, (follower,) = lamploop.local_control(2, join_timeout=30)
            async with root, follower, anyio.create_task_group() as group:
                group.start_soon(follower_run, follower)
                group.start_soon(root_run, root)
        else:
            token = "design-r3-token"
            async with TcpControlRoot(
                port=0, nranks=2, token=token, model_spec=model_spec(modules[0]), join_timeout=30
            ) as root:
                host, port = root.address[:2]

                async def tcp_follower() -> None:
                    async with TcpControlFollower(
                        host=host,
                        port=port,
                        rank=1,
                        nranks=2,
                        token=token,
                        model_spec=model_spec(modules[1]),
                        connect_timeout=30,
                    ) as follower:
                        await follower_run(follower)

                async with anyio.create_task_group() as group:
                    group.start_soon(tcp_follower)
                    group.start_soon(root_run, root)
    return outcome[0], modules[0], modules[1], outcome[1]


# ---------------------------------------------------------------------------------------------
# Section 5: the in-process and the TCP control channels are interchangeable, to the bit.
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["reduce_to_root", "all_reduce"])
@pytest.mark.anyio
async def test_in_process_and_tcp_control_give_identical_runs(strategy: str) -> None:
    """DESIGN.md section 5: "a separate, pluggable, low-traffic control channel (in-process or TCP)
    carries the per-epoch commands" and "Commands: `Train(epoch, lr_factor)`, `Valid(epoch)`,
    `Stop(reason)`"; section 3's semantics (schedule, smoothing, selection, global losses, the
    equivalence).  The same two ranks over `local_control` and over `TcpControlRoot` /
    `TcpControlFollower` (both in this process) give the same LoopState, the same parameters to
    the bit and the same commands; both equal a float64 loop written here."""
    schedule = lamploop.decrement(1, 0.5)
    runs = {}
    for kind in ("local", "tcp"):
        seen: list = []
        final, root_module, follower_module, follower_outcome = await drive_pair_in_process(
            kind, strategy=strategy, max_epochs=3, schedule=schedule, a=0.5, seen=seen, eligible=(1, 2)
        )
        assert isinstance(final, lamploop.LoopState), f"{kind}: {final!r}"
        assert follower_outcome is None, f"{kind}: follower ended with {follower_outcome!r}"
        runs[kind] = (final, root_module, follower_module, seen)
    (local, local_module, _, local_seen), (tcp, tcp_module, _, tcp_seen) = runs["local"], runs["tcp"]
    assert local == tcp
    assert_bitwise(tcp_module, local_module)
    expected_commands = [
        ("Train", 0, 1.0),
        ("Valid", 0),
        ("Train", 1, 0.5),
        ("Valid", 1),
        ("Train", 2, 0.25),
        ("Valid", 2),
        ("Stop",),
    ]
    assert local_seen == expected_commands
    assert tcp_seen == expected_commands
    reference = reference_run(
        PAIR_STEPS,
        PAIR_VALID[0] + PAIR_VALID[1],
        factors=(1.0, 0.5, 0.25),
        make_optimizer=sgd(0.2, momentum=0.5),
        a=0.5,
        eligible=lambda e: e in (1, 2),
    )
    assert_curve(local, reference)
    assert local.epoch == 3
    assert local.min_validation_epoch == reference.best_epoch
    assert local.min_validation_loss == pytest.approx(reference.min_loss, rel=1e-12)
    assert local.last_validation_loss == pytest.approx(reference.last_smoothed, rel=1e-12)
    assert reference.best is not None
    assert_close(local_module, reference.best)


# ---------------------------------------------------------------------------------------------
# Section 2/3: LoopState after runs that stop early, select nothing, or never validate.
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("schedule", "stop_at", "factors"),
    [
        (lamploop.decrement(2, 0.0), 2, (1.0, 1.0)),
        (lamploop.linear(1.0, -1.0, 4), 2, (1.0, 0.5)),
        (lamploop.step_after(1, 0.0), 1, (1.0,)),
    ],
    ids=["decrement-to-zero", "linear-below-zero", "step-after-zero"],
)
@pytest.mark.anyio
async def test_drive_and_follow_stop_early_when_the_factor_reaches_zero(
    schedule: Any, stop_at: int, factors: tuple[float, ...]
) -> None:
    """DESIGN.md section 2: "A factor <= 0 ends training (early stopping)."; section 3: "The
    schedule is asked for epoch e's factor before epoch e runs (also once more at the stop)";
    section 5: `Stop(reason)`.  Two ranks: the run ends before the epoch whose factor is <= 0,
    the follower is sent Stop and returns None, LoopState.epoch is the number of epochs run and
    the curve has one entry each; the best of them is in the model (float64 reference)."""
    seen: list = []
    final, module, _, follower_outcome = await drive_pair_in_process(
        "local", strategy=None, max_epochs=6, schedule=schedule, seen=seen
    )
    assert isinstance(final, lamploop.LoopState), repr(final)
    assert follower_outcome is None, repr(follower_outcome)
    assert final.epoch == stop_at
    assert len(final.learning_curve) == stop_at
    trains = [c for c in seen if c[0] == "Train"]
    assert [c[1] for c in trains] == list(range(stop_at))
    assert [c[2] for c in trains] == pytest.approx(list(factors), rel=1e-15)
    assert seen[-1] == ("Stop",)
    reference = reference_run(
        PAIR_STEPS, PAIR_VALID[0] + PAIR_VALID[1], factors=factors, make_optimizer=sgd(0.2, momentum=0.5)
    )
    assert_curve(final, reference)
    assert final.min_validation_epoch == reference.best_epoch
    assert reference.best is not None
    assert_close(module, reference.best)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["no-eligible-epoch", "no-validation"])
@pytest.mark.anyio
async def test_without_an_eligible_validated_epoch_the_model_is_the_last_one(case: str) -> None:
    """DESIGN.md section 2: "When training ends the best model (if any epoch was eligible) is
    copied into the model."; section 3: "only epochs listed in `return_min_validation_loss_model`
    ... may become the best" (the contract's default `()` lists none).  With no epoch listed, or
    no validation at all, the model keeps the last epoch's parameters, even where validation got
    worse (lr 0.9 with momentum overshoots here), and no epoch is named the best."""
    module = make_module()
    train = [[slice(0, 4), slice(4, 8), slice(8, 12)]]
    valid = [[slice(40, 48)]]
    keywords: dict[str, Any] = {}
    if case == "no-validation":
        keywords["return_min_validation_loss_model"] = lamploop.ALL_EPOCHS
    with anyio.fail_after(BOUND_S):
        final = await lamploop.drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=lamploop.SupervisedModel(module, squared_error),
            optimizer_factory=sgd(0.9, momentum=0.9),
            train_batches=per_rank_factory(train),
            validation_batches=per_rank_factory(valid) if case == "no-eligible-epoch" else None,
            max_epochs=4,
            **keywords,
        )
    reference = reference_run(
        [[s] for s in train[0]],
        valid[0] if case == "no-eligible-epoch" else None,
        factors=(1.0,) * 4,
        make_optimizer=sgd(0.9, momentum=0.9),
        eligible=lambda e: False,
    )
    assert_curve(final, reference)
    assert final.epoch == 4
    assert final.min_validation_epoch is None
    assert_close(module, reference.module)
    if case == "no-validation":
        assert final.last_validation_loss is None
        assert final.min_validation_loss is None
        assert all(entry.validation_loss is None for entry in final.learning_curve)
    else:
        # validation did get worse at some epoch, so "the best" would have differed
        raws = [entry.validation_loss[1] for entry in final.learning_curve]
        assert min(raws) < raws[-1]
        assert final.last_validation_loss == pytest.approx(reference.last_smoothed, rel=1e-12)


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_loop_state_fields_with_validation_every_third_epoch_on_replicas() -> None:
    """DESIGN.md section 2's LoopState fields after N epochs, section 3: "The last smoothed
    validation loss carries over epochs in which validation does not run", smoothing
    `raw * a + previous * (1 - a)`, selection among listed epochs only; `validation_frequency`.
    Three CPU replicas with uneven streams (a rank runs out first) and k = 2, 7 epochs,
    validation in epochs 0, 3, 6, only epochs >= 3 eligible; float64 single-device reference."""
    # per step (k = 2): rank 0 two batches of 2, rank 1 two batches of 1, rank 2 one batch of 3
    # in the first step only: step 0 = 9 examples [0, 9), step 1 = 6 examples [9, 15)
    per_rank = [
        [slice(0, 2), slice(2, 4), slice(9, 11), slice(11, 13)],
        [slice(4, 5), slice(5, 6), slice(13, 14), slice(14, 15)],
        [slice(6, 9)],
    ]
    steps = [[slice(0, 9)], [slice(9, 15)]]
    valid = [[slice(40, 44)], [slice(44, 45)], [slice(45, 50)]]
    models = [lamploop.SupervisedModel(make_module(), squared_error) for _ in range(3)]
    with anyio.fail_after(BOUND_S):
        final = await lamploop.local_data_parallel_training_loop(
            [(m, per_rank_factory(per_rank), per_rank_factory(valid)) for m in models],
            sgd(0.1, momentum=0.9),
            7,
            validation_frequency=3,
            accumulate_gradient_over_n_batches=2,
            return_min_validation_loss_model=range(3, 100),
            validation_loss_exponential_smoothing_factor=0.3,
        )
    reference = reference_run(
        steps,
        [slice(40, 50)],
        factors=(1.0,) * 7,
        make_optimizer=sgd(0.1, momentum=0.9),
        a=0.3,
        eligible=lambda e: e >= 3,
        validation_frequency=3,
    )
    assert final.epoch == 7
    assert_curve(final, reference)
    assert [entry.validation_loss is not None for entry in final.learning_curve] == [
        True,
        False,
        False,
        True,
        False,
        False,
        True,
    ]
    assert final.last_validation_loss == pytest.approx(reference.last_smoothed, rel=1e-12)
    assert final.min_validation_epoch == reference.best_epoch
    assert final.min_validation_epoch in (3, 6)
    assert final.min_validation_loss == pytest.approx(reference.min_loss, rel=1e-12)
    assert reference.best is not None
    assert_close(models[0].module, reference.best)


# ---------------------------------------------------------------------------------------------
# Sections 2/3/6: resuming a data-parallel run from checkpoint files is bitwise.
# ---------------------------------------------------------------------------------------------

PLATEAU = {"patience": 0, "reduce_factor": 0.5}


async def local_parallel_run(
    max_epochs: int,
    directory: Path | None,
    *,
    init_state: Any = None,
    schedule_state: Any = None,
) -> tuple[lamploop.LoopState, torch.nn.Module, list[int]]:
    per_rank = [[slice(0, 3), slice(3, 6), slice(12, 14)], [slice(6, 9), slice(9, 12)]]
    valid = [[slice(40, 45)], [slice(45, 48)]]
    models = [lamploop.SupervisedModel(make_module(), squared_error) for _ in range(2)]
    saved: list[int] = []

    async def checkpoint(state: lamploop.LoopStateWithModelAndOptimizerData, schedule: Any) -> None:
        assert directory is not None
        saved.append(state.loop_state.epoch)
        lamploop.save_checkpoint(directory, state, schedule_state=schedule, keep_last=None)

    with anyio.fail_after(BOUND_S):
        final = await lamploop.local_data_parallel_training_loop(
            [(m, per_rank_factory(per_rank), per_rank_factory(valid)) for m in models],
            lambda p: torch.optim.Adam(p, lr=0.05),
            max_epochs,
            checkpoint_state=checkpoint if directory is not None else None,
            return_min_validation_loss_model=lamploop.ALL_EPOCHS,
            learning_rate_schedule=lamploop.reduce_lr_on_plateau(**PLATEAU),
            init_state=init_state,
            learning_rate_schedule_init_state=schedule_state,
            validation_loss_exponential_smoothing_factor=0.5,
        )
    return final, models[0].module, saved


@pytest.mark.timeout(90)
@pytest.mark.anyio
async def test_local_data_parallel_resume_from_checkpoint_files_is_bitwise(tmp_path: Path) -> None:
    """DESIGN.md section 6: "Resuming at epoch k and training on gives the same parameters as a run
    that was never interrupted." and section 3: "`checkpoint_state` receives the schedule state
    that the next epoch will use" (two CPU replicas, Adam, a plateau schedule, through
    save_checkpoint/load_checkpoint files; resumed from epochs 2 and 4 of 5, the latter just
    before the plateau schedule halves the factor; the uninterrupted run's parameters also match
    a float64 single-device loop)."""
    final, module, saved = await local_parallel_run(5, tmp_path)
    assert saved == [1, 2, 3, 4, 5]
    reference = reference_run(
        [[slice(0, 3), slice(6, 9)], [slice(3, 6), slice(9, 12)], [slice(12, 14)]],
        [slice(40, 48)],
        factors=plateau_factors(final),
        make_optimizer=lambda p: torch.optim.Adam(p, lr=0.05),
        a=0.5,
    )
    assert_curve(final, reference, rel=1e-10)
    for resume_at in (2, 4):
        directory = tmp_path / f"epoch-{resume_at:06d}"
        checkpoint = lamploop.load_checkpoint(
            directory, schedule=lamploop.reduce_lr_on_plateau(**PLATEAU), model=make_module()
        )
        assert checkpoint.state.loop_state.epoch == resume_at
        assert checkpoint.state.loop_state.learning_curve == final.learning_curve[:resume_at]
        torch.manual_seed(resume_at * 1000)  # whatever the process's RNG
        resumed, resumed_module, resumed_saved = await local_parallel_run(
            5,
            tmp_path / f"resumed-{resume_at}",
            init_state=checkpoint.state,
            schedule_state=checkpoint.schedule_state,
        )
        assert resumed_saved == list(range(resume_at + 1, 6))
        assert resumed == final
        assert_bitwise(resumed_module, module)


def plateau_factors(final: lamploop.LoopState) -> list[float]:
    """reduce_lr_on_plateau(patience=0, reduce_factor=0.5) as its docstring defines it: a
    validation `v` improves when `v < best - 1e-4 * |best|`; after more than 0 validations
    without improvement the factor halves.  Asked before each epoch with the last smoothed loss."""
    factors, factor, best = [], 1.0, None
    previous = None
    for entry in final.learning_curve:
        if previous is not None:
            if best is None or previous < best - 1e-4 * abs(best):
                best = previous
            else:
                factor *= 0.5
        factors.append(factor)
        previous = entry.validation_loss[0]
    return factors


# ---------------------------------------------------------------------------------------------
# Section 2: schedules; the end of training and the documented formulas inside `epochs`.
# ---------------------------------------------------------------------------------------------


class Script:
    def __init__(self, validation: Sequence[float]) -> None:
        self.validation = validation
        self.factors: list[float] = []
        self.saved: list[int] = []

    async def train_epoch(self, factor: float) -> float:
        self.factors.append(factor)
        return 1.0

    async def validation_epoch(self) -> float:
        return self.validation[len(self.factors) - 1]

    async def save_best(self) -> None:
        self.saved.append(len(self.factors) - 1)


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        (lamploop.linear(1.0, -1.0, 4), [1.0, 0.5]),  # epoch 2's factor is 0: stop
        (lamploop.linear(2.0, 0.0, 3), [2.0, 4 / 3, 2 / 3]),  # end 0: stops at max_steps
        (lamploop.decrement(3, 0.0), [1.0, 1.0, 1.0]),
        (lamploop.step_after(4, -1.0), [1.0, 1.0, 1.0, 1.0]),
        (lamploop.cyclic(2.0, 3), [1.0, 5 / 3, 5 / 3, 1.0, 5 / 3, 5 / 3, 1.0, 5 / 3]),
        (lamploop.from_epoch_count(lambda e: 0.5**e if e < 5 else 0.0), [1.0, 0.5, 0.25, 0.125, 0.0625]),
    ],
    ids=[
        "linear-negative",
        "linear-zero",
        "decrement-zero",
        "step-after-negative",
        "cyclic-odd",
        "from-count",
    ],
)
@pytest.mark.anyio
async def test_epoch_factors_follow_the_documented_formulas_and_stop_at_zero(
    schedule: Any, expected: list[float]
) -> None:
    """DESIGN.md section 2: "A factor <= 0 ends training (early stopping)" and lamp's schedules
    with the formulas of their docstrings (linear: `start + (end - start) * min(epoch, max_steps)
    / max_steps`; decrement: `fraction ** (epoch // every)`; step_after; cyclic: `1 + (max - 1) *
    (1 - |p - h| / h)`); `epochs` trains with exactly these factors and ends with
    LoopState.epoch = the number of epochs trained."""
    script = Script([1.0] * 20)
    with anyio.fail_after(10):
        final = await lamploop.epochs(
            max_epochs=8,
            train_epoch=script.train_epoch,
            validation_epoch=None,
            save_min_validation_loss_model=script.save_best,
            learning_rate_schedule=schedule,
        )
    assert script.factors == pytest.approx(expected, rel=1e-12)
    assert final.epoch == len(expected)
    assert [entry.epoch for entry in final.learning_curve] == list(range(len(expected)))


@pytest.mark.anyio
async def test_plateau_threshold_and_min_factor() -> None:
    """`reduce_lr_on_plateau`'s docstring: "A validation loss `v` improves when `v < best -
    threshold * |best|`. After more than `patience` validations without improvement the factor
    becomes `max(factor * reduce_factor, min_factor)` and the count restarts."  An improvement
    smaller than the relative threshold counts as none; the factor never goes below
    `min_factor`; `epochs` feeds it the smoothed losses."""
    losses = [1.0, 0.95, 0.94, 0.7, 0.69, 0.69, 0.69, 0.69, 0.69]
    script = Script(losses)
    schedule = lamploop.reduce_lr_on_plateau(patience=1, reduce_factor=0.5, threshold=0.05, min_factor=0.3)
    with anyio.fail_after(10):
        await lamploop.epochs(
            max_epochs=len(losses),
            train_epoch=script.train_epoch,
            validation_epoch=script.validation_epoch,
            save_min_validation_loss_model=script.save_best,
            learning_rate_schedule=schedule,
        )
    # reference: written from the docstring
    expected, factor, best, waited = [], 1.0, None, 0
    for epoch in range(len(losses)):
        if epoch > 0:
            v = losses[epoch - 1]
            if best is None or v < best - 0.05 * abs(best):
                best, waited = v, 0
            else:
                waited += 1
                if waited > 1:
                    factor, waited = max(factor * 0.5, 0.3), 0
        expected.append(factor)
    assert expected != [1.0] * len(losses)  # the case does reduce
    assert 0.3 in expected  # and reaches the floor
    assert script.factors == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Section 3: a training pass starts from clean gradients; forward-only leaves the model alone.
# ---------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_one_epoch_ignores_gradients_left_on_the_parameters() -> None:
    """DESIGN.md section 3: "one optimizer step uses the gradient of (sum of losses of every
    example in the step ...) / (number of those examples)"; docs/contract-changes.md: "Gradients
    left on the parameters before a training pass are cleared, as a loop that calls `zero_grad()`
    before each step would."  Also: a forward-only pass changes neither parameters nor gradients
    and returns the mean loss over examples."""
    module = make_module()
    for parameter in module.parameters():
        parameter.grad = torch.full_like(parameter, 100.0)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    batches = [(X[0:3], Y[0:3]), (X[3:8], Y[3:8]), (X[8:10], Y[8:10])]

    async def stream():
        for batch in batches:
            yield batch

    model = lamploop.SupervisedModel(module, squared_error)
    with anyio.fail_after(10):
        loss = await lamploop.one_epoch(model=model, batches=stream(), step_optimizer=optimizer.step)
    # k = 1: one step per batch
    reference = reference_run(
        [[slice(0, 3)], [slice(3, 8)], [slice(8, 10)]], None, factors=[1.0], make_optimizer=sgd(0.1)
    )
    assert_close(module, reference.module)
    assert float(loss) == pytest.approx(reference.curve[0][1], rel=1e-12)

    before = params(module)
    grads = [p.grad.clone() if p.grad is not None else None for p in module.parameters()]

    async def valid_stream():
        yield X[40:45], Y[40:45]
        yield X[45:48], Y[45:48]

    with anyio.fail_after(10):
        valid = await lamploop.one_epoch(model=model, batches=valid_stream(), forward_only=True)
    assert float(valid) == pytest.approx(mean_loss(reference.module, [slice(40, 48)]), rel=1e-12)
    assert_bitwise(module, before)
    for parameter, grad in zip(module.parameters(), grads, strict=True):
        assert (parameter.grad is None and grad is None) or torch.equal(parameter.grad, grad)


# ---------------------------------------------------------------------------------------------
# Sections 2-5 over two real processes: equal to torch's DistributedDataParallel.
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def spawned(mode: str, spec: Path, out: Path, *extra: str):
    """A worker process; killed (by its own PID) if it is still running when the test leaves."""
    log = open(out.with_suffix(".log"), "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [sys.executable, str(WORKER), mode, str(spec), str(out), *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        log.close()


def worker_output(out: Path) -> str:
    path = out.with_suffix(".log")
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.timeout(150)
@pytest.mark.anyio
async def test_two_processes_replicated_optimizer_equal_torch_ddp(tmp_path: Path) -> None:
    """DESIGN.md section 4: "all-reduce with a replicated optimizer"; section 8: "A strategy ... is
    correct when it equals an implementation written apart from it (PyTorch's DDP ...)"; section 3:
    global losses and the gradient equivalence; section 2: the schedule's factor multiplies the
    base lr (also on the follower's own optimizer).  Rank 0 here, rank 1 in a second process (TCP
    control, Gloo, Adam, float32, k = 2, a follower that starts from other values), against DDP in
    two more processes; the follower ends with the root's parameters."""
    x32, y32 = make_data(torch.float32)
    factors = [1.0, 0.5, 0.25]
    spec_path = tmp_path / "spec.json"
    token = "design-r3-ddp"
    module = make_module(torch.float32)
    base = {
        "seed": SEED,
        "dtype": "float32",
        "lr": 0.05,
        "k": 2,
        "factors": factors,
        "token": token,
        "train": [[[s.start, s.stop] for s in rank] for rank in PAIR_TRAIN],
        "valid": [[[s.start, s.stop] for s in rank] for rank in PAIR_VALID],
        "ddp_port": free_port(),
    }
    ddp_outs = [tmp_path / f"ddp{rank}.json" for rank in range(2)]
    follower_out = tmp_path / "follower.json"
    with anyio.fail_after(120):
        async with TcpControlRoot(
            port=0, nranks=2, token=token, model_spec=model_spec(module), join_timeout=60
        ) as root:
            spec_path.write_text(json.dumps({**base, "port": root.address[1]}))
            with (
                spawned("ddp", spec_path, ddp_outs[0], "0") as ddp0,
                spawned("ddp", spec_path, ddp_outs[1], "1") as ddp1,
                spawned("follow", spec_path, follower_out) as follower,
            ):
                try:
                    final = await lamploop.drive_distributed_training(
                        nranks=2,
                        device="cpu",
                        control=root,
                        model=lamploop.SupervisedModel(module, squared_error),
                        optimizer_factory=lambda p: torch.optim.Adam(p, lr=0.05),
                        train_batches=per_rank_factory(PAIR_TRAIN, x32, y32),
                        validation_batches=per_rank_factory(PAIR_VALID, x32, y32),
                        max_epochs=3,
                        accumulate_gradient_over_n_batches=2,
                        learning_rate_schedule=lamploop.from_epoch_count(lambda e: factors[min(e, 2)]),
                    )
                except Exception as error:
                    pytest.fail(f"root failed: {single(error)!r}\n{worker_output(follower_out)}")
                for process in (follower, ddp0, ddp1):
                    await anyio.to_thread.run_sync(lambda p=process: p.wait(timeout=60))
    for out in (follower_out, *ddp_outs):
        assert out.exists(), worker_output(out)
    record = json.loads(follower_out.read_text())
    assert "error" not in record, record.get("traceback")
    assert record["returned_none"] is True
    reference = json.loads(ddp_outs[0].read_text())["curve"]
    reference_params = load_file(str(ddp_outs[0]) + ".safetensors")
    assert_bitwise(load_file(str(ddp_outs[1]) + ".safetensors"), reference_params)  # DDP itself
    assert final.epoch == 3
    assert [entry.training_loss for entry in final.learning_curve] == pytest.approx(
        [t for t, _ in reference], rel=1e-5
    )
    assert [entry.validation_loss[1] for entry in final.learning_curve] == pytest.approx(
        [v for _, v in reference], rel=1e-5
    )
    assert_close(module, reference_params, tol=1e-5)
    # the replicated optimizer stepped the follower's copy alike: "identical because updates are"
    assert_bitwise(load_file(str(follower_out) + ".safetensors"), module)


# ---------------------------------------------------------------------------------------------
# Sections 5 and 8: a lost root ends its follower; joins and connects are bounded.
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.anyio
async def test_killed_root_process_ends_the_follower_within_15_s_naming_rank_0(tmp_path: Path) -> None:
    """DESIGN.md section 5: "a dead, frozen or cut-off rank ends every survivor within 15 s
    (default settings), naming the rank that failed" and "A joined peer that goes silent ... ends
    the run on every rank with an error that names it, instead of hanging in a collective."
    (the root is a second process, SIGKILLed in its second epoch; the follower is this process)."""
    port = free_port()
    token = "design-r3-root-dies"
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(
        json.dumps(
            {
                "seed": SEED,
                "port": port,
                "token": token,
                "train": [[[s.start, s.stop] for s in rank] for rank in PAIR_TRAIN],
            }
        )
    )
    out = tmp_path / "root.json"
    marker = Path(str(out) + ".training")
    module = other_module()
    killed_at: list[float] = []
    with spawned("root", spec_path, out) as root_process:

        async def kill_when_training() -> None:
            await anyio.to_thread.run_sync(
                lambda: wait_until(
                    lambda: marker.exists() or root_process.poll() is not None,
                    timeout=60,
                    what="the root's second epoch",
                )
            )
            assert root_process.poll() is None, f"the root ended by itself: {worker_output(out)}"
            root_process.send_signal(signal.SIGKILL)
            killed_at.append(time.monotonic())

        with anyio.fail_after(90):
            async with anyio.create_task_group() as group:
                group.start_soon(kill_when_training)
                with pytest.raises(BaseException) as caught:  # noqa: PT011 - inspected below
                    async with TcpControlFollower(
                        host="127.0.0.1",
                        port=port,
                        rank=1,
                        nranks=2,
                        token=token,
                        model_spec=model_spec(module),
                        connect_timeout=60,
                    ) as control:
                        await lamploop.follow_distributed_training(
                            rank=1,
                            nranks=2,
                            device="cpu",
                            control=control,
                            model=lamploop.SupervisedModel(module, squared_error),
                            train_batches=per_rank_factory(PAIR_TRAIN),
                            validation_batches=None,
                        )
                ended_at = time.monotonic()
    assert killed_at, f"the root never trained: {worker_output(out)}"
    assert ended_at - killed_at[0] < 15.0
    error = single(caught.value)
    assert isinstance(error, PeerLostError), repr(caught.value)
    assert error.rank == 0, repr(error)
    assert "0" in str(error)


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_tcp_follower_without_a_root_gives_up_after_connect_timeout() -> None:
    """DESIGN.md section 8: "Every wait on the outside world (a peer, ... a socket ...) is
    bounded"; TcpControlFollower's docstring: "retrying ... for up to ``connect_timeout``
    seconds".  Nothing listens on the port: joining fails with a lamploop error soon after the
    timeout."""
    port = free_port()
    module = make_module()
    started = time.monotonic()
    with anyio.fail_after(30), pytest.raises(BaseException) as caught:  # noqa: PT011 - inspected below
        async with TcpControlFollower(
            host="127.0.0.1",
            port=port,
            rank=1,
            nranks=2,
            token="nobody-there",
            model_spec=model_spec(module),
            connect_timeout=2.0,
        ) as control:
            await lamploop.follow_distributed_training(
                rank=1,
                nranks=2,
                device="cpu",
                control=control,
                model=lamploop.SupervisedModel(module, squared_error),
                train_batches=per_rank_factory(PAIR_TRAIN),
                validation_batches=None,
            )
    elapsed = time.monotonic() - started
    assert isinstance(single(caught.value), LamploopError), repr(caught.value)
    assert 1.5 <= elapsed < 12.0, elapsed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["local", "tcp"])
@pytest.mark.anyio
async def test_root_whose_follower_never_joins_fails_after_join_timeout(kind: str) -> None:
    """DESIGN.md section 8: "Every wait on the outside world (a peer ...) is bounded";
    `local_control`'s and `TcpControlRoot`'s docstrings: "join_timeout: seconds
    on_rendezvous_ready waits for every follower to join".  A two-rank run whose follower never
    comes fails with a lamploop error naming the missing rank, soon after join_timeout."""
    module = make_module()
    started = time.monotonic()

    async def drive(control: Any) -> Any:
        return await lamploop.drive_distributed_training(
            nranks=2,
            device="cpu",
            control=control,
            model=lamploop.SupervisedModel(module, squared_error),
            optimizer_factory=sgd(0.1),
            train_batches=per_rank_factory(PAIR_TRAIN),
            validation_batches=None,
            max_epochs=1,
        )

    async def run() -> None:
        if kind == "local":
            root, (follower,) = lamploop.local_control(2, join_timeout=2.0)
            async with root, follower:
                await drive(root)
        else:
            async with TcpControlRoot(
                port=0, nranks=2, token="lonely", model_spec=model_spec(module), join_timeout=2.0
            ) as root:
                await drive(root)

    with anyio.fail_after(30), pytest.raises(BaseException) as caught:  # noqa: PT011 - inspected below
        await run()
    elapsed = time.monotonic() - started
    error = single(caught.value)
    assert isinstance(error, LamploopError), repr(caught.value)
    assert 1.5 <= elapsed < 12.0, elapsed
    assert "1" in str(error), str(error)


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_local_follower_whose_root_never_drives_fails_after_join_timeout() -> None:
    """DESIGN.md section 8: "Every wait on the outside world (a peer ...) is bounded";
    `local_control`'s docstring: join_timeout is also how long "a follower waits for the
    rendezvous".  A follower whose root never starts training ends with a lamploop error."""
    module = make_module()
    started = time.monotonic()

    async def run() -> None:
        root, (follower,) = lamploop.local_control(2, join_timeout=2.0)
        async with root, follower:
            await lamploop.follow_distributed_training(
                rank=1,
                nranks=2,
                device="cpu",
                control=follower,
                model=lamploop.SupervisedModel(module, squared_error),
                train_batches=per_rank_factory(PAIR_TRAIN),
                validation_batches=None,
            )

    with anyio.fail_after(30), pytest.raises(BaseException) as caught:  # noqa: PT011 - inspected below
        await run()
    elapsed = time.monotonic() - started
    assert isinstance(single(caught.value), LamploopError), repr(caught.value)
    assert 1.5 <= elapsed < 12.0, elapsed


# ---------------------------------------------------------------------------------------------
# Sections 3 and 6 with two ranks: what checkpoint_state receives, and resuming from it.
# ---------------------------------------------------------------------------------------------


def snapshot(
    state: lamploop.LoopStateWithModelAndOptimizerData,
) -> lamploop.LoopStateWithModelAndOptimizerData:
    """A deep copy: the run goes on changing its tensors after the callback returns."""
    return attrs.evolve(
        state,
        model=params(dict(state.model)),
        optimizer=copy.deepcopy(dict(state.optimizer)),
        best_model=params(dict(state.best_model)),
    )


@pytest.mark.timeout(120)
@pytest.mark.anyio
async def test_two_ranks_checkpoint_state_contents_and_bitwise_resume() -> None:
    """DESIGN.md section 2: "checkpoint_state ... called after every epoch with LoopState(epoch + 1,
    ...), so that resuming from it continues at the next epoch" and LoopStateWithModelAndOptimizerData
    (model: "state_dict of the live model", best_model: "state_dict at min smoothed validation
    loss"); section 3: "`checkpoint_state` receives the schedule state that the next epoch will
    use, so that a resumed run asks the schedule exactly what an uninterrupted run would have
    asked"; section 6: "Resuming at epoch k and training on gives the same parameters as a run that
    was never interrupted."  Two ranks in this process (all_reduce, momentum, a plateau schedule);
    the resumed run's follower starts from other values and a fresh optimizer."""
    schedule = lamploop.reduce_lr_on_plateau(patience=0, reduce_factor=0.5)
    captured: list[tuple[Any, Any]] = []

    async def checkpoint(state: Any, schedule_state: Any) -> None:
        captured.append((snapshot(state), schedule_state))

    seen: list = []
    final, module, follower_module, follower_outcome = await drive_pair_in_process(
        "local",
        strategy="all_reduce",
        max_epochs=5,
        schedule=schedule,
        eligible=lamploop.ALL_EPOCHS,
        seen=seen,
        checkpoint_state=checkpoint,
    )
    assert isinstance(final, lamploop.LoopState), repr(final)
    assert follower_outcome is None, repr(follower_outcome)
    factors = [c[2] for c in seen if c[0] == "Train"]
    assert len(factors) == 5
    assert 0.5 in factors  # the plateau schedule did act (with the reference's losses)
    reference = reference_run(
        PAIR_STEPS, PAIR_VALID[0] + PAIR_VALID[1], factors=factors, make_optimizer=sgd(0.2, momentum=0.5)
    )
    assert_curve(final, reference)
    assert [state.loop_state.epoch for state, _ in captured] == [1, 2, 3, 4, 5]
    best: dict[str, torch.Tensor] | None = None
    best_loss = math.inf
    for epoch, (state, schedule_state) in enumerate(captured):
        assert state.loop_state.learning_curve == final.learning_curve[: epoch + 1]
        assert_close(dict(state.model), reference.after_epoch[epoch])
        smoothed = reference.curve[epoch][2][0]
        if smoothed < best_loss:
            best, best_loss = reference.after_epoch[epoch], smoothed
        assert_close(dict(state.best_model), best)
        assert state.optimizer["param_groups"], state.optimizer
        if epoch + 1 < 5:
            # the state handed over is the one the next epoch's question is asked with
            _, factor = schedule.learning_rate_factor(
                schedule_state, epoch + 1, state.loop_state.last_validation_loss
            )
            assert factor == factors[epoch + 1], epoch
    resumed_seen: list = []
    torch.manual_seed(99)
    resumed, resumed_module, resumed_follower, resumed_outcome = await drive_pair_in_process(
        "local",
        strategy="all_reduce",
        max_epochs=5,
        schedule=schedule,
        eligible=lamploop.ALL_EPOCHS,
        seen=resumed_seen,
        init_state=captured[1][0],
        learning_rate_schedule_init_state=captured[1][1],
    )
    assert resumed_outcome is None, repr(resumed_outcome)
    assert [c for c in resumed_seen if c[0] == "Train"] == [c for c in seen if c[0] == "Train"][2:]
    assert resumed == final
    assert_bitwise(resumed_module, module)
    assert_bitwise(resumed_follower, follower_module)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["reduce_to_root", "all_reduce"])
@pytest.mark.anyio
async def test_stop_request_ends_both_ranks_after_the_step_in_progress(strategy: str) -> None:
    """DESIGN.md section 8: "a stop request (SIGTERM, SIGINT) ends it after the step in
    progress"; docs/contract-changes.md: "Setting `stop` (a `StopRequest` ...) stops every rank
    after the same step and raises `lamploop.errors.TrainingInterrupted` on the root."  The stop
    is requested while the root is in the middle of epoch 1's first step (after its first of
    k = 2 batches): that step is finished on both ranks, nothing after it; the root's parameters
    equal a float64 loop of epoch 0 plus that one step, and the follower ends without hanging."""
    stop = StopRequest()

    async def root_train(context: lamploop.BatchContext):
        for index, s in enumerate(PAIR_TRAIN[context.rank]):
            yield X[s], Y[s]
            if context.epoch == 1 and index == 0:
                stop.request("the stream asked")

    final, module, follower_module, follower_outcome = await drive_pair_in_process(
        "local",
        strategy=strategy,
        max_epochs=4,
        schedule=lamploop.noop(),
        eligible=(),
        validation=False,
        root_train_batches=root_train,
        follower_stop=stop,  # the same request on both ranks, as docs/streaming.md shows
        bound=12.0,
        stop=stop,
    )
    error = single(final) if isinstance(final, BaseException) else final
    assert isinstance(error, TrainingInterrupted), repr(final)
    assert error.epoch == 1, repr(error)
    assert error.steps_done == 1, repr(error)
    assert not isinstance(follower_outcome, BaseException) or isinstance(
        single(follower_outcome), TrainingInterrupted
    ), repr(follower_outcome)
    reference = reference_run(
        PAIR_STEPS + PAIR_STEPS[:1], None, factors=[1.0], make_optimizer=sgd(0.2, momentum=0.5)
    )
    assert_close(module, reference.module)
    assert_close(follower_module, reference.module)
