"""Acceptance tests of DESIGN.md sections 2-8, second round: what
tests/test_acceptance_design_contract.py does not cover.

Written from DESIGN.md and docs/ (contract-changes.md for the deliberate departures), without
reading the package's source.  Every expected number comes from a plain PyTorch float64 loop
written here, never from lamploop.  Real parts only: a second process over a TCP control channel
and Gloo on 127.0.0.1, real sockets, real files.  Each test quotes the sentence it checks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from support import WORKERS, free_port, wait_until
from workers.records import load_record, save_record

import lamploop
import lamploop.control
import lamploop.errors
from lamploop.checkpoint import load_checkpoint, save_checkpoint
from lamploop.modelspec import model_spec

# ---------------------------------------------------------------------------------------------
# Helpers: data, a tiny float64 model, reference loops written apart from lamploop.
# ---------------------------------------------------------------------------------------------

_GENERATOR = torch.Generator().manual_seed(7_2026)
X = torch.randn(48, 3, generator=_GENERATOR, dtype=torch.float64)
Y = torch.randn(48, 1, generator=_GENERATOR, dtype=torch.float64)
W0 = torch.tensor([[0.5, -0.25, 0.125]], dtype=torch.float64)
B0 = torch.tensor([0.0625], dtype=torch.float64)
WORKER = WORKERS / "design_r2_worker.py"

Batch = tuple[torch.Tensor, torch.Tensor]


def make_module() -> torch.nn.Linear:
    module = torch.nn.Linear(3, 1, dtype=torch.float64)
    with torch.no_grad():
        module.weight.copy_(W0)
        module.bias.copy_(B0)
    return module


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
        assert torch.equal(actual[name], expected[name]), name


def sgd(lr: float, momentum: float = 0.0) -> Callable[[Any], torch.optim.Optimizer]:
    return lambda parameters: torch.optim.SGD(parameters, lr=lr, momentum=momentum)


def per_rank_factory(per_rank: Sequence[Sequence[slice]], log: list | None = None):
    def make(context: lamploop.BatchContext) -> list[Batch]:
        if log is not None:
            log.append((context.epoch, context.rank, context.nranks, threading.get_ident()))
        return [(X[s], Y[s]) for s in per_rank[context.rank]]

    return lamploop.iterable_batches(make)


def mean_loss(module: torch.nn.Module, examples: Sequence[slice]) -> float:
    with torch.no_grad():
        total = sum(float(F.mse_loss(module(X[s]), Y[s], reduction="sum")) for s in examples)
    return total / sum(len(Y[s]) for s in examples)


@attrs.frozen
class Reference:
    module: torch.nn.Module
    curve: list[tuple[int, float, tuple[float, float] | None]]
    best: dict[str, torch.Tensor] | None
    best_epoch: int | None
    min_loss: float | None
    last_smoothed: float | None


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
    """DESIGN's loop, written plainly in float64: per epoch, set every group's lr to base * factor,
    step on the mean gradient of each step's examples, validate, smooth, select strictly."""
    module = make_module()
    optimizer = make_optimizer(module.parameters())
    bases = [group["lr"] for group in optimizer.param_groups]
    curve: list = []
    best = best_epoch = min_loss = smoothed = None
    for epoch, factor in enumerate(factors):
        for group, base in zip(optimizer.param_groups, bases, strict=True):
            group["lr"] = base * factor
        loss_sum, count = 0.0, 0
        for step in steps:
            optimizer.zero_grad()
            total = sum(F.mse_loss(module(X[s]), Y[s], reduction="sum") for s in step)
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
    return Reference(module, curve, best, best_epoch, min_loss, smoothed)


def assert_curve(state: lamploop.LoopState, reference: Reference) -> None:
    assert [entry.epoch for entry in state.learning_curve] == [e for e, _, _ in reference.curve]
    for entry, (_, training, validation) in zip(state.learning_curve, reference.curve, strict=True):
        assert entry.training_loss == pytest.approx(training, rel=1e-12)
        if validation is None:
            assert entry.validation_loss is None
        else:
            assert entry.validation_loss == pytest.approx(validation, rel=1e-12)


def single(error: BaseException) -> BaseException:
    """The one error inside (nested) exception groups, or the group itself."""
    while len(getattr(error, "exceptions", ())) == 1:
        error = error.exceptions[0]
    return error


# ---------------------------------------------------------------------------------------------
# Section 2: the types returned are pure frozen data, named as in DESIGN.md.
# ---------------------------------------------------------------------------------------------


class Script:
    def __init__(self, training: Sequence[float], validation: Sequence[float] | None) -> None:
        self.training, self.validation = training, validation
        self.current = -1
        self.factors: list[float] = []
        self.saved: list[int] = []
        self.checkpoints: list[tuple[Any, Any]] = []

    async def train_epoch(self, factor: float) -> float:
        self.current += 1
        self.factors.append(factor)
        return self.training[self.current]

    async def validation_epoch(self) -> float:
        assert self.validation is not None
        return self.validation[self.current]

    async def save_best(self) -> None:
        self.saved.append(self.current)

    async def checkpoint_state(self, state: Any, schedule_state: Any) -> None:
        self.checkpoints.append((state, schedule_state))


@pytest.mark.anyio
async def test_epochs_returns_frozen_loop_state_of_plain_values() -> None:
    """DESIGN.md section 2: "@attrs.frozen class LoopState: epoch: int; last_validation_loss:
    float | None # smoothed ...; learning_curve: tuple[LearningCurveEntry, ...] # oldest first" and
    "LearningCurveEntry: epoch: int; training_loss: float; validation_loss: tuple[float, float] |
    None # (smoothed, raw)" (the values `epochs` returns, not only the classes)."""
    script = Script([0.75, 0.5], [1.0, 0.5])
    final = await lamploop.epochs(
        max_epochs=2,
        train_epoch=script.train_epoch,
        validation_epoch=script.validation_epoch,
        save_min_validation_loss_model=script.save_best,
        return_min_validation_loss_model=(0, 1),
    )
    assert type(final) is lamploop.LoopState
    assert type(final.epoch) is int
    assert final.epoch == 2
    assert type(final.last_validation_loss) is float
    assert type(final.min_validation_loss) is float
    assert type(final.min_validation_epoch) is int
    assert type(final.learning_curve) is tuple
    for entry in final.learning_curve:
        assert type(entry) is lamploop.LearningCurveEntry
        assert type(entry.epoch) is int
        assert type(entry.training_loss) is float
        assert type(entry.validation_loss) is tuple
        assert len(entry.validation_loss) == 2
        assert all(type(v) is float for v in entry.validation_loss)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            entry.training_loss = 0.0  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        final.epoch = 3  # type: ignore[misc]
    assert final == attrs.evolve(final)  # plain value equality


