"""Hostile inputs, round 4: the core API as a new user meets it from the docs alone.

Every case is a call, the lamploop error it must raise (or a subclass) and a pattern its message
must match (case-insensitive), within a time bound. The cases go past the earlier sweeps
(tests/test_acceptance_bad_inputs_sweep.py, tests/test_review_bad_inputs.py,
tests/test_mistakes.py, tests/test_arguments.py): wrong types of the less common keywords,
bad batches in the middle of an epoch, callbacks that raise, files where directories belong,
launch commands that cannot start, reporters pointed at the wrong place, the ``lamploop`` CLI.
Where the behaviour contradicts the docs or the promise ("every bad input gets a clear error
that says what was wrong and where ... nothing is lost and nothing hangs") the case is kept
and marked ``xfail(strict=True)`` with DEFECT in its reason. Tiny CPU tensors; real files,
real processes; every wait bounded.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import lamploop
import lamploop.averaging as averaging
import lamploop.metrics as metrics
import lamploop.reporting as reporting
from lamploop.errors import BatchError, CheckpointError, ConfigurationError, LamploopError
from lamploop.state import LoopState, LoopStateWithModelAndOptimizerData

NAN = math.nan
INF = math.inf
BOUND_S = 30.0  # generous: a loaded 2-core machine

torch.manual_seed(0)
X, Y = torch.randn(16, 4), torch.randint(0, 2, (16,))
X8, Y8 = X[:8], Y[:8]


# ----------------------------------------------------------------------------- helpers


class Boom(Exception):
    """What the user's callbacks raise: it must come out as itself."""


def _raiser(*_: Any, **__: Any) -> Any:
    raise Boom("boom from the user's callback")


async def _async_raiser(*_: Any, **__: Any) -> Any:
    raise Boom("boom from the user's callback")


def _module() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(4, 2)


def _model(**changes: Any) -> lamploop.SupervisedModel:
    module = changes.pop("module") if "module" in changes else _module()
    return lamploop.SupervisedModel(module, **changes)


def _batches() -> lamploop.BatchStreamFactory:
    return lamploop.tensor_batches(X, Y, batch_size=8)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _fit(**changes: Any) -> Any:
    kwargs: dict[str, Any] = {
        "model": _model(),
        "optimizer_factory": _sgd,
        "train_batches": _batches(),
        "max_epochs": 1,
        "reporters": [],
        "device": "cpu",
    }
    kwargs.update(changes)
    return lamploop.fit(**kwargs)


def _fit_valid(**changes: Any) -> Any:
    return _fit(validation_batches=_batches(), **changes)


def _listed(*batches: Any) -> lamploop.BatchStreamFactory:
    """A factory whose every epoch is exactly ``batches``, whatever they are."""
    return lamploop.iterable_batches(lambda context: list(batches))


def _run(make: Callable[[], Any]) -> Any:
    async def main() -> Any:
        with anyio.fail_after(BOUND_S):
            return await make()

    return anyio.run(main)


def _drive(**changes: Any) -> Any:
    kwargs: dict[str, Any] = {
        "nranks": 1,
        "device": "cpu",
        "control": None,
        "model": _model(),
        "optimizer_factory": _sgd,
        "train_batches": _batches(),
        "validation_batches": None,
        "max_epochs": 1,
    }
    kwargs.update(changes)
    return _run(lambda: lamploop.drive_distributed_training(**kwargs))


def _local(replicas: Any, **changes: Any) -> Any:
    kwargs: dict[str, Any] = {"optimizer_factory": _sgd, "max_epochs": 1}
    kwargs.update(changes)
    return _run(lambda: lamploop.local_data_parallel_training_loop(replicas, **kwargs))


def _stream(*batches: Any) -> Any:
    async def stream() -> Any:
        for batch in batches:
            yield batch

    return stream()


def _one_epoch(batches: Any, **changes: Any) -> Any:
    model = changes.pop("model", _model())
    return _run(lambda: lamploop.one_epoch(model=model, batches=batches, **changes))


def _epochs(**changes: Any) -> Any:
    async def train(factor: float) -> float:
        return 1.0

    async def validate() -> float:
        return 1.0

    async def nothing() -> None:
        return None

    kwargs: dict[str, Any] = {
        "max_epochs": 2,
        "train_epoch": train,
        "validation_epoch": validate,
        "save_min_validation_loss_model": nothing,
    }
    kwargs.update(changes)
    return _run(lambda: lamploop.epochs(**kwargs))


async def _awaitable(value: Any) -> Any:
    return value


def _state() -> LoopStateWithModelAndOptimizerData:
    module = _module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    return LoopStateWithModelAndOptimizerData(LoopState(epoch=1), module.state_dict(), optimizer.state_dict())


def _saved(directory: Path, module: torch.nn.Module | None = None) -> Path:
    module = module if module is not None else _module()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    state = LoopStateWithModelAndOptimizerData(
        LoopState(epoch=1), module.state_dict(), optimizer.state_dict()
    )
    return lamploop.save_checkpoint(directory, state)