@pytest.mark.anyio
async def test_epochs_without_validation_epoch() -> None:
    """DESIGN.md section 2: "validation_epoch: Callable[[], Awaitable[float]] | None"; and "When
    training ends the best model (if any epoch was eligible) ..." (no validation: no epoch has a
    validation loss, nothing is selected, every entry's validation_loss is None)."""
    script = Script([0.75, 0.5, 0.25], None)
    final = await lamploop.epochs(
        max_epochs=3,
        train_epoch=script.train_epoch,
        validation_epoch=None,
        save_min_validation_loss_model=script.save_best,
        checkpoint_state=script.checkpoint_state,
        return_min_validation_loss_model=(0, 1, 2),
    )
    assert final.epoch == 3
    assert [(e.epoch, e.training_loss, e.validation_loss) for e in final.learning_curve] == [
        (0, 0.75, None),
        (1, 0.5, None),
        (2, 0.25, None),
    ]
    assert (final.last_validation_loss, final.min_validation_loss, final.min_validation_epoch) == (
        None,
        None,
        None,
    )
    assert script.saved == []
    assert [state.epoch for state, _ in script.checkpoints] == [1, 2, 3]


@pytest.mark.anyio
async def test_learning_rate_schedule_init_state_is_the_first_state_asked() -> None:
    """DESIGN.md section 2: "learning_rate_schedule_init_state=None" beside "init_state=None", and
    schedules are "init() -> S and learning_rate_factor(state: S, ...) -> (S, float)": a given
    state is where the schedule starts (None: init())."""
    asked: list[tuple[int, Any]] = []

    class Counting:
        def init(self) -> int:
            return 0

        def learning_rate_factor(self, state: int, epoch: int, last_validation_loss: float | None):
            asked.append((epoch, state))
            return state + 1, 1.0 / (state + 1)

    script = Script([1.0] * 4, None)
    await lamploop.epochs(
        max_epochs=2,
        train_epoch=script.train_epoch,
        validation_epoch=None,
        save_min_validation_loss_model=script.save_best,
        learning_rate_schedule=Counting(),
        learning_rate_schedule_init_state=3,
    )
    assert asked[:2] == [(0, 3), (1, 4)]
    assert script.factors == [0.25, 0.2]
    asked.clear()
    script = Script([1.0] * 4, None)
    await lamploop.epochs(
        max_epochs=2,
        train_epoch=script.train_epoch,
        validation_epoch=None,
        save_min_validation_loss_model=script.save_best,
        learning_rate_schedule=Counting(),
    )
    assert asked[:2] == [(0, 0), (1, 1)]
    assert script.factors == [1.0, 0.5]


@pytest.mark.anyio
async def test_init_state_continues_epoch_numbers_and_curve() -> None:
    """DESIGN.md section 2: "checkpoint_state ... called after every epoch with LoopState(epoch + 1,
    ...), so that resuming from it continues at the next epoch" and "learning_curve: ... # oldest
    first": a run started from a state trains epochs state.epoch .. max_epochs - 1 only, appending
    to the curve it was given."""
    given = lamploop.LoopState(
        epoch=2,
        last_validation_loss=0.5,
        min_validation_loss=0.5,
        min_validation_epoch=1,
        learning_curve=(
            lamploop.LearningCurveEntry(0, 2.0, (1.0, 1.0)),
            lamploop.LearningCurveEntry(1, 1.5, (0.5, 0.5)),
        ),
    )
    script = Script([9.0, 9.0, 1.0, 0.75], [9.0, 9.0, 0.75, 0.25])
    script.current = 1
    final = await lamploop.epochs(
        max_epochs=4,
        train_epoch=script.train_epoch,
        validation_epoch=script.validation_epoch,
        save_min_validation_loss_model=script.save_best,
        checkpoint_state=script.checkpoint_state,
        init_state=given,
        return_min_validation_loss_model=lamploop.ALL_EPOCHS,
        validation_loss_exponential_smoothing_factor=0.5,
    )
    assert len(script.factors) == 2
    assert [state.epoch for state, _ in script.checkpoints] == [3, 4]
    assert final.learning_curve[:2] == given.learning_curve
    # smoothed from the given 0.5: 0.75 * 0.5 + 0.5 * 0.5 = 0.625 (not better), then 0.4375
    assert [e.validation_loss for e in final.learning_curve[2:]] == [(0.625, 0.75), (0.4375, 0.25)]
    assert [e.epoch for e in final.learning_curve] == [0, 1, 2, 3]
    assert script.saved == [3]
    assert (final.min_validation_loss, final.min_validation_epoch) == (0.4375, 3)


# ---------------------------------------------------------------------------------------------
# Sections 2-4 on one process: the driver and local_data_parallel_training_loop against float64.
# ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_driver_alone_full_contract_against_reference() -> None:
    """DESIGN.md section 2: "learning_rate_schedule ... The factor multiplies every param group's
    base lr", "validation_loss_exponential_smoothing_factor", "return_min_validation_loss_model";
    section 3: "the best model is snapshotted when the smoothed loss improves strictly"; "When
    training ends the best model (if any epoch was eligible) is copied into the model." (one rank,
    momentum SGD, compared with a float64 loop written here)."""
    factors = (1.0, 0.5, 0.25, 0.5)
    train = [[slice(0, 4), slice(4, 8), slice(8, 11)]]
    valid = [[slice(30, 34), slice(34, 36)]]
    module = make_module()
    contexts: list = []
    valid_contexts: list = []
    with anyio.fail_after(50):
        final = await lamploop.drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=lamploop.SupervisedModel(module, squared_error),
            optimizer_factory=sgd(0.2, momentum=0.9),
            train_batches=per_rank_factory(train, contexts),
            validation_batches=per_rank_factory(valid, valid_contexts),
            max_epochs=4,
            return_min_validation_loss_model=(1, 2, 3),
            learning_rate_schedule=lamploop.from_epoch_count(lambda e: factors[min(e, len(factors) - 1)]),
            validation_loss_exponential_smoothing_factor=0.5,
        )
    reference = reference_run(
        [[s] for s in train[0]],
        valid[0],
        factors=factors,
        make_optimizer=sgd(0.2, momentum=0.9),
        a=0.5,
        eligible=lambda e: e in (1, 2, 3),
    )
    assert_curve(final, reference)
    assert final.epoch == 4
    assert final.last_validation_loss == pytest.approx(reference.last_smoothed, rel=1e-12)
    assert final.min_validation_epoch == reference.best_epoch
    assert final.min_validation_loss == pytest.approx(reference.min_loss, rel=1e-12)
    assert reference.best is not None
    assert_close(module, reference.best)
    assert [c[:3] for c in contexts] == [(e, 0, 1) for e in range(4)]
    assert [c[:3] for c in valid_contexts] == [(e, 0, 1) for e in range(4)]


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_validation_batches_asked_only_in_validation_epochs() -> None:
    """DESIGN.md section 2: "`train_batches` / `validation_batches` are factories called once per
    epoch with a context (epoch, rank, nranks)" and "validation_frequency=1" (with 2: the
    validation factory is called for the epochs that validate, and the curve says so)."""
    module = make_module()
    train_contexts: list = []
    valid_contexts: list = []
    with anyio.fail_after(50):
        final = await lamploop.drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=lamploop.SupervisedModel(module, squared_error),
            optimizer_factory=sgd(0.1),
            train_batches=per_rank_factory([[slice(0, 6)]], train_contexts),
            validation_batches=per_rank_factory([[slice(30, 36)]], valid_contexts),
            max_epochs=5,
            validation_frequency=2,
        )
    reference = reference_run(
        [[slice(0, 6)]], [slice(30, 36)], factors=[1.0] * 5, make_optimizer=sgd(0.1), validation_frequency=2
    )
    assert [c[0] for c in train_contexts] == [0, 1, 2, 3, 4]
    assert [c[0] for c in valid_contexts] == [0, 2, 4]
    assert_curve(final, reference)
    assert_close(module, reference.module)


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_local_data_parallel_full_contract_against_reference() -> None:
    """DESIGN.md section 2: "async def local_data_parallel_training_loop(models_with_data_streams,
    optimizer_factory, max_epochs, ...) -> LoopState # one process, one replica per device, trained
    model in the first"; section 3: global losses and the gradient equivalence, with a schedule,
    smoothing and model selection (float64 reference)."""
    factors = (1.0, 0.5, 0.25)
    # step s: rank 0 batches [s*8, s*8+2), [s*8+2, s*8+4); rank 1 the next 4 examples (k = 2)
    per_rank = [
        [slice(s * 8 + r * 4 + j * 2, s * 8 + r * 4 + j * 2 + 2) for s in range(2) for j in range(2)]
        for r in range(2)
    ]
    valid = [[slice(30, 35)], [slice(35, 38)]]
    models = [lamploop.SupervisedModel(make_module(), squared_error) for _ in range(2)]
    with anyio.fail_after(50):
        final = await lamploop.local_data_parallel_training_loop(
            [(m, per_rank_factory(per_rank), per_rank_factory(valid)) for m in models],
            sgd(0.2, momentum=0.5),
            3,
            accumulate_gradient_over_n_batches=2,
            return_min_validation_loss_model=lamploop.ALL_EPOCHS,
            learning_rate_schedule=lamploop.from_epoch_count(lambda e: factors[min(e, len(factors) - 1)]),
            validation_loss_exponential_smoothing_factor=0.25,
        )
    steps = [[slice(s * 8, s * 8 + 8)] for s in range(2)]
    reference = reference_run(
        steps, [slice(30, 38)], factors=factors, make_optimizer=sgd(0.2, momentum=0.5), a=0.25
    )
    assert type(final) is lamploop.LoopState
    assert_curve(final, reference)
    assert final.min_validation_epoch == reference.best_epoch
    assert reference.best is not None
    assert_close(models[0].module, reference.best)


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_local_data_parallel_one_thread_per_replica_and_own_process_groups() -> None:
    """DESIGN.md section 4: "`local_data_parallel_training_loop` runs one thread per replica, each
    with its own ProcessGroup object over a shared store, so it shares the multi-process code path."
    (each replica's stream is iterated on its own thread; the global default group is never set up,
    so several runs can live in one process)."""
    log: list = []
    models = [lamploop.SupervisedModel(make_module(), squared_error) for _ in range(2)]
    factory = per_rank_factory([[slice(0, 4)], [slice(4, 8)]], log)
    with anyio.fail_after(50):
        await lamploop.local_data_parallel_training_loop([(m, factory, None) for m in models], sgd(0.1), 2)
    threads = {rank: {entry[3] for entry in log if entry[1] == rank} for rank in (0, 1)}
    assert all(len(t) == 1 for t in threads.values()), threads  # one thread per replica for the run
    assert threads[0].isdisjoint(threads[1])
    assert threading.get_ident() not in threads[0] | threads[1]
    assert not torch.distributed.is_initialized()
    # and a second run in the same process works (its own groups, its own store)
    with anyio.fail_after(50):
        again = await lamploop.local_data_parallel_training_loop(
            [(m, factory, None) for m in models], sgd(0.1), 1
        )
    assert again.epoch == 1


@pytest.mark.parametrize("strategy", ["reduce_to_root", "all_reduce"])
@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_strategies_where_the_optimizer_state_lives(strategy: str) -> None:
    """DESIGN.md section 4: "Strategies: lamp's own (reduce gradients to the root, the root steps,
    parameters are broadcast; optimizer state lives only on the root) and all-reduce with a
    replicated optimizer." (momentum SGD: which replicas' optimizers hold momentum state; both
    strategies give the reference's parameters on every replica)."""
    built: dict[int, torch.optim.Optimizer] = {}
    models = [lamploop.SupervisedModel(make_module(), squared_error) for _ in range(2)]
    owners = {id(p): i for i, m in enumerate(models) for p in m.module.parameters()}

    def factory(parameters: Any) -> torch.optim.Optimizer:
        parameters = list(parameters)
        optimizer = torch.optim.SGD(parameters, lr=0.1, momentum=0.9)
        built[owners[id(parameters[0])]] = optimizer
        return optimizer

    train = per_rank_factory([[slice(0, 3), slice(6, 9)], [slice(3, 6), slice(9, 12)]])
    with anyio.fail_after(50):
        await lamploop.local_data_parallel_training_loop(
            [(m, train, None) for m in models], factory, 2, strategy=strategy
        )
    reference = reference_run(
        [[slice(0, 6)], [slice(6, 12)]], None, factors=[1.0, 1.0], make_optimizer=sgd(0.1, momentum=0.9)
    )
    with_state = sorted(rank for rank, optimizer in built.items() if optimizer.state_dict()["state"])
    assert with_state == ([0] if strategy == "reduce_to_root" else [0, 1])
    for model in models:
        assert_close(model.module, reference.module)