def _a_file(tmp: Path, name: str = "a-file") -> Path:
    path = tmp / name
    path.write_text("not a directory\n")
    return path


def _closed_stream() -> io.StringIO:
    stream = io.StringIO()
    stream.close()
    return stream


class _BadStep:
    """A step schedule whose factor at (epoch 0, step 2) is ``value``."""

    def __init__(self, value: object) -> None:
        self.value = value

    def factor(self, epoch: int, step: int) -> object:
        return self.value if (epoch, step) == (0, 2) else 1.0


class _RaisingStep:
    def factor(self, epoch: int, step: int) -> float:
        raise Boom(f"step schedule failed at epoch {epoch}, step {step}")


class _Forward(torch.nn.Module):
    """A module whose forward returns ``wrap(linear(x))``."""

    def __init__(self, wrap: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> Any:
        return self.wrap(self.linear(x))


class _NotAReporter:
    pass


def _sum_loss(count: Any) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    def loss(output: torch.Tensor, target: torch.Tensor) -> Any:
        return torch.nn.functional.cross_entropy(output, target, reduction="sum"), count

    return loss


def _foreign_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)


def _optimizer_failing_on_second_replica() -> Callable[[Any], torch.optim.Optimizer]:
    made: list[int] = []

    def factory(params: Any) -> torch.optim.Optimizer:
        made.append(1)
        if len(made) == 2:
            raise Boom("optimizer factory failed on the second replica")
        return _sgd(params)

    return factory


# ----------------------------------------------------------------------------- the sweep


def case(
    name: str,
    call: Callable[[Path], object],
    pattern: str,
    error: type[BaseException] = ConfigurationError,
    defect: str | None = None,
) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=f"DEFECT: {defect}")] if defect else []
    return pytest.param(call, error, pattern, id=name, marks=marks)