# ---------------------------------------------------------------------------------------------
# Sections 2-5 on two real processes: TCP control channel, Gloo on 127.0.0.1.
# ---------------------------------------------------------------------------------------------

TWO_PROCESS_TRAIN = [
    # rank r, step s, batch j (k = 2, b = 2): examples s*8 + r*4 + j*2 .. +2
    [slice(s * 8 + r * 4 + j * 2, s * 8 + r * 4 + j * 2 + 2) for s in range(2) for j in range(2)]
    for r in range(2)
]
TWO_PROCESS_VALID = [[slice(30, 33), slice(33, 35)], [slice(35, 40)]]
TWO_PROCESS_FACTORS = (1.0, 0.5, 0.25)


def spec_for(**extra: Any) -> dict[str, Any]:
    return {
        "weight": W0,
        "bias": B0,
        "k": 2,
        "train": [[[X[s], Y[s]] for s in slices] for slices in TWO_PROCESS_TRAIN],
        "valid": [[[X[s], Y[s]] for s in slices] for slices in TWO_PROCESS_VALID],
        **extra,
    }


@contextlib.contextmanager
def started(argv: list[str], log: Path):
    """A worker process in a session of its own, ended (by its PID) whatever happens."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


async def drive_with_follower(
    tmp_path: Path,
    *,
    spec: dict[str, Any],
    bound: float,
    during: Callable[[subprocess.Popen, Path], Any] | None = None,
    **drive_keywords: Any,
) -> tuple[Any, dict[str, Any], torch.nn.Module, str]:
    """Rank 0 drives here; rank 1 follows in a process of its own.  Returns the root's result
    (or exception), the follower's record, the root's module and the follower's output."""
    spec_path = tmp_path / "spec"
    save_record(spec, spec_path)
    out = tmp_path / "out"
    token = os.urandom(16).hex()
    module = make_module()
    log_path = tmp_path / "follower.log"
    outcome: Any = None
    proc_box: list[subprocess.Popen] = []
    with contextlib.ExitStack() as processes:
        try:
            with anyio.fail_after(bound):
                async with lamploop.TcpControlRoot(
                    port=0, nranks=2, token=token, model_spec=model_spec(module)
                ) as control:
                    port = control.address[1]
                    proc = processes.enter_context(
                        started(["follow", str(spec_path), str(out), str(port), token], log_path)
                    )
                    proc_box.append(proc)
                    async with anyio.create_task_group() as group:
                        if during is not None:
                            group.start_soon(anyio.to_thread.run_sync, during, proc, out)
                        outcome = await lamploop.drive_distributed_training(
                            nranks=2,
                            device="cpu",
                            control=control,
                            model=lamploop.SupervisedModel(module, squared_error),
                            train_batches=per_rank_factory(TWO_PROCESS_TRAIN),
                            validation_batches=per_rank_factory(TWO_PROCESS_VALID),
                            accumulate_gradient_over_n_batches=2,
                            **drive_keywords,
                        )
        except Exception as error:
            outcome = single(error)
        if isinstance(outcome, lamploop.LoopState):
            await anyio.to_thread.run_sync(lambda: proc_box[0].wait(timeout=30))
    record = load_record(out) if out.exists() else {}
    return outcome, record, module, log_path.read_text(errors="replace")


@pytest.mark.timeout(90)
@pytest.mark.anyio
async def test_two_processes_drive_follow_equal_float64_reference(tmp_path: Path) -> None:
    """DESIGN.md section 2: "async def drive_distributed_training(*, nranks, device, control, model,
    optimizer_factory, train_batches, validation_batches, max_epochs, ...)" and "async def
    follow_distributed_training(*, rank, nranks, device, control, model, train_batches,
    validation_batches, accumulate_gradient_over_n_batches=1, ...) -> None"; section 3: global
    losses, the gradient equivalence, smoothing and selection; section 5: "Commands:
    `Train(epoch, lr_factor)`, `Valid(epoch)`, `Stop(reason)`; about one message per epoch".
    Two processes, TCP control, Gloo; lamp's strategy (the follower has no optimizer)."""
    outcome, record, module, output = await drive_with_follower(
        tmp_path,
        spec=spec_for(),
        bound=70,
        optimizer_factory=sgd(0.2, momentum=0.9),
        max_epochs=3,
        return_min_validation_loss_model=lamploop.ALL_EPOCHS,
        learning_rate_schedule=lamploop.from_epoch_count(lambda e: TWO_PROCESS_FACTORS[min(e, 2)]),
        validation_loss_exponential_smoothing_factor=0.5,
    )
    assert isinstance(outcome, lamploop.LoopState), f"{outcome!r}\n{output}"
    assert "error" not in record, record.get("traceback")
    assert record["returned_none"] is True
    reference = reference_run(
        [[slice(s * 8, s * 8 + 8)] for s in range(2)],
        [slice(30, 40)],
        factors=TWO_PROCESS_FACTORS,
        make_optimizer=sgd(0.2, momentum=0.9),
        a=0.5,
    )
    assert outcome.epoch == 3
    assert_curve(outcome, reference)
    assert outcome.min_validation_epoch == reference.best_epoch
    assert reference.best is not None
    assert_close(module, reference.best)
    assert record["commands"][:-1] == [
        ["Train", 0, 1.0],
        ["Valid", 0],
        ["Train", 1, 0.5],
        ["Valid", 1],
        ["Train", 2, 0.25],
        ["Valid", 2],
    ]
    assert record["commands"][-1][0] == "Stop"
    assert [tuple(c) for c in record["train_contexts"]] == [(e, 1, 2) for e in range(3)]
    assert [tuple(c) for c in record["valid_contexts"]] == [(e, 1, 2) for e in range(3)]


@pytest.mark.soak
@pytest.mark.timeout(90)
@pytest.mark.anyio
async def test_two_processes_all_reduce_with_a_slow_follower_step(tmp_path: Path) -> None:
    """DESIGN.md section 4: "all-reduce with a replicated optimizer"; section 5: "Liveness never
    depends on compute: heartbeats keep flowing while a rank computes a long step or waits in a
    collective, so a slow rank is never taken for a lost one." (the follower spends 6 s, past the
    4 s heartbeat timeout, producing one epoch's batches on its training thread; the root waits in
    a collective meanwhile; the run still ends equal to the reference)."""
    outcome, record, module, output = await drive_with_follower(
        tmp_path,
        spec=spec_for(follower_lr=[0.1, 0.0], sleep={"epoch": 1, "seconds": 6.0}),
        bound=80,
        optimizer_factory=sgd(0.1),
        max_epochs=2,
        strategy="all_reduce",
    )
    assert isinstance(outcome, lamploop.LoopState), f"{outcome!r}\n{output}"
    assert "error" not in record, record.get("traceback")
    reference = reference_run(
        [[slice(s * 8, s * 8 + 8)] for s in range(2)],
        [slice(30, 40)],
        factors=(1.0, 1.0),
        make_optimizer=sgd(0.1),
    )
    assert_curve(outcome, reference)
    assert_close(module, reference.module)
    # the replicated optimizer stepped the follower's copy alike
    assert_close({"weight": record["weight"], "bias": record["bias"]}, reference.module)


@pytest.mark.soak
@pytest.mark.timeout(90)
@pytest.mark.anyio
async def test_frozen_follower_process_ends_the_root_within_15_s_naming_it(tmp_path: Path) -> None:
    """DESIGN.md section 5: "a dead, frozen or cut-off rank ends every survivor within 15 s (default
    settings), naming the rank that failed" and "A joined peer that goes silent past the heartbeat
    timeout ends the run on every rank with an error that names it, instead of hanging in a
    collective." (the follower process is SIGSTOPped mid-run)."""
    frozen_at: list[float] = []

    def freeze(proc: subprocess.Popen, out: Path) -> None:
        wait_until(lambda: Path(f"{out}.joined").exists(), timeout=40, what="the follower joined")
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGSTOP)
        frozen_at.append(time.monotonic())

    spec = spec_for(sleep=None)
    spec["train"] = [batches * 20 for batches in spec["train"]]  # long epochs: the freeze lands mid-run
    outcome, _, _, output = await drive_with_follower(
        tmp_path,
        spec=spec,
        bound=70,
        during=freeze,
        optimizer_factory=sgd(0.01),
        max_epochs=10_000,
    )
    ended = time.monotonic()
    assert frozen_at, output
    assert isinstance(outcome, lamploop.errors.PeerLostError), f"{outcome!r}\n{output}"
    assert outcome.rank == 1
    assert "rank 1" in str(outcome)
    assert ended - frozen_at[0] < 15.0


# ---------------------------------------------------------------------------------------------
# Section 5: the TCP control channel in one process (real sockets).
# ---------------------------------------------------------------------------------------------

SPEC = model_spec(make_module())


async def tcp_follow(follower: lamploop.TcpControlFollower, seen: list) -> None:
    async with follower:
        rendezvous, commands = await follower.join()
        seen.append(rendezvous)
        async for command in commands:
            seen.append(command)


def raw_connect(port: int, payload: bytes, *, wait_s: float = 0.3) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        time.sleep(wait_s)  # let the root speak first (a challenge), then misbehave
        with contextlib.suppress(OSError):
            sock.sendall(payload)
            sock.settimeout(2)
            with contextlib.suppress(TimeoutError, OSError):
                sock.recv(65536)


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_tcp_root_refuses_strangers_and_still_runs(caplog: pytest.LogCaptureFixture) -> None:
    """DESIGN.md section 5: "A stranger, a wrong token, garbage bytes or an oversized frame is
    refused and logged; it never crashes or stalls the root." (then the real followers join and
    receive every command in order over TCP)."""
    caplog.set_level(logging.WARNING)
    token = "the shared token"
    sent = [lamploop.control.Train(0, 1.0), lamploop.control.Valid(0), lamploop.control.Stop("done")]
    seen: dict[int, list] = {1: [], 2: []}
    with anyio.fail_after(45):
        async with lamploop.TcpControlRoot(port=0, nranks=3, token=token, model_spec=SPEC) as root:
            port = root.address[1]
            # garbage, an oversized frame header, a silent stranger that hangs up
            await anyio.to_thread.run_sync(raw_connect, port, b"GET / HTTP/1.1\r\n\r\n")
            await anyio.to_thread.run_sync(raw_connect, port, struct.pack(">I", 1 << 30) + b"{")
            await anyio.to_thread.run_sync(raw_connect, port, b"")
            # a follower with a wrong token is refused
            with pytest.raises(lamploop.errors.TransportError):
                async with lamploop.TcpControlFollower(
                    host="127.0.0.1",
                    port=port,
                    rank=1,
                    nranks=3,
                    token="not the token",
                    model_spec=SPEC,
                    connect_timeout=10,
                ) as wrong:
                    await wrong.join()
            async with anyio.create_task_group() as group:
                for rank in (1, 2):
                    follower = lamploop.TcpControlFollower(
                        host="127.0.0.1", port=port, rank=rank, nranks=3, token=token, model_spec=SPEC
                    )
                    group.start_soon(tcp_follow, follower, seen[rank])
                rendezvous = lamploop.control.Rendezvous(host="127.0.0.1", port=29999)
                await root.on_rendezvous_ready(rendezvous)
                assert root.peers() == (1, 2)
                for command in sent:
                    await root.broadcast(command)
            refusals = list(root.recent_refusals)
    assert seen == {1: [rendezvous, *sent], 2: [rendezvous, *sent]}
    assert len(refusals) >= 3, refusals
    refused_lines = [
        r for r in caplog.records if r.name.startswith("lamploop") and r.levelno >= logging.WARNING
    ]
    assert len(refused_lines) >= 3, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("mismatch", ["world-size", "model-shape"])
@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_tcp_handshake_checks_world_size_and_model_fingerprint(mismatch: str) -> None:
    """DESIGN.md section 5: "a versioned handshake (protocol version, rank, world size, a
    fingerprint of parameter names and shapes, proof of a shared token)" (a follower whose world
    size or model differs is refused, with an error saying so, on both sides; nothing hangs)."""
    token = "t"
    other_spec = model_spec(torch.nn.Linear(4, 1, dtype=torch.float64))
    follower_keywords = (
        {"nranks": 3, "model_spec": SPEC}
        if mismatch == "world-size"
        else {
            "nranks": 2,
            "model_spec": other_spec,
        }
    )
    errors: list[BaseException] = []

    async def follow(port: int) -> None:
        try:
            async with lamploop.TcpControlFollower(
                host="127.0.0.1", port=port, rank=1, token=token, connect_timeout=10, **follower_keywords
            ) as follower:
                await follower.join()
        except lamploop.errors.TransportError as error:
            errors.append(error)

    root_error: BaseException | None = None
    try:
        with anyio.fail_after(40):
            async with (
                lamploop.TcpControlRoot(
                    port=0, nranks=2, token=token, model_spec=SPEC, join_timeout=20
                ) as root,
                anyio.create_task_group() as group,
            ):
                group.start_soon(follow, root.address[1])
                await root.on_rendezvous_ready(lamploop.control.Rendezvous("127.0.0.1", 1))
    except Exception as error:
        root_error = single(error)
    assert isinstance(root_error, lamploop.errors.HandshakeError), repr(root_error)
    assert words_for(mismatch) in str(root_error)
    assert len(errors) == 1, errors
    assert isinstance(errors[0], lamploop.errors.HandshakeError), repr(errors[0])
    assert words_for(mismatch) in str(errors[0])