CASES = [
    # ---- fit: the less common keywords, wrong types
    case("fit max_epochs True", lambda _: _fit(max_epochs=True), "max_epochs.*True"),
    case("fit max_epochs '2'", lambda _: _fit(max_epochs="2"), "max_epochs"),
    case("fit keep_last -1", lambda t: _fit(checkpoint_dir=t / "c", keep_last=-1), "keep_last"),
    case("fit resume 'yes'", lambda _: _fit(resume="yes"), "resume"),
    case(
        "fit validation_frequency 1.5", lambda _: _fit_valid(validation_frequency=1.5), "validation_frequency"
    ),
    case(
        "fit return_min_validation_loss_model an int",
        lambda _: _fit_valid(return_min_validation_loss_model=5),
        "return_min_validation_loss_model",
    ),
    case(
        "fit smoothing factor 0",
        lambda _: _fit_valid(validation_loss_exponential_smoothing_factor=0.0),
        "validation_loss_exponential_smoothing_factor",
    ),
    case(
        "fit smoothing factor 1.5",
        lambda _: _fit_valid(validation_loss_exponential_smoothing_factor=1.5),
        "validation_loss_exponential_smoothing_factor",
    ),
    case(
        "fit accumulate 2.5",
        lambda _: _fit(accumulate_gradient_over_n_batches=2.5),
        "accumulate_gradient_over_n_batches",
    ),
    case("fit device None", lambda _: _fit(device=None), "device"),
    case("fit on_epoch an int", lambda _: _fit(on_epoch=5), "on_epoch"),
    case("fit on_epoch raises", lambda _: _fit(on_epoch=_raiser), "boom", Boom),
    case("fit world_size 1.5", lambda _: _fit(world_size=1.5), "world_size"),
    case("fit strategy None", lambda _: _fit(strategy=None), "strategy"),
    case(
        "fit launch_command a str",
        lambda _: _fit(world_size=2, launch_command="python train.py"),
        "launch_command",
    ),
    case(
        "fit launch_command of ints",
        lambda _: _fit(world_size=2, launch_command=[1, 2]),
        "launch_command",
    ),
    case(
        "fit launch_command empty",
        lambda _: _fit(world_size=2, launch_command=[]),
        "launch_command",
    ),
    case(
        "fit launch_command a missing program",
        lambda _: _fit(world_size=2, launch_command=["/nonexistent/python9"]),
        "launch_command.*python9|python9.*launch_command",
        LamploopError,
    ),
    case(
        "fit launch_command ['']",
        lambda _: _fit(world_size=2, launch_command=[""]),
        "launch_command",
    ),
    case("fit bucket_cap_mb inf", lambda _: _fit(bucket_cap_mb=INF), "bucket_cap_mb"),
    case("fit collective_timeout 0", lambda _: _fit(collective_timeout=0), "collective_timeout"),
    case("fit heartbeat_interval 0", lambda _: _fit(heartbeat_interval=0), "heartbeat_interval"),
    case(
        "fit heartbeat_interval above heartbeat_timeout",
        lambda _: _fit(heartbeat_interval=5.0, heartbeat_timeout=1.0),
        "heartbeat_timeout.*heartbeat_interval",
    ),
    case("fit reporters one reporter", lambda _: _fit(reporters=reporting.LoggingReporter()), "reporters"),
    case("fit reporters a str", lambda _: _fit(reporters="logging"), "reporters"),
    case(
        "fit checkpoint_every_n_steps without a dir",
        lambda _: _fit(checkpoint_every_n_steps=1),
        "checkpoint_every_n_steps.*checkpoint_dir",
    ),
    case(
        "fit checkpoint_every_seconds nan",
        lambda t: _fit(checkpoint_dir=t / "c", checkpoint_every_seconds=NAN),
        "checkpoint_every_seconds",
    ),
    case("fit max_gradient_norm inf", lambda _: _fit(max_gradient_norm=INF), "max_gradient_norm"),
    case(
        "fit lr_scheduler_interval 'batch'",
        lambda _: _fit(
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1), lr_scheduler_interval="batch"
        ),
        "lr_scheduler_interval",
    ),
    case("fit lr_scheduler returns an int", lambda _: _fit(lr_scheduler=lambda o: 5), "lr_scheduler"),
    case("fit lr_scheduler raises", lambda _: _fit(lr_scheduler=_raiser), "boom", Boom),
    case("fit model_selection_metric unknown", lambda _: _fit_valid(model_selection_metric="f1"), "'f1'"),
    case(
        "fit model_selection_mode unknown",
        lambda _: _fit_valid(model_selection_mode="biggest"),
        "model_selection_mode",
    ),
    case(
        "fit model_selection_metric without validation",
        lambda _: _fit(
            model=_model(metrics={"accuracy": metrics.accuracy}),
            model_selection_metric="accuracy",
            model_selection_mode="max",
        ),
        "model_selection_metric.*validation",
    ),
    case(
        "fit early_stopping_patience 1.5", lambda _: _fit_valid(early_stopping_patience=1.5), "early_stopping"
    ),
    case(
        "fit early_stopping_patience without validation",
        lambda _: _fit(early_stopping_patience=2),
        "early_stopping_patience.*validation_batches",
    ),
    case("fit checkpoint_extras an int", lambda _: _fit(checkpoint_extras=5), "checkpoint_extras"),
    case(
        "fit checkpoint_extras holds an int",
        lambda t: _fit(checkpoint_dir=t / "c", checkpoint_extras={"counter": 5}),
        "checkpoint_extras\\['counter'\\]",
    ),
    case("fit checkpoint_dir an int", lambda _: _fit(checkpoint_dir=5), "checkpoint_dir"),
    case(
        "fit checkpoint_dir under a file",
        lambda t: _fit(checkpoint_dir=_a_file(t) / "sub"),
        "a-file",
        LamploopError,
    ),
    case(
        "fit checkpoint_dir holds another model's checkpoint",
        lambda t: (_saved(t / "other", torch.nn.Linear(5, 2)), _fit(checkpoint_dir=t / "other")),
        "model.safetensors.*weight",
        CheckpointError,
    ),
    case(
        "fit checkpoint_dir holds another optimizer's checkpoint",
        lambda t: (
            _fit(checkpoint_dir=t / "adam", optimizer_factory=lambda p: torch.optim.Adam(p)),
            _fit(max_epochs=2, checkpoint_dir=t / "adam"),
        ),
        "SGD.*momentum",
        CheckpointError,
    ),
    # ---- the optimizer factory, the loss, the model's forward, the metrics
    case("fit optimizer_factory returns None", lambda _: _fit(optimizer_factory=lambda p: None), "return"),
    case("fit optimizer_factory raises", lambda _: _fit(optimizer_factory=_raiser), "boom", Boom),
    case(
        "fit optimizer_factory takes nothing",
        lambda _: _fit(optimizer_factory=lambda: None),
        "optimizer_factory",
    ),
    case(
        "fit optimizer over parameters that are not the model's",
        lambda _: _fit(optimizer_factory=_foreign_optimizer),
        "optimizer_factory",
    ),
    case(
        "fit loss returns a per-example tensor",
        lambda _: _fit(model=_model(loss=_sum_loss_none())),
        "shape \\(8,\\)",
    ),
    case(
        "fit loss detaches",
        lambda _: _fit(model=_model(loss=lambda o, y: (torch.tensor(1.0), len(y)))),
        "epoch 0, batch 0.*grad",
    ),
    case("fit loss returns None", lambda _: _fit(model=_model(loss=lambda o, y: None)), "NoneType"),
    case("fit loss count a str", lambda _: _fit(model=_model(loss=_sum_loss("8"))), "example count"),
    case(
        "fit loss counts 0", lambda _: _fit(model=_model(loss=_sum_loss(0))), "epoch 0, batch 0", BatchError
    ),
    case(
        "fit forward returns a tuple",
        lambda _: _fit(model=_model(module=_Forward(lambda z: (z, z)))),
        "epoch 0, batch 0.*tuple",
        BatchError,
    ),
    case(
        "fit forward returns a dict",
        lambda _: _fit(model=_model(module=_Forward(lambda z: {"out": z}))),
        "epoch 0, batch 0.*dict",
        BatchError,
    ),
    case(
        "fit a module without parameters",
        lambda _: _fit(model=_model(module=torch.nn.Identity())),
        "no parameters",
    ),
    case(
        "fit a frozen module",
        lambda _: _fit(model=_model(module=_module().requires_grad_(False))),
        "frozen",
    ),
    case(
        "fit metric returns a mean",
        lambda _: _fit(model=_model(metrics={"m": lambda o, y: torch.tensor(1.0)})),
        "metric 'm'",
    ),
    case(
        "fit metric raises",
        lambda _: _fit(model=_model(metrics={"m": _raiser})),
        "epoch 0, batch 0.*metric.*boom",
        BatchError,
    ),
    case("SupervisedModel metrics a list", lambda _: _model(metrics=[metrics.accuracy]), "metrics"),
    case("SupervisedModel metrics a function", lambda _: _model(metrics=metrics.accuracy), "metrics"),
    case("SupervisedModel metric an int", lambda _: _model(metrics={"m": 5}), "metrics\\['m'\\]"),
    case("SupervisedModel loss a str", lambda _: _model(loss="cross_entropy"), "loss"),
    case(
        "SupervisedModel metric named ''",
        lambda _: _model(metrics={"": metrics.accuracy}),
        "metric",
    ),
    # ---- batches: bad ones in the middle of an epoch
    case(
        "fit wrong feature width at batch 2",
        lambda _: _fit(train_batches=_listed((X8, Y8), (X8, Y8), (torch.randn(8, 5), Y8))),
        "epoch 0, batch 2",
        BatchError,
    ),
    case(
        "fit float target at batch 1",
        lambda _: _fit(train_batches=_listed((X8, Y8), (X8, Y8.float()))),
        "epoch 0, batch 1.*dtype",
        BatchError,
    ),
    case(
        "fit short target at batch 1",
        lambda _: _fit(train_batches=_listed((X8, Y8), (X8, Y[:5]))),
        "epoch 0, batch 1.*8.*5",
        BatchError,
    ),
    case(
        "fit integer features",
        lambda _: _fit(train_batches=_listed((X8.long(), Y8))),
        "epoch 0, batch 0",
        BatchError,
    ),
    case(
        "fit a dict batch",
        lambda _: _fit(train_batches=_listed({"x": X8, "y": Y8})),
        "epoch 0, batch 0.*pair.*dict",
        BatchError,
    ),
    case(
        "fit a bad validation batch says it is validation",
        lambda _: _fit(validation_batches=_listed((X8, Y8), (torch.randn(8, 3), Y8))),
        "validation.*batch 1|batch 1.*validation",
        BatchError,
    ),
    case(
        "fit drop_last leaves every epoch empty",
        lambda _: _fit(train_batches=lamploop.tensor_batches(X, Y, batch_size=32, drop_last=True)),
        "epoch 0.*empty",
        BatchError,
    ),
    case(
        "fit a consumed iterator reused in epoch 1",
        lambda _: _fit(max_epochs=2, train_batches=_once(iter([(X8, Y8)]))),
        "epoch 1.*empty",
        BatchError,
    ),
    case(
        "tensor_batches features a list",
        lambda _: lamploop.tensor_batches(X.tolist(), Y, batch_size=4),
        "features",
    ),
    case("tensor_batches target None", lambda _: lamploop.tensor_batches(X, None, batch_size=4), "target"),
    case("tensor_batches rows differ", lambda _: lamploop.tensor_batches(X, Y[:10], batch_size=4), "16.*10"),
    case(
        "tensor_batches batch_size 2.0", lambda _: lamploop.tensor_batches(X, Y, batch_size=2.0), "batch_size"
    ),
    case(
        "tensor_batches shuffle 'yes'",
        lambda _: lamploop.tensor_batches(X, Y, batch_size=4, shuffle="yes"),
        "shuffle",
    ),
    case(
        "tensor_batches drop_last 'no'",
        lambda _: lamploop.tensor_batches(X, Y, batch_size=4, drop_last="no"),
        "drop_last",
    ),
    case(
        "iterable_batches make returns None",
        lambda _: _fit(train_batches=lamploop.iterable_batches(lambda context: None)),
        "iterable_batches.*epoch 0",
    ),
    case(
        "iterable_batches make raises",
        lambda _: _fit(train_batches=lamploop.iterable_batches(_raiser)),
        "boom",
        Boom,
    ),
    case(
        "iterable_batches make takes no context",
        lambda _: _fit(train_batches=lamploop.iterable_batches(lambda: [(X8, Y8)])),
        "iterable_batches|make|context",
    ),
    case("train_batches factory raises", lambda _: _fit(train_batches=_raiser), "boom", Boom),
    case(
        "train_batches returns a generator",
        lambda _: _fit(train_batches=lambda context: iter([(X8, Y8)])),
        "train_batches.*epoch 0.*iterable_batches",
    ),
    case(
        "dataloader_batches factory returns a list",
        lambda _: _fit(train_batches=lamploop.dataloader_batches(lambda context: [(X8, Y8)])),
        "DataLoader",
    ),
    case(
        "dataloader_batches seed '1'",
        lambda _: lamploop.dataloader_batches(
            torch.utils.data.DataLoader(list(zip(X, Y, strict=True))), seed="1"
        ),
        "seed",
    ),
    case(
        "dataloader_batches of dicts",
        lambda _: _fit(
            train_batches=lamploop.dataloader_batches(
                torch.utils.data.DataLoader(
                    [{"x": a, "y": b} for a, b in zip(X, Y, strict=True)], batch_size=4
                )
            )
        ),
        "epoch 0, batch 0.*dict",
        BatchError,
    ),
    case(
        "dataloader_batches batch_size None",
        lambda _: _fit(
            train_batches=lamploop.dataloader_batches(
                torch.utils.data.DataLoader(list(zip(X, Y, strict=True)), batch_size=None)
            )
        ),
        "epoch 0, batch 0.*target",
        BatchError,
    ),
    # ---- one_epoch
    case(
        "one_epoch step_optimizer an int",
        lambda _: _one_epoch(_stream((X8, Y8)), step_optimizer=5),
        "step_optimizer",
    ),
    case(
        "one_epoch step_optimizer raises",
        lambda _: _one_epoch(_stream((X8, Y8)), step_optimizer=_raiser),
        "boom",
        Boom,
    ),
    case(
        "one_epoch before_step raises",
        lambda _: _one_epoch(_stream((X8, Y8)), step_optimizer=lambda: None, before_step=_raiser),
        "boom",
        Boom,
    ),
    case(
        "one_epoch after_step raises",
        lambda _: _one_epoch(_stream((X8, Y8)), step_optimizer=lambda: None, after_step=_raiser),
        "boom",
        Boom,
    ),
    case(
        "one_epoch after_step an int",
        lambda _: _one_epoch(_stream((X8, Y8)), step_optimizer=lambda: None, after_step=5),
        "after_step",
    ),
    case(
        "one_epoch forward_only 'yes'",
        lambda _: _one_epoch(_stream((X8, Y8)), forward_only="yes"),
        "forward_only",
    ),
    case("one_epoch epoch '0'", lambda _: _one_epoch(_stream((X8, Y8)), epoch="0"), "epoch"),
    case(
        "one_epoch training without step_optimizer",
        lambda _: _one_epoch(_stream((X8, Y8))),
        "step_optimizer",
    ),
    case(
        "one_epoch a stream used twice",
        lambda _: _reused_stream(),
        "empty",
        BatchError,
    ),
    case(
        "one_epoch bad batch 2 of 3",
        lambda _: _one_epoch(
            _stream((X8, Y8), (X8, Y8), (torch.randn(8, 7), Y8)), forward_only=True, epoch=3
        ),
        "epoch 3, batch 2",
        BatchError,
    ),
    # ---- epochs
    case("epochs train_epoch not async", lambda _: _epochs(train_epoch=lambda f: 1.0), "train_epoch.*async"),
    case("epochs train_epoch raises", lambda _: _epochs(train_epoch=_raiser), "boom", Boom),
    case(
        "epochs train_epoch returns a str",
        lambda _: _epochs(train_epoch=lambda f: _awaitable("x")),
        "epoch 0.*'x'",
    ),
    case(
        "epochs validation returns None",
        lambda _: _epochs(validation_epoch=lambda: _awaitable(None)),
        "validation loss of epoch 0",
    ),
    case(
        "epochs save_min_validation_loss_model None",
        lambda _: _epochs(save_min_validation_loss_model=None),
        "save_min_validation_loss_model",
    ),
    case("epochs checkpoint_state an int", lambda _: _epochs(checkpoint_state=5), "checkpoint_state"),
    case("epochs checkpoint_state raises", lambda _: _epochs(checkpoint_state=_raiser), "boom", Boom),
    case("epochs on_end an int", lambda _: _epochs(on_end=5), "on_end"),
    case("epochs on_end raises", lambda _: _epochs(on_end=_raiser), "boom", Boom),
    case("epochs init_state an int", lambda _: _epochs(init_state=5), "init_state"),
    case(
        "epochs schedule state of another schedule",
        lambda _: _epochs(
            learning_rate_schedule=lamploop.reduce_lr_on_plateau(), learning_rate_schedule_init_state=5
        ),
        "learning_rate_schedule_init_state",
    ),
    case(
        "epochs plateau without validation",
        lambda _: _epochs(learning_rate_schedule=lamploop.reduce_lr_on_plateau(), validation_epoch=None),
        "validation",
    ),
    # ---- schedules
    case(
        "warmup_cosine total below warmup",
        lambda _: lamploop.warmup_cosine(warmup_steps=10, total_steps=5, steps_per_epoch=2),
        "warmup_steps",
    ),
    case(
        "warmup_cosine final nan",
        lambda _: lamploop.warmup_cosine(warmup_steps=1, total_steps=5, steps_per_epoch=2, final=NAN),
        "final",
    ),
    case(
        "warmup_linear steps_per_epoch 0",
        lambda _: lamploop.warmup_linear(warmup_steps=1, total_steps=5, steps_per_epoch=0),
        "steps_per_epoch",
    ),
    case(
        "warmup_cosine total_steps '5'",
        lambda _: lamploop.warmup_cosine(warmup_steps=1, total_steps="5", steps_per_epoch=2),
        "total_steps",
    ),
    case(
        "step schedule factor nan at step 2",
        lambda _: _fit(
            train_batches=lamploop.tensor_batches(X, Y, batch_size=2), step_schedule=_BadStep(NAN)
        ),
        "epoch 0, step 2",
    ),
    case(
        "step schedule factor a str at step 2",
        lambda _: _fit(
            train_batches=lamploop.tensor_batches(X, Y, batch_size=2), step_schedule=_BadStep("x")
        ),
        "epoch 0, step 2",
    ),
    case("step schedule raises", lambda _: _fit(step_schedule=_RaisingStep()), "epoch 0, step 0", Boom),
    case("step schedule a bare function", lambda _: _fit(step_schedule=lambda e, s: 1.0), "step_schedule"),
    # ---- averaging
    case("ema decay '0.9'", lambda _: averaging.ema("0.9"), "decay"),
    case("ema decay 1", lambda _: averaging.ema(1.0), "decay"),
    case("swa start_epoch 1.5", lambda _: averaging.swa(1.5), "start_epoch"),
    case(
        "swa refresh_batchnorm 'no'", lambda _: averaging.swa(0, refresh_batchnorm="no"), "refresh_batchnorm"
    ),
    case("fit averaging the EMA class", lambda _: _fit(averaging=averaging.EMA), "averaging"),
    case(
        "fit swa that never averages names fit",
        lambda _: _fit(max_epochs=2, averaging=averaging.swa(2)),
        "^fit: .*swa",
    ),
    # ---- checkpoints
    case(
        "save_checkpoint extras an int",
        lambda t: lamploop.save_checkpoint(t / "c", _state(), extras=5),
        "extras",
    ),
    case(
        "save_checkpoint rank_rngs a str",
        lambda t: lamploop.save_checkpoint(t / "c", _state(), rank_rngs="abc"),
        "rank_rngs",
    ),
    case(
        "save_checkpoint position an int",
        lambda t: lamploop.save_checkpoint(t / "c", _state(), position=5),
        "position",
    ),
    case(
        "save_checkpoint schedule_state an object",
        lambda t: lamploop.save_checkpoint(t / "c", _state(), schedule_state=object()),
        "schedule state",
        CheckpointError,
    ),
    case(
        "save_checkpoint model data of lists",
        lambda t: lamploop.save_checkpoint(
            t / "c", LoopStateWithModelAndOptimizerData(LoopState(epoch=1), {"w": [1, 2]}, {})
        ),
        "'w'",
        CheckpointError,
    ),
    case(
        "load_checkpoint into another model",
        lambda t: (_saved(t / "c"), lamploop.load_checkpoint(t / "c", model=torch.nn.Linear(5, 2))),
        "model.safetensors.*'weight'.*\\(2, 4\\).*\\(2, 5\\)",
        CheckpointError,
    ),
    case(
        "load_checkpoint with another schedule",
        lambda t: (
            _saved(t / "c"),
            lamploop.load_checkpoint(t / "c", schedule=lamploop.reduce_lr_on_plateau()),
        ),
        "checkpoint.json.*schedule",
        CheckpointError,
    ),
    case(
        "load_checkpoint restore_rng 'yes'",
        lambda t: (_saved(t / "c"), lamploop.load_checkpoint(t / "c", restore_rng="yes")),
        "restore_rng",
    ),
    case(
        "load_checkpoint a latest pointer out of the root",
        lambda t: (
            _saved(t / "c"),
            (t / "c" / "latest").write_text("../../etc"),
            lamploop.load_checkpoint(t / "c"),
        ),
        "latest.*\\.\\./\\.\\./etc",
        CheckpointError,
    ),
    case(
        "Checkpointer called with an int",
        lambda t: _run(lambda: lamploop.Checkpointer(t / "c")(5, None)),
        "state",
    ),
    # ---- drivers
    case("drive settings a dict", lambda _: _drive(settings={"max_gradient_norm": 1.0}), "settings"),
    case(
        "drive a keyword and settings disagree",
        lambda _: _drive(settings=lamploop.TrainingSettings(max_epochs=3), max_epochs=1),
        "max_epochs",
    ),
    case("drive an unknown keyword", lambda _: _drive(max_gradient_value=1.0), "max_gradient_value"),
    case(
        "drive reporters holds an object", lambda _: _drive(reporters=[_NotAReporter()]), "reporters\\[0\\]"
    ),
    case("drive checkpoint_state raises", lambda _: _drive(checkpoint_state=_async_raiser), "boom", Boom),
    case(
        "drive checkpoint_state not async",
        lambda _: _drive(checkpoint_state=lambda state, schedule_state: None),
        "checkpoint_state",
    ),
    case(
        "drive init_rank_rngs a str",
        lambda _: _drive(init_rank_rngs="abc"),
        "init_rank_rngs",
    ),
    case(
        "drive stop an int",
        lambda _: _drive(stop=5),
        "stop",
    ),
    case(
        "drive checkpoint_position an int",
        lambda _: _drive(checkpoint_position=5),
        "checkpoint_position",
    ),
    case(
        "drive init_position an int",
        lambda _: _drive(init_position=5),
        "init_position",
    ),
    case(
        "local replicas a generator",
        lambda _: _local(r for r in [(_model(), _batches(), None)]),
        "models_with_data_streams",
    ),
    case(
        "local replica a 2-tuple",
        lambda _: _local([(_model(), _batches()), (_model(), _batches())]),
        "models_with_data_streams\\[0\\].*triple",
    ),
    case(
        "local one module for two replicas",
        lambda _: (lambda m: _local([(m, _batches(), None), (m, _batches(), None)]))(_model()),
        "\\[0\\] and \\[1\\] share",
    ),
    case(
        "local replicas of different shapes",
        lambda _: _local(
            [(_model(), _batches(), None), (_model(module=torch.nn.Linear(4, 3)), _batches(), None)]
        ),
        "rank 1.*'weight'",
        LamploopError,
    ),
    case(
        "local validation on one replica only",
        lambda _: _local([(_model(), _batches(), _batches()), (_model(), _batches(), None)]),
        "rank 1.*validation_batches",
    ),
    case(
        "local optimizer_factory raises on the second replica",
        lambda _: _local(
            [(_model(), _batches(), None), (_model(), _batches(), None)],
            optimizer_factory=_optimizer_failing_on_second_replica(),
        ),
        "second replica",
        Boom,
    ),
    case(
        "local a train stream raises on rank 1",
        lambda _: _local([(_model(), _batches(), None), (_model(), _raiser, None)]),
        "boom",
        Boom,
    ),
    case(
        "local bad batch on rank 1 mid-epoch",
        lambda _: _local(
            [(_model(), _batches(), None), (_model(), _listed((X8, Y8), (torch.randn(8, 9), Y8)), None)]
        ),
        "epoch 0, batch 1 on rank 1",
        BatchError,
    ),
    case(
        "local profile refused",
        lambda t: _local(
            [(_model(), _batches(), None), (_model(), _batches(), None)],
            settings=lamploop.TrainingSettings(profile=lamploop.Profile(out_dir=t / "p")),
        ),
        "profile",
    ),
    # ---- reporters
    case("LoggingReporter level 'loud'", lambda _: reporting.LoggingReporter(level="loud"), "level"),
    case("LoggingReporter logger a str", lambda _: reporting.LoggingReporter(logger="lamploop"), "logger"),
    case(
        "MetricsFileReporter a directory",
        lambda t: _fit(reporters=[reporting.MetricsFileReporter(t)]),
        "directory",
    ),
    case(
        "MetricsFileReporter unknown suffix",
        lambda t: reporting.MetricsFileReporter(t / "m.txt"),
        "m.txt.*format",
    ),
    case(
        "MetricsFileReporter format xml",
        lambda t: reporting.MetricsFileReporter(t / "m.csv", format="xml"),
        "format",
    ),
    case(
        "MetricsFileReporter under a file",
        lambda t: reporting.MetricsFileReporter(_a_file(t) / "m.csv"),
        "a-file",
    ),
    case(
        "TensorBoardReporter a file",
        lambda t: _fit(reporters=[reporting.TensorBoardReporter(_a_file(t))]),
        "a-file",
    ),
    case(
        "TensorBoardReporter flush_secs nan",
        lambda t: reporting.TensorBoardReporter(t, flush_secs=NAN),
        "flush_secs",
    ),
    case("PrometheusReporter port a str", lambda _: reporting.PrometheusReporter("x"), "port"),
    case("PrometheusReporter port 70000", lambda _: reporting.PrometheusReporter(70000), "port"),
    case(
        "PrometheusReporter host unresolvable",
        lambda _: _fit(reporters=[reporting.PrometheusReporter(0, host="no.such.host.invalid")]),
        "no.such.host.invalid",
    ),
    case("PrometheusReporter url before start", lambda _: reporting.PrometheusReporter(0).url, "not started"),
    case("ProgressReporter file a str", lambda _: reporting.ProgressReporter(file="out.txt"), "file"),
    case(
        "ProgressReporter refresh_per_second 0",
        lambda _: reporting.ProgressReporter(io.StringIO(), refresh_per_second=0),
        "refresh_per_second",
    ),
    case(
        "ProgressReporter terminal 'yes'",
        lambda _: reporting.ProgressReporter(io.StringIO(), terminal="yes"),
        "terminal",
    ),
    case(
        "ProgressReporter a closed stream",
        lambda _: reporting.ProgressReporter(_closed_stream()),
        "ProgressReporter.*file",
    ),
    case("Profile out_dir a file", lambda t: _fit(profile=lamploop.Profile(out_dir=_a_file(t))), "a-file"),
    case(
        "Profile record_shapes 'y'", lambda t: lamploop.Profile(out_dir=t, record_shapes="y"), "record_shapes"
    ),
]