def words_for(mismatch: str) -> str:
    return "nranks" if mismatch == "world-size" else "model"


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_tcp_follower_retries_until_the_root_listens() -> None:
    """DESIGN.md section 5: "followers retrying until the root listens"."""
    port = free_port()
    seen: list = []
    with anyio.fail_after(40):
        async with anyio.create_task_group() as group:
            follower = lamploop.TcpControlFollower(
                host="127.0.0.1", port=port, rank=1, nranks=2, token="t", model_spec=SPEC, connect_timeout=20
            )
            group.start_soon(tcp_follow, follower, seen)
            await anyio.sleep(1.0)  # the follower is already trying
            async with lamploop.TcpControlRoot(port=port, nranks=2, token="t", model_spec=SPEC) as root:
                await root.on_rendezvous_ready(lamploop.control.Rendezvous("127.0.0.1", 2))
                await root.broadcast(lamploop.control.Stop("done"))
    assert seen == [lamploop.control.Rendezvous("127.0.0.1", 2), lamploop.control.Stop("done")]


@pytest.mark.timeout(60)
@pytest.mark.anyio
async def test_tcp_follower_silent_past_heartbeat_timeout_is_named() -> None:
    """DESIGN.md section 5: "A joined peer that goes silent past the heartbeat timeout ends the run
    on every rank with an error that names it" (a follower whose connection stays open but whose
    event loop freezes, so that its heartbeats stop: the root's run ends, naming rank 1, within the
    timeout and a margin)."""
    token = "t"
    joined = threading.Event()
    release = threading.Event()
    port_box: list[int] = []

    def follower_thread() -> None:
        async def main() -> None:
            async with lamploop.TcpControlFollower(
                host="127.0.0.1",
                port=port_box[0],
                rank=1,
                nranks=2,
                token=token,
                model_spec=SPEC,
                heartbeat_interval=0.1,
                heartbeat_timeout=1.0,
            ) as follower:
                await follower.join()
                joined.set()
                release.wait(30)  # blocks this event loop: no heartbeat leaves

        with contextlib.suppress(Exception):
            anyio.run(main)

    thread = threading.Thread(target=follower_thread, daemon=True)
    started_at = float("inf")
    caught: BaseException | None = None
    try:
        with anyio.fail_after(40):
            async with lamploop.TcpControlRoot(
                port=0, nranks=2, token=token, model_spec=SPEC, heartbeat_interval=0.1, heartbeat_timeout=1.0
            ) as root:
                port_box.append(root.address[1])
                thread.start()
                await root.on_rendezvous_ready(lamploop.control.Rendezvous("127.0.0.1", 3))
                await anyio.to_thread.run_sync(joined.wait, 20)
                started_at = time.monotonic()
                for epoch in range(200):
                    await root.broadcast(lamploop.control.Train(epoch, 1.0))
                    await anyio.sleep(0.1)
    except Exception as error:
        caught = error
    finally:
        release.set()
        if thread.is_alive() or thread.ident is not None:
            await anyio.to_thread.run_sync(thread.join, 20)
    assert caught is not None, "the root's run did not end"
    lost = single(caught)
    assert isinstance(lost, lamploop.errors.PeerLostError), repr(caught)
    assert lost.rank == 1
    assert "rank 1" in str(lost)
    assert time.monotonic() - started_at < 10.0


# ---------------------------------------------------------------------------------------------
# Section 6: checkpoints.
# ---------------------------------------------------------------------------------------------

PLATEAU = {"patience": 0, "reduce_factor": 0.5}


def plateau_factors(losses: Sequence[float]) -> list[float]:
    """reduce_lr_on_plateau(patience=0, reduce_factor=0.5) as docs/concepts/loop-state.md has it:
    the factor halves after each validation that does not improve strictly on the best so far."""
    factor, best, factors = 1.0, None, [1.0]
    for loss in losses:
        if best is None or loss < best:
            best = loss
        else:
            factor *= 0.5
        factors.append(factor)
    return factors


def adam_reference(n_epochs: int) -> tuple[torch.nn.Module, list[float]]:
    """Adam over 2 steps per epoch with the plateau factors, float64, written apart from lamploop."""
    module = make_module()
    optimizer = torch.optim.Adam(module.parameters(), lr=0.05)
    raws: list[float] = []
    for epoch in range(n_epochs):
        optimizer.param_groups[0]["lr"] = 0.05 * plateau_factors(raws)[epoch]
        for part in (slice(0, 5), slice(5, 10)):
            optimizer.zero_grad()
            F.mse_loss(module(X[part]), Y[part], reduction="mean").backward()
            optimizer.step()
        raws.append(mean_loss(module, [slice(30, 36)]))
    return module, raws


async def drive_adam(
    max_epochs: int, checkpoint_root: Path | None, **keywords: Any
) -> tuple[torch.nn.Module, lamploop.LoopState]:
    module = make_module()

    async def checkpoint(data: lamploop.LoopStateWithModelAndOptimizerData, schedule_state: Any) -> None:
        assert checkpoint_root is not None
        await anyio.to_thread.run_sync(
            lambda: save_checkpoint(checkpoint_root, data, schedule_state=schedule_state, keep_last=2)
        )

    with anyio.fail_after(50):
        final = await lamploop.drive_distributed_training(
            nranks=1,
            device="cpu",
            control=None,
            model=lamploop.SupervisedModel(module, squared_error),
            optimizer_factory=lambda p: torch.optim.Adam(p, lr=0.05),
            train_batches=per_rank_factory([[slice(0, 5), slice(5, 10)]]),
            validation_batches=per_rank_factory([[slice(30, 36)]]),
            max_epochs=max_epochs,
            checkpoint_state=None if checkpoint_root is None else checkpoint,
            learning_rate_schedule=lamploop.reduce_lr_on_plateau(**PLATEAU),
            return_min_validation_loss_model=(),
            **keywords,
        )
    return module, final