def _sum_loss_none() -> Callable[[torch.Tensor, torch.Tensor], Any]:
    return lambda output, target: (
        torch.nn.functional.cross_entropy(output, target, reduction="none"),
        len(target),
    )


def _once(iterator: Any) -> lamploop.BatchStreamFactory:
    """iterable_batches over one iterator, handed out again every epoch (a user's mistake)."""
    return lamploop.iterable_batches(lambda context: iterator)


def _reused_stream() -> Any:
    stream = _stream((X8, Y8))
    _one_epoch(stream, forward_only=True)
    return _one_epoch(stream, forward_only=True)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("call", "error", "pattern"), CASES)
def test_hostile_input(
    call: Callable[[Path], object],
    error: type[BaseException],
    pattern: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)  # nothing a case writes by mistake lands in the repository
    started = time.monotonic()
    with pytest.raises(error) as caught:
        call(tmp_path)
    elapsed = time.monotonic() - started
    assert elapsed < BOUND_S, f"took {elapsed:.1f} s"
    message = str(caught.value)
    assert re.search(pattern, message, re.IGNORECASE | re.DOTALL), message


# ----------------------------------------------------------------------------- nothing lost


@pytest.mark.timeout(60)
def test_an_empty_checkpoint_dir_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    try:
        with pytest.raises(ConfigurationError, match="checkpoint_dir"):
            _fit(checkpoint_dir="")
    finally:
        assert sorted(p.name for p in tmp_path.iterdir()) == [], (
            "checkpoints written into the working directory"
        )