@pytest.fixture
def adam_run(tmp_path: Path) -> tuple[Path, torch.nn.Module, lamploop.LoopState]:
    root = tmp_path / "run"
    module, final = anyio.run(drive_adam, 4, root)
    return root, module, final


@pytest.mark.timeout(60)
def test_checkpoint_directory_is_safetensors_and_json_with_sha256(
    adam_run: tuple[Path, torch.nn.Module, lamploop.LoopState],
) -> None:
    """DESIGN.md section 6: "A directory per checkpoint: a JSON descriptor (cattrs: loop state,
    schedule state, RNG states, format version, per-file sha256) beside safetensors files (model,
    optimizer tensors, best model). Never pickle. Written to a temporary name, fsynced and renamed,
    with a `latest` pointer; old ones pruned by a `keep_last`."."""
    root, module, final = adam_run
    entries = sorted(p.name for p in root.iterdir())
    assert not [name for name in entries if name.startswith(".")], entries  # no temporary left
    assert "latest" in entries
    directories = [root / name for name in entries if (root / name).is_dir()]
    assert len(directories) == 2  # keep_last=2 of 4 epochs
    newest = root / (root / "latest").read_text().strip()
    assert newest in directories
    for directory in directories:
        descriptors = [p for p in directory.iterdir() if p.suffix == ".json"]
        assert len(descriptors) == 1, list(directory.iterdir())
        text = descriptors[0].read_text()
        descriptor = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
        assert isinstance(descriptor.get("format_version"), int)
        assert "loop_state" in descriptor
        assert "schedule_state" in descriptor
        assert "rng" in descriptor
        hashed = descriptor_hashes(descriptor)
        tensors = [p for p in directory.iterdir() if p != descriptors[0]]
        assert tensors
        assert all(p.suffix == ".safetensors" for p in tensors), tensors
        assert {p.name for p in tensors} <= set(hashed), (hashed, tensors)
        for path in tensors:
            data = path.read_bytes()
            assert not data.startswith((b"\x80", b"PK")), path  # neither pickle nor torch.save's zip
            assert hashed[path.name] == hashlib.sha256(data).hexdigest(), path
            with safe_open(str(path), framework="pt") as opened:
                list(opened.keys())
    # the newest holds the final model and the run's loop state
    descriptor = json.loads(next(p for p in newest.iterdir() if p.suffix == ".json").read_text())
    assert descriptor["loop_state"]["epoch"] == final.epoch == 4
    model_files = [p for p in newest.iterdir() if p.name.startswith("model")]
    assert len(model_files) == 1
    with safe_open(str(model_files[0]), framework="pt") as opened:
        saved = {name: opened.get_tensor(name) for name in opened.keys()}  # noqa: SIM118
    assert_bitwise(saved, module)


def descriptor_hashes(descriptor: Any) -> dict[str, str]:
    """Every file name the descriptor gives a sha256 for (wherever it keeps them)."""
    found: dict[str, str] = {}

    def walk(value: Any, key: str | None) -> None:
        if isinstance(value, dict):
            if "sha256" in value and key is not None:
                found[key] = value["sha256"]
            for k, v in value.items():
                walk(v, k)
        elif isinstance(value, list):
            for v in value:
                walk(v, key)

    walk(descriptor, None)
    return found


@pytest.mark.timeout(60)
def test_resume_at_epoch_k_equals_uninterrupted_run_and_reference(
    adam_run: tuple[Path, torch.nn.Module, lamploop.LoopState], tmp_path: Path
) -> None:
    """DESIGN.md section 6: "Resuming at epoch k and training on gives the same parameters as a run
    that was never interrupted."; section 3: "`checkpoint_state` receives the schedule state that
    the next epoch will use" (Adam's state and a plateau schedule's state through safetensors and
    JSON; the uninterrupted run equals a float64 reference)."""
    root, module, final = adam_run
    reference, raws = adam_reference(4)
    assert_close(module, reference)
    assert [e.validation_loss[1] for e in final.learning_curve] == pytest.approx(raws, rel=1e-12)
    oldest = sorted(p for p in root.iterdir() if p.is_dir())[0]  # epoch 3's start
    checkpoint = load_checkpoint(
        oldest, schedule=lamploop.reduce_lr_on_plateau(**PLATEAU), model=make_module()
    )
    assert checkpoint.state.loop_state.epoch == 3
    assert checkpoint.state.loop_state.learning_curve == final.learning_curve[:3]
    torch.manual_seed(12345)  # whatever the process's RNG, the resumed run is the same
    resumed, resumed_final = anyio.run(
        lambda: drive_adam(
            4,
            None,
            init_state=checkpoint.state,
            learning_rate_schedule_init_state=checkpoint.schedule_state,
        )
    )
    assert resumed_final == final
    assert_bitwise(resumed, module)


@pytest.mark.parametrize("fault", ["missing-optimizer", "truncated-model", "no-descriptor", "wrong-model"])
@pytest.mark.timeout(60)
def test_loading_a_damaged_checkpoint_is_a_clear_error(
    adam_run: tuple[Path, torch.nn.Module, lamploop.LoopState], fault: str
) -> None:
    """DESIGN.md section 6: "Loading validates and raises a clear error on anything missing,
    truncated or mismatched." (a checkpoint directory named explicitly)."""
    root, _, _ = adam_run
    directory = sorted(p for p in root.iterdir() if p.is_dir())[-1]
    model: torch.nn.Module = make_module()
    if fault == "missing-optimizer":
        victim = next(p for p in directory.iterdir() if p.name.startswith("optimizer"))
        victim.unlink()
        expected = victim.name
    elif fault == "truncated-model":
        victim = next(p for p in directory.iterdir() if p.name.startswith("model"))
        victim.write_bytes(victim.read_bytes()[:-7])
        expected = victim.name
    elif fault == "no-descriptor":
        victim = next(p for p in directory.iterdir() if p.suffix == ".json")
        victim.unlink()
        expected = victim.name
    else:
        model = torch.nn.Linear(4, 1, dtype=torch.float64)
        expected = "weight"
    with pytest.raises(lamploop.errors.CheckpointError, match=expected.replace(".", r"\.")):
        load_checkpoint(directory, schedule=lamploop.reduce_lr_on_plateau(**PLATEAU), model=model)


def step_fit(
    checkpoint_dir: Path, seed: int, max_epochs: int = 2, **keywords: Any
) -> tuple[torch.nn.Module, Any, list]:
    """fit on one rank: a model with dropout (so the RNG matters), shuffled batches."""
    torch.manual_seed(seed)
    module = torch.nn.Sequential(
        torch.nn.Linear(3, 8, dtype=torch.float64),
        torch.nn.Dropout(0.5),
        torch.nn.Linear(8, 1, dtype=torch.float64),
    )
    contexts: list = []
    batches = lamploop.tensor_batches(X[:24], Y[:24], batch_size=4, seed=3)

    def train(context: lamploop.BatchContext) -> Any:
        contexts.append(context.epoch)
        return batches(context)

    state = lamploop.fit(
        model=lamploop.SupervisedModel(module, squared_error),
        optimizer_factory=lambda p: torch.optim.Adam(p, lr=0.01),
        train_batches=train,
        max_epochs=max_epochs,
        checkpoint_dir=checkpoint_dir,
        device="cpu",
        reporters=[],
        **keywords,
    )
    return module, state, contexts


@pytest.mark.timeout(90)
def test_step_boundary_checkpoint_resumes_bitwise_on_cpu(tmp_path: Path) -> None:
    """DESIGN.md section 6: "A checkpoint may also be taken at a step boundary inside an epoch (on
    SIGTERM, or every N steps): it records the position in the epoch, and resuming from it is
    bitwise equal to the uninterrupted run on CPU; every rank's RNG state is kept."."""
    full_dir = tmp_path / "full"
    full, full_state, _ = step_fit(full_dir, seed=0, checkpoint_every_n_steps=2, keep_last=None)
    names = sorted(p.name for p in full_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    inside = [name for name in names if "step" in name]
    assert inside, names
    chosen = inside[len(inside) // 2]  # a step boundary in the middle of the run
    descriptor = json.loads((full_dir / chosen / "checkpoint.json").read_text())
    assert descriptor.get("position"), descriptor.keys()  # "it records the position in the epoch"
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(full_dir / chosen, resumed_dir / chosen)
    (resumed_dir / "latest").write_text(chosen + "\n")
    resumed, resumed_state, contexts = step_fit(
        resumed_dir, seed=99, checkpoint_every_n_steps=2, keep_last=None
    )
    assert contexts[0] == descriptor["position"]["epoch"]
    assert_bitwise(resumed, full)
    assert resumed_state == full_state


@pytest.mark.timeout(60)
def test_a_restarted_job_resumes_from_the_latest_checkpoint_by_itself(tmp_path: Path) -> None:
    """DESIGN.md section 7: "A restarted job resumes from the latest checkpoint by itself." (the
    same script run again over the same checkpoint directory trains only the epochs still to run
    and ends where one uninterrupted run ends)."""
    _, first_state, first_contexts = step_fit(tmp_path / "a", seed=0, max_epochs=2)
    again, again_state, again_contexts = step_fit(tmp_path / "a", seed=5, max_epochs=3)
    whole, whole_state, _ = step_fit(tmp_path / "b", seed=0, max_epochs=3)
    assert first_contexts == [0, 1]
    assert again_contexts == [2]
    assert again_state.learning_curve[:2] == first_state.learning_curve
    assert again_state == whole_state
    assert_bitwise(again, whole)


# ---------------------------------------------------------------------------------------------
# Sections 7 and 8: launchers, stop requests, bounded waits (processes of their own).
# ---------------------------------------------------------------------------------------------


@pytest.mark.soak
@pytest.mark.timeout(90)
def test_sigterm_ends_a_run_that_waits_for_data(tmp_path: Path) -> None:
    """DESIGN.md section 8: "a stop request (SIGTERM, SIGINT) ends it after the step in progress,
    also when no step is in progress because the run waits for data." (fit on a stream that yields
    two batches, then waits for a producer that never comes; SIGTERM ends the process)."""
    out = tmp_path / "stall"
    with started(["stall", str(out)], tmp_path / "stall.log") as proc:
        wait_until(
            lambda: Path(f"{out}.waiting").exists() or proc.poll() is not None,
            timeout=60,
            what="the run waits for data",
        )
        assert proc.poll() is None, (tmp_path / "stall.log").read_text()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("SIGTERM did not end a run that waits for data within 10 s")
        assert time.monotonic() - sent < 10
    log = (tmp_path / "stall.log").read_text(errors="replace")
    record = load_record(out) if out.exists() else {}
    assert record.get("epoch") != 3, (record, log)  # it stopped, it did not run on
    # Gracefully, at the boundary where it waited: the step of the batch it held was taken.
    assert "TrainingInterrupted: stopped by SIGTERM at epoch 0 after step 2" in record.get("error", ""), (
        record,
        log,
    )


@pytest.mark.soak
@pytest.mark.timeout(120)
def test_torchrun_two_ranks_read_rank_and_world_size(tmp_path: Path) -> None:
    """DESIGN.md section 7: "Processes are started by `torchrun` ...; lamploop reads RANK /
    WORLD_SIZE / LOCAL_RANK and decides root or follower." (two ranks under torchrun on one
    machine, fit() in each; the root's result equals the float64 reference of the whole data)."""
    spec = spec_for(lr=0.1, max_epochs=2)
    spec["train"] = [[[X[s], Y[s]] for s in ([slice(0, 4)], [slice(4, 8)])[r]] for r in range(2)]
    spec_path = tmp_path / "spec"
    save_record(spec, spec_path)
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(WORKER),
        "torchrun",
        str(spec_path),
        str(out),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    with (tmp_path / "torchrun.log").open("wb") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        rc = proc.wait(timeout=100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    text = (tmp_path / "torchrun.log").read_text(errors="replace")
    assert rc == 0, text[-4000:]
    root, follower = load_record(f"{out}.rank0"), load_record(f"{out}.rank1")
    assert "error" not in root, root.get("traceback")
    assert "error" not in follower, follower.get("traceback")
    assert root["state_epoch"] == 2
    assert [tuple(c) for c in root["contexts"]] == [(0, 0, 2), (1, 0, 2)]
    assert [tuple(c) for c in follower["contexts"]] == [(0, 1, 2), (1, 1, 2)]
    reference = reference_run([[slice(0, 8)]], None, factors=[1.0, 1.0], make_optimizer=sgd(0.1))
    assert root["losses"] == pytest.approx([c[1] for c in reference.curve], rel=1e-12)
    assert_close({"weight": root["weight"], "bias": root["bias"]}, reference.module)