@pytest.mark.timeout(60)
def test_a_metric_named_loss_does_not_overwrite_the_loss(tmp_path: Path) -> None:
    path = tmp_path / "curve.csv"
    try:
        state = _fit_valid(
            model=_model(metrics={"loss": metrics.accuracy}),
            reporters=[reporting.MetricsFileReporter(path)],
        )
    except ConfigurationError as refused:  # refusing the name is as good
        refusal = str(refused)
    else:
        refusal = ""
    if refusal:
        assert "loss" in refusal
        return
    with path.open() as f:
        rows = list(csv.DictReader(f))
    entry = state.learning_curve[0]
    _smoothed, raw = entry.validation_loss  # (smoothed, raw); equal with the default smoothing
    assert rows, "no row written"
    written = float(rows[0]["validation_loss"])
    assert math.isclose(written, raw, rel_tol=1e-9), (
        f"validation_loss column holds {written}, not the validation loss {raw} "
        f"(the metric 'loss' was {entry.validation_metrics['loss']})"
    )


# ----------------------------------------------------------------------------- launched ranks


_EXITS_AT_ONCE = """
import sys, torch, lamploop
x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
try:
    lamploop.fit(
        model=lamploop.SupervisedModel(torch.nn.Linear(4, 2)),
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1),
        train_batches=lamploop.tensor_batches(x, y, batch_size=8),
        max_epochs=1, reporters=[], device="cpu", world_size=2,
        launch_command=[sys.executable, "-c", "pass"],
    )
except Exception as error:
    print(f"RAISED {type(error).__name__}: {error}", flush=True)
    sys.exit(3)
print("RETURNED", flush=True)
"""


@pytest.mark.soak
@pytest.mark.timeout(90)
def test_a_launched_rank_that_exits_at_once_is_reported_promptly(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", _EXITS_AT_ONCE],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    started = time.monotonic()
    try:
        # Under 1.5 s of fit here; the rest is two interpreters importing torch, which a loaded
        # machine slowed past 20 s (a local soak run).  What fails is waiting out the 60 s join.
        output, _ = process.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=10)
        raise AssertionError(
            f"no answer after {time.monotonic() - started:.0f} s: the root still waits"
        ) from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    assert "RAISED" in output, output
    assert "rank 1" in output, output


# ----------------------------------------------------------------------------- the CLI


def _cli(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("lamploop")), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("args", "pattern"),
    [
        pytest.param(
            ("demo", "--out", "a-file", "--epochs", "1"), "ConfigurationError: --out a-file", id="out a file"
        ),
        pytest.param(
            ("demo", "--out", "a-file/sub", "--epochs", "1"),
            "ConfigurationError: --out a-file/sub",
            id="out under a file",
        ),
        pytest.param(("inspect", "a-file"), "CheckpointError: a-file", id="inspect a file"),
        pytest.param(
            ("lr-find", "--num-steps", "2", "-o", "a-dir"),
            "ConfigurationError: -o a-dir",
            id="lr-find output a directory",
            marks=[pytest.mark.soak],
        ),
    ],
)
def test_cli_refuses_bad_paths(args: tuple[str, ...], pattern: str, tmp_path: Path) -> None:
    _a_file(tmp_path)
    (tmp_path / "a-dir").mkdir()
    started = time.monotonic()
    done = _cli(*args, cwd=tmp_path)
    assert time.monotonic() - started < 60
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    last = done.stderr.strip().splitlines()[-1]
    assert re.search(pattern, last), last
