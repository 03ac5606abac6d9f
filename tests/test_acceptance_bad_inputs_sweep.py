"""A sweep of bad inputs over the public API: each must get an error of lamploop's own
hierarchy (``lamploop.errors``) whose message names the offending argument or value, raised
before training starts wherever it can be checked then; nothing may hang.

Every case is a call, the lamploop error class it must raise (or a subclass) and a pattern its
message must match (case-insensitive). Cases that currently end in a raw error from deep
inside, or with a message that names nothing, are kept and marked ``xfail(strict=True)`` with
the word DEFECT in their reason. Everything runs in one process on tiny CPU tensors; the only
network is 127.0.0.1 with bounded timeouts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from support import free_port

import lamploop
import lamploop.averaging as averaging
import lamploop.checkpoint as checkpoint
import lamploop.control as control
import lamploop.federated as federated
import lamploop.metrics as metrics
import lamploop.pipeline as pipeline
import lamploop.reporting as reporting
import lamploop.streaming as streaming
import lamploop.sync as sync
from lamploop.errors import (
    BatchError,
    CheckpointError,
    ConfigurationError,
    FederatedError,
    LamploopError,
)

NAN = math.nan
INF = math.inf

torch.manual_seed(0)
X, Y = torch.randn(16, 4), torch.randint(0, 2, (16,))


# ----------------------------------------------------------------------------- helpers


def _module() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(4, 2)


def _seq() -> torch.nn.Sequential:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _model(**changes: Any) -> lamploop.SupervisedModel:
    module = changes.pop("module") if "module" in changes else _module()
    return lamploop.SupervisedModel(module, **changes)


def _batches() -> lamploop.BatchStreamFactory:
    return lamploop.tensor_batches(X, Y, batch_size=8)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _fit(**changes: Any) -> object:
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


def _fit_valid(**changes: Any) -> object:
    return _fit(validation_batches=_batches(), **changes)


def _fit_async(**changes: Any) -> object:
    kwargs: dict[str, Any] = {
        "model": _model(),
        "optimizer_factory": _sgd,
        "train_batches": _batches(),
        "max_epochs": 1,
        "reporters": [],
        "device": "cpu",
    }
    kwargs.update(changes)

    async def run() -> object:
        with anyio.fail_after(20):
            return await lamploop.fit_async(**kwargs)

    return anyio.run(run)


def _yielding(*batches: Any) -> lamploop.BatchStreamFactory:
    """A factory whose streams yield exactly ``batches`` (whatever they are)."""

    def make(context: Any) -> Any:
        async def stream() -> Any:
            for batch in batches:
                yield batch

        return stream()

    return make


async def _train(factor: float) -> float:
    return 1.0


async def _valid() -> float:
    return 1.0


async def _saved() -> None:
    return None


def _epochs(**changes: Any) -> object:
    kwargs: dict[str, Any] = {
        "max_epochs": 2,
        "train_epoch": _train,
        "validation_epoch": _valid,
        "save_min_validation_loss_model": _saved,
    }
    kwargs.update(changes)

    async def run() -> object:
        with anyio.fail_after(20):
            return await lamploop.epochs(**kwargs)

    return anyio.run(run)


def _returning(value: Any) -> Callable[..., Any]:
    async def effect(*_: Any) -> Any:
        return value

    return effect


def _one_epoch(*stream: Any, **changes: Any) -> object:
    if not stream:
        stream = ((X[:8], Y[:8]),)

    async def batches() -> Any:
        for batch in stream:
            yield batch

    kwargs: dict[str, Any] = {"model": _model(), "batches": batches(), "step_optimizer": lambda: None}
    kwargs.update(changes)

    async def run() -> object:
        with anyio.fail_after(20):
            return await lamploop.one_epoch(**kwargs)

    return anyio.run(run)


def _drive(**changes: Any) -> object:
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

    async def run() -> object:
        with anyio.fail_after(20):
            return await lamploop.drive_distributed_training(**kwargs)

    return anyio.run(run)


def _follow(**changes: Any) -> object:
    async def follow() -> None:
        with anyio.fail_after(20):
            root, (follower,) = lamploop.local_control(2, join_timeout=5.0)
            async with root, follower:
                kwargs: dict[str, Any] = {
                    "rank": 1,
                    "nranks": 2,
                    "device": "cpu",
                    "control": follower,
                    "model": _model(),
                    "train_batches": _batches(),
                    "validation_batches": None,
                }
                kwargs.update(changes)
                await lamploop.follow_distributed_training(**kwargs)

    return anyio.run(follow)


def _local(
    replicas: Any = None, optimizer_factory: Any = _sgd, max_epochs: Any = 1, **changes: Any
) -> object:
    if replicas is None:
        replicas = [(_model(), _batches(), None), (_model(), _batches(), None)]

    async def run() -> object:
        with anyio.fail_after(30):
            return await lamploop.local_data_parallel_training_loop(
                replicas, optimizer_factory, max_epochs, **changes
            )

    return anyio.run(run)


def _state() -> lamploop.LoopStateWithModelAndOptimizerData:
    return lamploop.LoopStateWithModelAndOptimizerData(
        loop_state=lamploop.LoopState(),
        model=_module().state_dict(),
        optimizer={},
        best_model={},
    )


def _a_file(tmp: Path) -> Path:
    file = tmp / "a-file"
    file.write_text("not a directory")
    return file


def _saved_checkpoint(tmp: Path) -> Path:
    return lamploop.save_checkpoint(tmp / "run", _state())


def _damaged(tmp: Path, damage: Callable[[Path], None]) -> Path:
    path = _saved_checkpoint(tmp)
    damage(path)
    return path


def _truncate_model(path: Path) -> None:
    model = path / checkpoint.MODEL_FILE
    model.write_bytes(model.read_bytes()[:20])


def _garble_descriptor(path: Path) -> None:
    (path / checkpoint.DESCRIPTOR_NAME).write_text("{not json")


def _remove_model(path: Path) -> None:
    (path / checkpoint.MODEL_FILE).unlink()


def _buffer(**changes: Any) -> streaming.StreamBuffer:
    kwargs: dict[str, Any] = {"capacity": 8, "watermark": 4}
    kwargs.update(changes)
    return streaming.FifoBuffer(**kwargs)


def _tcp_root(**changes: Any) -> object:
    kwargs: dict[str, Any] = {
        "nranks": 2,
        "token": "secret",
        "model_spec": lamploop.model_spec(_module()),
        "join_timeout": 1.0,
    }
    kwargs.update(changes)
    return lamploop.TcpControlRoot(**kwargs)


def _tcp_follower(**changes: Any) -> object:
    kwargs: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 1,
        "rank": 1,
        "nranks": 2,
        "token": "secret",
        "model_spec": lamploop.model_spec(_module()),
        "connect_timeout": 1.0,
    }
    kwargs.update(changes)
    return lamploop.TcpControlFollower(**kwargs)


def _optimizer_config(**changes: Any) -> federated.OptimizerConfig:
    kwargs: dict[str, Any] = {"name": "sgd", "learning_rate": 0.1}
    kwargs.update(changes)
    return federated.OptimizerConfig(**kwargs)


def _description() -> federated.ModelDescription:
    options = {"sizes": [4, 2]}
    return federated.describe_model("mlp", options, federated.mlp(options))


def _plan(**changes: Any) -> federated.TrainingPlan:
    kwargs: dict[str, Any] = {
        "name": "plan",
        "model": _description(),
        "optimizer": _optimizer_config(),
    }
    kwargs.update(changes)
    return federated.TrainingPlan(**kwargs)


def _plan_json(**changes: Any) -> dict[str, Any]:
    obj = federated.plan_to_json(_plan())
    obj.update(changes)
    return obj


def _aggregator_settings(**changes: Any) -> federated.AggregatorSettings:
    kwargs: dict[str, Any] = {"rounds": 1}
    kwargs.update(changes)
    return federated.AggregatorSettings(**kwargs)


def _run_async(function: Callable[..., Any], kwargs: dict[str, Any]) -> object:
    async def run() -> object:
        with anyio.fail_after(20):
            return await function(**kwargs)

    return anyio.run(run)


def _aggregate(**changes: Any) -> object:
    kwargs: dict[str, Any] = {
        "plan": _plan(),
        "initial_model": federated.mlp({"sizes": [4, 2]}),
        "token": "t",
        "settings": _aggregator_settings(join_timeout=1.0),
    }
    kwargs.update(changes)
    return _run_async(federated.run_aggregator, kwargs)


def _average(updates: Any, global_model: Any = None, names: Any = None) -> object:
    if global_model is None:
        global_model = {"w": torch.zeros(2)}
    if names is None:
        names = frozenset(global_model)
    return federated.federated_average(global_model, updates, names=names)


def _train_pipeline(**changes: Any) -> object:
    kwargs: dict[str, Any] = {
        "model": _seq(),
        "spec": pipeline.PipelineSpec(boundaries=()),
        "optimizer_factory": _sgd,
        "train_batches": _batches(),
        "max_epochs": 1,
    }
    kwargs.update(changes)
    with pipeline.open_pipeline_group(
        rank=0, world_size=1, host="127.0.0.1", port=free_port(), timeout=10.0
    ):
        return _run_async(pipeline.train_pipeline, kwargs)


def _event() -> reporting.Event:
    return reporting.RunStopped  # type: ignore[return-value]


# ----------------------------------------------------------------------------- the cases

Case = Callable[[Path], object]


def case(
    id: str,
    call: Case,
    pattern: str,
    error: type[BaseException] = LamploopError,
    defect: str | None = None,
) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=f"DEFECT: {defect}")] if defect else []
    return pytest.param(call, error, pattern, id=id, marks=marks)


FIT = [
    case("fit max_epochs -1", lambda _: _fit(max_epochs=-1), "max_epochs"),
    case("fit validation_frequency 0", lambda _: _fit_valid(validation_frequency=0), "validation_frequency"),
    case(
        "fit accumulate 0",
        lambda _: _fit(accumulate_gradient_over_n_batches=0),
        "accumulate_gradient_over_n_batches",
    ),
    case(
        "fit smoothing nan",
        lambda _: _fit_valid(validation_loss_exponential_smoothing_factor=NAN),
        "validation_loss_exponential_smoothing_factor",
    ),
    case("fit keep_last 0", lambda tmp: _fit(checkpoint_dir=tmp / "c", keep_last=0), "keep_last"),
    case("fit device unknown", lambda _: _fit(device="tpu9"), "device"),
    case("fit world_size 0", lambda _: _fit(world_size=0), "world_size"),
    case("fit strategy unknown", lambda _: _fit(strategy="telepathy"), "telepathy"),
    case("fit bucket_cap_mb 0", lambda _: _fit(bucket_cap_mb=0), "bucket_cap_mb"),
    case("fit collective_timeout -1", lambda _: _fit(collective_timeout=-1), "collective_timeout"),
    case("fit heartbeat_timeout inf", lambda _: _fit(heartbeat_timeout=NAN), "heartbeat_timeout"),
    case("fit reporters holds an int", lambda _: _fit(reporters=[5]), "reporter"),
    case(
        "fit reporters a reporter, not a list",
        lambda _: _fit(reporters=lamploop.LoggingReporter()),
        "reporters",
    ),
    case(
        "fit checkpoint_every_n_steps 0",
        lambda tmp: _fit(checkpoint_dir=tmp, checkpoint_every_n_steps=0),
        "checkpoint_every_n_steps",
    ),
    case(
        "fit checkpoint_every_seconds -1",
        lambda tmp: _fit(checkpoint_dir=tmp, checkpoint_every_seconds=-1.0),
        "checkpoint_every_seconds",
    ),
    case("fit on_non_finite_loss unknown", lambda _: _fit(on_non_finite_loss="ignore"), "on_non_finite_loss"),
    case("fit max_gradient_norm 0", lambda _: _fit(max_gradient_norm=0.0), "max_gradient_norm"),
    case("fit precision 16", lambda _: _fit(precision="16"), "precision"),
    case("fit step_schedule an int", lambda _: _fit(step_schedule=5), "step_schedule"),
    case(
        "fit learning_rate_schedule an int",
        lambda _: _fit(learning_rate_schedule=5),
        "learning_rate_schedule",
    ),
    case(
        "fit learning_rate_schedule a function",
        lambda _: _fit(learning_rate_schedule=lambda epoch: 1.0),
        "learning_rate_schedule",
    ),
    case("fit lr_scheduler an int", lambda _: _fit(lr_scheduler=5), "lr_scheduler"),
    case(
        "fit lr_scheduler returns no scheduler",
        lambda _: _fit(lr_scheduler=lambda optimizer: 5),
        "lr_scheduler",
    ),
    case(
        "fit lr_scheduler_interval batch",
        lambda _: _fit(
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1), lr_scheduler_interval="batch"
        ),
        "lr_scheduler_interval",
    ),
    case(
        "fit lr_scheduler with a step_schedule",
        lambda _: _fit(
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1),
            step_schedule=lamploop.warmup_linear(warmup_steps=1, total_steps=4, steps_per_epoch=2),
        ),
        "lr_scheduler",
        ConfigurationError,
    ),
    case("fit averaging an int", lambda _: _fit(averaging=5), "averaging"),
    case(
        "fit swa after the last epoch",
        lambda _: _fit(averaging=lamploop.swa(3), max_epochs=2),
        "start_epoch|swa",
    ),
    case(
        "fit model_selection_metric unknown",
        lambda _: _fit_valid(model_selection_metric="accuracy"),
        "accuracy",
    ),
    case(
        "fit model_selection_mode unknown",
        lambda _: _fit_valid(model_selection_mode="best"),
        "model_selection_mode",
    ),
    case(
        "fit early_stopping_patience 0",
        lambda _: _fit_valid(early_stopping_patience=0),
        "early_stopping_patience",
    ),
    case("fit profile an int", lambda _: _fit(profile=5), "profile"),
    case(
        "fit checkpoint_extras an int",
        lambda tmp: _fit(checkpoint_dir=tmp, checkpoint_extras=5),
        "checkpoint_extras",
    ),
    case(
        "fit checkpoint_extras values not extras",
        lambda tmp: _fit(checkpoint_dir=tmp, checkpoint_extras={"x": 5}),
        "checkpoint_extras",
    ),
    case("fit optimizer_factory None", lambda _: _fit(optimizer_factory=None), "optimizer_factory"),
    case(
        "fit optimizer_factory returns a list", lambda _: _fit(optimizer_factory=lambda p: [p]), "optimizer"
    ),
    case("fit train_batches None", lambda _: _fit(train_batches=None), "train_batches"),
    case("fit validation_batches an int", lambda _: _fit(validation_batches=5), "validation_batches"),
    case("fit model None", lambda _: _fit(model=None), "model"),
    # batch streams that yield the wrong things
    case("fit a stream yielding a bare tensor", lambda _: _fit(train_batches=_yielding(X)), "batch"),
    case("fit a stream yielding a 3-tuple", lambda _: _fit(train_batches=_yielding((X, Y, Y))), "batch"),
    case("fit a stream yielding strings", lambda _: _fit(train_batches=_yielding(("a", "b"))), "batch"),
    case("fit a stream yielding None", lambda _: _fit(train_batches=_yielding(None)), "batch"),
    case(
        "fit a stream yielding an empty batch",
        lambda _: _fit(train_batches=_yielding((X[:0], Y[:0]))),
        "empty|0 examples|no examples",
    ),
    case(
        "fit features and target of other lengths",
        lambda _: _fit(train_batches=_yielding((X[:8], Y[:5]))),
        "batch",
        BatchError,
    ),
    case(
        "fit features of the wrong width",
        lambda _: _fit(train_batches=_yielding((X[:, :3], Y))),
        "batch 0",
        BatchError,
    ),
    case(
        "fit features of the wrong dtype",
        lambda _: _fit(train_batches=_yielding((X.double(), Y))),
        "batch 0",
        BatchError,
    ),
    case(
        "fit a factory returning None",
        lambda _: _fit(train_batches=lambda ctx: None),
        "batch stream|train_batches",
    ),
    case(
        "fit a factory taking no context",
        lambda _: _fit(train_batches=lambda: _batches()(None)),
        "train_batches|context",
    ),
    case(
        "fit a model whose forward raises",
        lambda _: _fit(model=_model(module=_Raising())),
        "epoch 0, batch 0",
        BatchError,
    ),
    case(
        "fit a loss returning a 3-tuple",
        lambda _: _fit(model=_model(loss=lambda o, t: (F.cross_entropy(o, t, reduction="sum"), len(t), 0))),
        "loss",
        ConfigurationError,
    ),
    case(
        "fit a loss returning None",
        lambda _: _fit(model=_model(loss=lambda o, t: None)),
        "loss",
        ConfigurationError,
    ),
    case(
        "fit a loss with a zero example count",
        lambda _: _fit(model=_model(loss=lambda o, t: (F.cross_entropy(o, t, reduction="sum"), 0))),
        "epoch 0, batch 0.*0 examples",
    ),
    case(
        "fit a loss with a negative example count",
        lambda _: _fit(model=_model(loss=lambda o, t: (F.cross_entropy(o, t, reduction="sum"), -3))),
        "example count",
    ),
    case(
        "fit a step schedule returning nan",
        lambda _: _fit(step_schedule=_StepSchedule(NAN)),
        "epoch 0.*step 0|step 0.*epoch 0",
        ConfigurationError,
    ),
    case(
        "fit a step schedule returning -1",
        lambda _: _fit(step_schedule=_StepSchedule(-1.0)),
        "epoch 0.*step 0|step 0.*epoch 0",
        ConfigurationError,
    ),
    case(
        "fit a non-finite loss",
        lambda _: _fit(model=_model(loss=lambda o, t: (o.sum() * NAN, len(t)))),
        "epoch 0",
    ),
    # fit_async
    case("fit_async max_epochs -1", lambda _: _fit_async(max_epochs=-1), "max_epochs"),
    case("fit_async a bare module", lambda _: _fit_async(model=_module()), "SupervisedModel|model"),
    case(
        "fit_async an optimizer instance",
        lambda _: _fit_async(optimizer_factory=_sgd(_module().parameters())),
        "optimizer_factory",
    ),
]


class _Raising(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the forward is broken")


class _StepSchedule:
    def __init__(self, value: float) -> None:
        self.value = value

    def factor(self, epoch: int, step: int) -> float:
        return self.value


EPOCHS = [
    case("epochs max_epochs -1", lambda _: _epochs(max_epochs=-1), "max_epochs"),
    case("epochs validation_frequency 0", lambda _: _epochs(validation_frequency=0), "validation_frequency"),
    case(
        "epochs smoothing nan",
        lambda _: _epochs(validation_loss_exponential_smoothing_factor=NAN),
        "validation_loss_exponential_smoothing_factor",
    ),
    case(
        "epochs learning_rate_schedule an int",
        lambda _: _epochs(learning_rate_schedule=5),
        "learning_rate_schedule",
    ),
    case("epochs validation_epoch an int", lambda _: _epochs(validation_epoch=5), "validation_epoch"),
    case(
        "epochs model_selection_mode unknown",
        lambda _: _epochs(model_selection_mode="best"),
        "model_selection_mode",
    ),
    case(
        "epochs early_stopping_patience -1",
        lambda _: _epochs(early_stopping_patience=-1),
        "early_stopping_patience",
    ),
    case(
        "epochs train_epoch returns a str", lambda _: _epochs(train_epoch=_returning("1.0")), "training loss"
    ),
    case("epochs train_epoch returns nan", lambda _: _epochs(train_epoch=_returning(NAN)), "epoch 0"),
    case("epochs init_state.epoch -1", lambda _: _epochs(init_state=lamploop.LoopState(epoch=-1)), "epoch"),
]

ONE_EPOCH = [
    case(
        "one_epoch accumulate 0",
        lambda _: _one_epoch(accumulate_gradient_over_n_batches=0),
        "accumulate_gradient_over_n_batches",
    ),
    case("one_epoch batches a list", lambda _: _one_epoch(batches=[(X, Y)]), "batches"),
    case("one_epoch batches a factory", lambda _: _one_epoch(batches=_batches()), "batches"),
    case("one_epoch a batch that is a bare tensor", lambda _: _one_epoch(X), "batch"),
    case("one_epoch an empty batch", lambda _: _one_epoch((X[:0], Y[:0])), "empty|0 examples|no examples"),
    case(
        "one_epoch a target of the wrong dtype", lambda _: _one_epoch((X, Y.float())), "batch 0", BatchError
    ),
    case(
        "one_epoch on_non_finite_loss unknown",
        lambda _: _one_epoch(on_non_finite_loss="x"),
        "on_non_finite_loss",
    ),
    case("one_epoch max_gradient_norm -1", lambda _: _one_epoch(max_gradient_norm=-1.0), "max_gradient_norm"),
    case("one_epoch precision fp8", lambda _: _one_epoch(precision="fp8"), "precision"),
    case("one_epoch epoch -1", lambda _: _one_epoch(epoch=-1), "epoch"),
    case("one_epoch model None", lambda _: _one_epoch(model=None), "model"),
]

DRIVERS = [
    case("drive nranks 0", lambda _: _drive(nranks=0), "nranks"),
    case("drive nranks 2 without control", lambda _: _drive(nranks=2), "control"),
    case("drive max_epochs -1", lambda _: _drive(max_epochs=-1), "max_epochs"),
    case("drive device unknown", lambda _: _drive(device="cpuz"), "device"),
    case("drive optimizer_factory an int", lambda _: _drive(optimizer_factory=5), "optimizer_factory"),
    case("drive train_batches None", lambda _: _drive(train_batches=None), "train_batches"),
    case(
        "drive accumulate 0",
        lambda _: _drive(accumulate_gradient_over_n_batches=0),
        "accumulate_gradient_over_n_batches",
    ),
    case("drive validation_frequency 0", lambda _: _drive(validation_frequency=0), "validation_frequency"),
    case(
        "drive learning_rate_schedule an int",
        lambda _: _drive(learning_rate_schedule=5),
        "learning_rate_schedule",
    ),
    case("drive strategy unknown", lambda _: _drive(strategy="telepathy"), "telepathy"),
    case("follow rank 0", lambda _: _follow(rank=0), "rank"),
    case("follow rank 2 of 2", lambda _: _follow(rank=2), "rank"),
    case(
        "follow accumulate 0",
        lambda _: _follow(accumulate_gradient_over_n_batches=0),
        "accumulate_gradient_over_n_batches",
    ),
    case("follow train_batches None", lambda _: _follow(train_batches=None), "train_batches"),
    case("follow device unknown", lambda _: _follow(device="cpuz"), "device"),
    case("local no replicas", lambda _: _local([]), "models_with_data_streams"),
    case("local optimizer_factory None", lambda _: _local(optimizer_factory=None), "optimizer_factory"),
    case("local max_epochs -1", lambda _: _local(max_epochs=-1), "max_epochs"),
    case(
        "local accumulate 0",
        lambda _: _local(accumulate_gradient_over_n_batches=0),
        "accumulate_gradient_over_n_batches",
    ),
    case(
        "local replicas of different models",
        lambda _: _local(
            [(_model(), _batches(), None), (_model(module=torch.nn.Linear(4, 3)), _batches(), None)]
        ),
        "models_with_data_streams|replica|rank",
    ),
]

MODEL = [
    case("SupervisedModel module None", lambda _: lamploop.SupervisedModel(None), "module"),
    case("SupervisedModel a model of a model", lambda _: lamploop.SupervisedModel(_model()), "module"),
    case("SupervisedModel loss None", lambda _: _model(loss=None), "loss"),
    case("SupervisedModel metric name an int", lambda _: _model(metrics={1: metrics.accuracy}), "metrics"),
    case(
        "summed an int",
        lambda _: lamploop.summed(5),
        "loss|summed",
    ),
    case(
        "summarize not a module",
        lambda _: lamploop.summarize(5),
        "module",
    ),
    case("summarize depth a str", lambda _: lamploop.summarize(_seq(), depth="1"), "depth"),
    case(
        "model_spec an int",
        lambda _: lamploop.model_spec(5),
        "model_spec|tensors",
    ),
    case(
        "model_spec a dict of non-tensors",
        lambda _: lamploop.model_spec({"w": [1.0]}),
        "w",
    ),
    case("lr_find min_lr above max_lr", lambda _: _lr_find(min_lr=1.0, max_lr=0.1), "min_lr"),
    case("lr_find num_steps 1", lambda _: _lr_find(num_steps=1), "num_steps"),
    case("lr_find smoothing 1", lambda _: _lr_find(smoothing=1.0), "smoothing"),
    case(
        "lr_find divergence_threshold 1", lambda _: _lr_find(divergence_threshold=1.0), "divergence_threshold"
    ),
]


def _lr_find(**changes: Any) -> object:
    kwargs: dict[str, Any] = {
        "model": _model(),
        "optimizer_factory": _sgd,
        "train_batches": _batches(),
        "num_steps": 4,
    }
    kwargs.update(changes)
    return lamploop.lr_find(**kwargs)


BATCHES = [
    case("tensor_batches batch_size 0", lambda _: lamploop.tensor_batches(X, Y, batch_size=0), "batch_size"),
    case(
        "tensor_batches lengths differ",
        lambda _: lamploop.tensor_batches(X[:10], Y, batch_size=4),
        "features|target",
    ),
    case("tensor_batches seed -1", lambda _: lamploop.tensor_batches(X, Y, batch_size=4, seed=-1), "seed"),
    case(
        "tensor_batches drop_last a str",
        lambda _: lamploop.tensor_batches(X, Y, batch_size=4, drop_last="y"),
        "drop_last",
    ),
    case(
        "tensor_batches no examples",
        lambda _: lamploop.tensor_batches(X[:0], Y[:0], batch_size=4),
        "features|example|empty",
    ),
    case(
        "tensor_batches target a list",
        lambda _: lamploop.tensor_batches(X, Y.tolist(), batch_size=4),
        "target",
    ),
    case("iterable_batches make None", lambda _: lamploop.iterable_batches(None), "make"),
    case(
        "iterable_batches make returns None",
        lambda _: _fit(train_batches=lamploop.iterable_batches(lambda ctx: None)),
        "iterable|batch",
    ),
    case(
        "iterable_batches make yields bare tensors",
        lambda _: _fit(train_batches=lamploop.iterable_batches(lambda ctx: [X, X])),
        "batch",
    ),
    case("dataloader_batches an int", lambda _: lamploop.dataloader_batches(5), "loader"),
    case(
        "dataloader_batches seed -1", lambda _: lamploop.dataloader_batches(lambda ctx: None, seed=-1), "seed"
    ),
    case("BatchContext rank -1", lambda _: lamploop.BatchContext(epoch=0, rank=-1), "rank"),
    case("BatchContext nranks 0", lambda _: lamploop.BatchContext(epoch=0, nranks=0), "nranks"),
    case(
        "BatchContext rank beyond nranks", lambda _: lamploop.BatchContext(epoch=0, rank=2, nranks=2), "rank"
    ),
    case("BatchContext epoch -1", lambda _: lamploop.BatchContext(epoch=-1), "epoch"),
]

SCHEDULES = [
    case("cyclic max_factor nan", lambda _: lamploop.cyclic(NAN, 4), "max_factor"),
    case("cyclic period_length 0", lambda _: lamploop.cyclic(1.0, 0), "period_length"),
    case("decrement every 0", lambda _: lamploop.decrement(0, 0.5), "every"),
    case("decrement fraction 1.5", lambda _: lamploop.decrement(2, 1.5), "fraction"),
    case("linear max_steps 0", lambda _: lamploop.linear(1.0, 0.1, 0), "max_steps"),
    case("linear start nan", lambda _: lamploop.linear(NAN, 0.1, 5), "start"),
    case("linear end inf", lambda _: lamploop.linear(1.0, INF, 5), "end"),
    case("step_after steps -1", lambda _: lamploop.step_after(-1, 0.5), "steps"),
    case("step_after factor nan", lambda _: lamploop.step_after(2, NAN), "factor"),
    case(
        "plateau reduce_factor 0", lambda _: lamploop.reduce_lr_on_plateau(reduce_factor=0.0), "reduce_factor"
    ),
    case("plateau patience -1", lambda _: lamploop.reduce_lr_on_plateau(patience=-1), "patience"),
    case("plateau threshold nan", lambda _: lamploop.reduce_lr_on_plateau(threshold=NAN), "threshold"),
    case("plateau min_factor -1", lambda _: lamploop.reduce_lr_on_plateau(min_factor=-1.0), "min_factor"),
    case(
        "plateau start_factor inf", lambda _: lamploop.reduce_lr_on_plateau(start_factor=INF), "start_factor"
    ),
    case(
        "plateau validation_frequency 0",
        lambda _: lamploop.reduce_lr_on_plateau(validation_frequency=0),
        "validation_frequency",
    ),
    case("from_epoch_count an int", lambda _: lamploop.from_epoch_count(5), "from_epoch_count|f\\b|function"),
    case(
        "warmup_cosine warmup above total",
        lambda _: lamploop.warmup_cosine(warmup_steps=10, total_steps=5, steps_per_epoch=2),
        "warmup_steps",
    ),
    case(
        "warmup_cosine steps_per_epoch 0",
        lambda _: lamploop.warmup_cosine(warmup_steps=1, total_steps=5, steps_per_epoch=0),
        "steps_per_epoch",
    ),
    case(
        "warmup_cosine total_steps 0",
        lambda _: lamploop.warmup_cosine(warmup_steps=0, total_steps=0, steps_per_epoch=1),
        "total_steps",
    ),
    case(
        "warmup_cosine final nan",
        lambda _: lamploop.warmup_cosine(warmup_steps=1, total_steps=5, steps_per_epoch=1, final=NAN),
        "final",
    ),
    case(
        "warmup_linear warmup -1",
        lambda _: lamploop.warmup_linear(warmup_steps=-1, total_steps=5, steps_per_epoch=1),
        "warmup_steps",
    ),
    case(
        "warmup_linear final -1",
        lambda _: lamploop.warmup_linear(warmup_steps=1, total_steps=5, steps_per_epoch=1, final=-1.0),
        "final",
    ),
    case(
        "warmup_linear total_steps a str",
        lambda _: lamploop.warmup_linear(warmup_steps=1, total_steps="5", steps_per_epoch=1),
        "total_steps",
    ),
    case(
        "plateau init state of another schedule",
        lambda _: lamploop.reduce_lr_on_plateau().learning_rate_factor(5, 0, 1.0),
        "state|PlateauState",
    ),
]

AVERAGING = [
    case("ema decay 0", lambda _: lamploop.ema(0.0), "decay"),
    case("swa start_epoch -1", lambda _: lamploop.swa(-1), "start_epoch"),
    case(
        "swa refresh_batchnorm a str", lambda _: lamploop.swa(0, refresh_batchnorm="yes"), "refresh_batchnorm"
    ),
    case("EMA class decay 2", lambda _: averaging.EMA(2.0), "decay"),
    case(
        "check_averaging_starts swa too late",
        lambda _: averaging.check_averaging_starts("fit", lamploop.swa(5), 3),
        "start_epoch",
    ),
]

CHECKPOINTS = [
    case("load_checkpoint a missing path", lambda tmp: lamploop.load_checkpoint(tmp / "nope"), "nope"),
    case("load_checkpoint a file", lambda tmp: lamploop.load_checkpoint(_a_file(tmp)), "a-file"),
    case(
        "load_checkpoint an empty directory",
        lambda tmp: lamploop.load_checkpoint(tmp),
        "descriptor|checkpoint|" + checkpoint.DESCRIPTOR_NAME,
        CheckpointError,
    ),
    case(
        "load_checkpoint a truncated model file",
        lambda tmp: lamploop.load_checkpoint(_damaged(tmp, _truncate_model)),
        checkpoint.MODEL_FILE,
        CheckpointError,
    ),
    case(
        "load_checkpoint a missing model file",
        lambda tmp: lamploop.load_checkpoint(_damaged(tmp, _remove_model)),
        checkpoint.MODEL_FILE,
        CheckpointError,
    ),
    case(
        "load_checkpoint a garbled descriptor",
        lambda tmp: lamploop.load_checkpoint(_damaged(tmp, _garble_descriptor)),
        checkpoint.DESCRIPTOR_NAME,
        CheckpointError,
    ),
    case(
        "load_checkpoint into another model",
        lambda tmp: lamploop.load_checkpoint(_saved_checkpoint(tmp), model=torch.nn.Linear(4, 3)),
        "weight",
        CheckpointError,
    ),
    case("verify_checkpoint a missing path", lambda tmp: checkpoint.verify_checkpoint(tmp / "nope"), "nope"),
    case("verify_checkpoint a file", lambda tmp: checkpoint.verify_checkpoint(_a_file(tmp)), "a-file"),
    case(
        "verify_checkpoint an int",
        lambda _: checkpoint.verify_checkpoint(5),
        "path",
    ),
    case(
        "verify_checkpoint a truncated model file",
        lambda tmp: _verify_fails(_damaged(tmp, _truncate_model)),
        checkpoint.MODEL_FILE,
    ),
    case("latest_checkpoint a file", lambda tmp: lamploop.latest_checkpoint(_a_file(tmp)), "a-file"),
    case(
        "latest_checkpoint a latest naming nothing",
        lambda tmp: _latest_names_nothing(tmp),
        "latest|gone",
        CheckpointError,
    ),
    case(
        "save_checkpoint keep_last 0",
        lambda tmp: lamploop.save_checkpoint(tmp, _state(), keep_last=0),
        "keep_last",
    ),
    case("save_checkpoint state an int", lambda tmp: lamploop.save_checkpoint(tmp, 5), "state"),
    case(
        "save_checkpoint a LoopState",
        lambda tmp: lamploop.save_checkpoint(tmp, lamploop.LoopState()),
        "state",
    ),
    case(
        "save_checkpoint a state dict of non-tensors",
        lambda tmp: lamploop.save_checkpoint(tmp, _state_with(model={"w": [1.0]})),
        "w",
    ),
    case(
        "save_checkpoint a schedule state that is not data",
        lambda tmp: lamploop.save_checkpoint(tmp, _state(), schedule_state=object()),
        "schedule.state",
    ),
    case("Checkpointer keep_last 0", lambda tmp: lamploop.Checkpointer(tmp, keep_last=0), "keep_last"),
    case("Checkpointer extras an int", lambda tmp: lamploop.Checkpointer(tmp, extras=5), "extras"),
    case(
        "checkpoint_name epoch -1",
        lambda _: checkpoint.checkpoint_name(-1),
        "epoch",
    ),
    case(
        "checkpoint_name epoch a str",
        lambda _: checkpoint.checkpoint_name("1"),
        "epoch",
    ),
    case(
        "checkpoint_name step -1",
        lambda _: checkpoint.checkpoint_name(1, -1),
        "step",
    ),
    case(
        "rank_rng_file rank -1",
        lambda _: checkpoint.rank_rng_file(-1),
        "rank",
    ),
    case(
        "rank_rng_file rank 0",
        lambda _: checkpoint.rank_rng_file(0),
        "rank",
    ),
    case(
        "extra_file a path",
        lambda _: checkpoint.extra_file("../evil"),
        "evil|name",
    ),
    case(
        "extra_file empty",
        lambda _: checkpoint.extra_file(""),
        "name",
    ),
    case(
        "restore_optimizer_state not an optimizer",
        lambda _: checkpoint.restore_optimizer_state(5, {}),
        "optimizer",
    ),
    case(
        "restore_optimizer_state state an int",
        lambda _: checkpoint.restore_optimizer_state(_sgd(_module().parameters()), 5),
        "state",
    ),
]


def _state_with(**changes: Any) -> Any:
    kwargs: dict[str, Any] = {
        "loop_state": lamploop.LoopState(),
        "model": _module().state_dict(),
        "optimizer": {},
        "best_model": {},
    }
    kwargs.update(changes)
    return lamploop.LoopStateWithModelAndOptimizerData(**kwargs)


def _verify_fails(path: Path) -> object:
    report = checkpoint.verify_checkpoint(path)
    # A report is allowed instead of a raise, as long as it says what is wrong; a report
    # saying "fine" for a truncated file is a defect.
    text = str(report)
    ok = getattr(report, "ok", None)
    if ok is False or ok is None:
        raise CheckpointError(text)
    raise AssertionError(f"verify_checkpoint called a truncated checkpoint fine: {text}")


def _latest_names_nothing(tmp: Path) -> object:
    (tmp / checkpoint.LATEST_NAME).write_text("epoch-0099")
    return lamploop.latest_checkpoint(tmp)


REPORTERS = [
    case(
        "LoggingReporter logger an int",
        lambda _: lamploop.LoggingReporter(logger=5),
        "logger",
    ),
    case(
        "LoggingReporter level a str",
        lambda _: lamploop.LoggingReporter(level="loud"),
        "level",
    ),
    case(
        "MetricsFileReporter path an int",
        lambda _: reporting.MetricsFileReporter(5),
        "path",
    ),
    case(
        "MetricsFileReporter format xml",
        lambda tmp: reporting.MetricsFileReporter(tmp / "m.xml", format="xml"),
        "format",
    ),
    case(
        "MetricsFileReporter a directory",
        lambda tmp: reporting.MetricsFileReporter(tmp, format="csv"),
        "director|path",
    ),
    case(
        "MetricsFileReporter unknown suffix",
        lambda tmp: reporting.MetricsFileReporter(tmp / "metrics.parquet"),
        "format|suffix|parquet",
    ),
    case(
        "ProgressReporter file an int",
        lambda _: reporting.ProgressReporter(file=5),
        "file",
    ),
    case(
        "ProgressReporter refresh 0",
        lambda _: reporting.ProgressReporter(refresh_per_second=0),
        "refresh_per_second",
    ),
    case("PrometheusReporter port -1", lambda _: reporting.PrometheusReporter(port=-1), "port"),
    case(
        "TensorBoardReporter log_dir an int",
        lambda _: reporting.TensorBoardReporter(5),
        "log_dir",
    ),
    case(
        "TensorBoardReporter flush_secs 0",
        lambda tmp: reporting.TensorBoardReporter(tmp, flush_secs=0),
        "flush_secs",
    ),
    case(
        "MlflowReporter close_timeout -1",
        lambda _: reporting.MlflowReporter(close_timeout=-1),
        "close_timeout|mlflow",
    ),
    case(
        "report_all reporters an int",
        lambda _: reporting.report_all(5, _event()),
        "reporters",
    ),
]


METRICS = [
    case(
        "accuracy shapes differ",
        lambda _: metrics.accuracy(torch.randn(4, 3), torch.randint(0, 3, (5,))),
        "shape|target|output",
    ),
    case(
        "accuracy in a fit with regression outputs",
        lambda _: _fit(
            model=_model(metrics={"accuracy": metrics.accuracy}),
            train_batches=_yielding((X, Y[:, None].float())),
        ),
        "accuracy|batch 0",
    ),
    case(
        "PassResult loss a str",
        lambda _: metrics.PassResult(loss="x", metrics={}),
        "loss",
    ),
    case(
        "PassResult metrics a list",
        lambda _: metrics.PassResult(loss=1.0, metrics=[1.0]),
        "metrics",
    ),
    case(
        "cross_entropy_loss shapes differ",
        lambda _: lamploop.cross_entropy_loss(torch.randn(4, 3), Y[:5]),
        "shape|target",
    ),
    case(
        "mse_loss shapes differ",
        lambda _: lamploop.mse_loss(torch.randn(4, 1), torch.randn(5)),
        "shape|target",
    ),
]

STREAMING = [
    case("FifoBuffer capacity 0", lambda _: _buffer(capacity=0, watermark=0), "capacity"),
    case("FifoBuffer watermark above capacity", lambda _: _buffer(watermark=9), "watermark"),
    case("FifoBuffer seed -1", lambda _: _buffer(seed=-1), "seed"),
    case("FifoBuffer max_reads 0", lambda _: _buffer(max_reads=0), "max_reads"),
    case(
        "FifoBuffer on_read an int",
        lambda _: _buffer(on_read=5),
        "on_read",
    ),
    case(
        "StreamBuffer policy an int",
        lambda _: streaming.StreamBuffer(policy=5, capacity=4, watermark=2),
        "policy",
    ),
    case("FiroBuffer without a seed", lambda _: streaming.FiroBuffer(capacity=4, watermark=2), "seed"),
    case(
        "ReservoirBuffer capacity -1",
        lambda _: streaming.ReservoirBuffer(capacity=-1, watermark=1, seed=0),
        "capacity",
    ),
    case(
        "Sample producer an int",
        lambda _: streaming.Sample(producer=5, seq=0, tensors={"x": X[0]}),
        "producer",
    ),
    case(
        "Sample seq -1",
        lambda _: streaming.Sample(producer="p", seq=-1, tensors={"x": X[0]}),
        "seq",
    ),
    case(
        "Sample tensors a tensor",
        lambda _: streaming.Sample(producer="p", seq=0, tensors=X[0]),
        "tensors",
    ),
    case(
        "Sample tensors of lists",
        lambda _: streaming.Sample(producer="p", seq=0, tensors={"x": [1.0]}),
        "x",
    ),
    case(
        "buffer_batches buffer an int",
        lambda _: streaming.buffer_batches(5, batch_size=2, batches_per_epoch=2),
        "buffer",
    ),
    case(
        "buffer_batches batch_size 0",
        lambda _: streaming.buffer_batches(_buffer(), batch_size=0, batches_per_epoch=2),
        "batch_size",
    ),
    case(
        "buffer_batches batch_size above capacity",
        lambda _: streaming.buffer_batches(_buffer(), batch_size=9, batches_per_epoch=2),
        "batch_size",
    ),
    case(
        "buffer_batches batches_per_epoch 0",
        lambda _: streaming.buffer_batches(_buffer(), batch_size=2, batches_per_epoch=0),
        "batches_per_epoch",
    ),
    case(
        "buffer_batches collate an int",
        lambda _: _in_loop(
            lambda: streaming.buffer_batches(_buffer(), batch_size=2, batches_per_epoch=1, collate=5)
        ),
        "collate",
    ),
    case(
        "buffer_batches made outside an event loop",
        lambda _: streaming.buffer_batches(_buffer(), batch_size=2, batches_per_epoch=1),
        "event loop",
    ),
    case(
        "stack_samples features an int",
        lambda _: streaming.stack_samples(features=5),
        "features",
    ),
    case(
        "stack_samples missing tensor",
        lambda _: streaming.stack_samples()([streaming.Sample(producer="p", seq=0, tensors={"x": X[0]})]),
        "'y'|y",
    ),
    case(
        "StreamState buffer an int",
        lambda _: streaming.StreamState(5),
        "buffer",
    ),
]

CONTROL = [
    case("Train epoch -1", lambda _: control.Train(epoch=-1, lr_factor=1.0), "epoch"),
    case("Train lr_factor nan", lambda _: control.Train(epoch=0, lr_factor=NAN), "lr_factor"),
    case("Valid epoch a str", lambda _: control.Valid(epoch="0"), "epoch"),
    case("Stop reason an int", lambda _: control.Stop(reason=5), "reason"),
    case("Rendezvous port -1", lambda _: control.Rendezvous(host="127.0.0.1", port=-1), "port"),
    case("local_control nranks 0", lambda _: lamploop.local_control(0), "nranks"),
    case("local_control join_timeout 0", lambda _: lamploop.local_control(2, join_timeout=0), "join_timeout"),
    case("TcpControlRoot nranks 0", lambda _: _tcp_root(nranks=0), "nranks"),
    case("TcpControlRoot token empty", lambda _: _tcp_root(token=""), "token"),
    case("TcpControlRoot model_spec an int", lambda _: _tcp_root(model_spec=5), "model_spec"),
    case("TcpControlRoot port -1", lambda _: _tcp_root(port=-1), "port"),
    case(
        "TcpControlRoot heartbeat_interval above timeout",
        lambda _: _tcp_root(heartbeat_interval=5.0),
        "heartbeat",
    ),
    case("TcpControlRoot max_frame_bytes 0", lambda _: _tcp_root(max_frame_bytes=0), "max_frame_bytes"),
    case("TcpControlRoot join_timeout nan", lambda _: _tcp_root(join_timeout=NAN), "join_timeout"),
    case(
        "TcpControlRoot handshake_timeout -1",
        lambda _: _tcp_root(handshake_timeout=-1.0),
        "handshake_timeout",
    ),
    case(
        "TcpControlRoot max_pending_handshakes 0",
        lambda _: _tcp_root(max_pending_handshakes=0),
        "max_pending_handshakes",
    ),
    case("TcpControlFollower rank 0", lambda _: _tcp_follower(rank=0), "rank"),
    case("TcpControlFollower port 0", lambda _: _tcp_follower(port=0), "port"),
    case(
        "TcpControlFollower connect_timeout 0", lambda _: _tcp_follower(connect_timeout=0), "connect_timeout"
    ),
    case("TcpControlFollower token empty", lambda _: _tcp_follower(token=b""), "token"),
]

FEDERATED = [
    case("AggregatorSettings rounds a str", lambda _: _aggregator_settings(rounds="1"), "rounds"),
    case("AggregatorSettings min_nodes 0", lambda _: _aggregator_settings(min_nodes=0), "min_nodes"),
    case(
        "AggregatorSettings expected below min",
        lambda _: _aggregator_settings(min_nodes=3, expected_nodes=2),
        "expected_nodes",
    ),
    case(
        "AggregatorSettings join_timeout -1", lambda _: _aggregator_settings(join_timeout=-1), "join_timeout"
    ),
    case(
        "AggregatorSettings round_timeout nan",
        lambda _: _aggregator_settings(round_timeout=NAN),
        "round_timeout",
    ),
    case(
        "AggregatorSettings round_attempts 0",
        lambda _: _aggregator_settings(round_attempts=0),
        "round_attempts",
    ),
    case(
        "AggregatorSettings max_frame_bytes 0",
        lambda _: _aggregator_settings(max_frame_bytes=0),
        "max_frame_bytes",
    ),
    case("AggregatorSettings keep_last 0", lambda _: _aggregator_settings(keep_last=0), "keep_last"),
    case(
        "AggregatorSettings checkpoint_dir an int",
        lambda _: _aggregator_settings(checkpoint_dir=5),
        "checkpoint_dir",
    ),
    case(
        "NodeSettings connect_timeout 0",
        lambda _: federated.NodeSettings(connect_timeout=0),
        "connect_timeout",
    ),
    case(
        "NodeSettings retry_interval nan",
        lambda _: federated.NodeSettings(retry_interval=NAN),
        "retry_interval",
    ),
    case("NodeSettings idle_timeout -1", lambda _: federated.NodeSettings(idle_timeout=-1), "idle_timeout"),
    case(
        "NodeSettings max_frame_bytes 0",
        lambda _: federated.NodeSettings(max_frame_bytes=0),
        "max_frame_bytes",
    ),
    case("OptimizerConfig name unknown", lambda _: _optimizer_config(name="lion9"), "lion9"),
    case(
        "OptimizerConfig learning_rate -1", lambda _: _optimizer_config(learning_rate=-1.0), "learning_rate"
    ),
    case(
        "OptimizerConfig betas out of range",
        lambda _: _optimizer_config(name="adam", betas=(1.5, 0.9)),
        "betas",
    ),
    case(
        "OptimizerConfig betas a float",
        lambda _: _optimizer_config(name="adam", betas=0.9),
        "betas",
    ),
    case("OptimizerConfig weight_decay -1", lambda _: _optimizer_config(weight_decay=-1.0), "weight_decay"),
    case("TrainingPlan local_epochs 0", lambda _: _plan(local_epochs=0), "local_epochs"),
    case(
        "TrainingPlan neither epochs nor steps",
        lambda _: _plan(local_epochs=None, local_steps=None),
        "local_epochs|local_steps",
    ),
    case(
        "TrainingPlan both epochs and steps",
        lambda _: _plan(local_epochs=1, local_steps=5),
        "local_epochs|local_steps",
    ),
    case("TrainingPlan optimizer_state unknown", lambda _: _plan(optimizer_state="maybe"), "optimizer_state"),
    case("TrainingPlan average unknown", lambda _: _plan(average="median"), "average"),
    case("TrainingPlan loss unknown", lambda _: _plan(loss="hinge9"), "hinge9|loss"),
    case("TrainingPlan metric unknown", lambda _: _plan(metrics=("f9",)), "f9|metric"),
    case(
        "TrainingPlan model an int",
        lambda _: _plan(model=5),
        "model",
    ),
    case(
        "TrainingPlan optimizer a dict",
        lambda _: _plan(optimizer={"name": "sgd"}),
        "optimizer",
    ),
    case("TrainingPlan seed -1", lambda _: _plan(seed=-1), "seed"),
    case("plan_from_json an int", lambda _: federated.plan_from_json(5), "plan"),
    case("plan_from_json empty", lambda _: federated.plan_from_json({}), "plan"),
    case("plan_from_json name an int", lambda _: federated.plan_from_json(_plan_json(name=5)), "name"),
    case("plan_from_json extra key", lambda _: federated.plan_from_json(_plan_json(surprise=1)), "surprise"),
    case(
        "plan_from_json optimizer lr a str",
        lambda _: federated.plan_from_json(_plan_json(optimizer={"name": "sgd", "learning_rate": "fast"})),
        "learning_rate",
    ),
    case("load_plan missing", lambda tmp: federated.load_plan(tmp / "nope.json"), "nope"),
    case("load_plan garbage", lambda tmp: federated.load_plan(_written(tmp, "{oops")), "plan.json|json"),
    case("load_plan a directory", lambda tmp: federated.load_plan(tmp), "director|path"),
    case(
        "save_plan not a plan",
        lambda tmp: federated.save_plan(5, tmp / "p.json"),
        "plan",
    ),
    case("load_allow_list missing", lambda tmp: federated.load_allow_list(tmp / "nope.json"), "nope"),
    case(
        "load_allow_list garbage",
        lambda tmp: federated.load_allow_list(_written(tmp, "[1, 2]")),
        "plan.json|allow",
    ),
    case(
        "save_allow_list not a list",
        lambda tmp: federated.save_allow_list(5, tmp / "a.json"),
        "allow_list",
    ),
    case(
        "approve_plan not a plan",
        lambda tmp: federated.approve_plan(5, tmp / "a.json"),
        "plan",
    ),
    case(
        "AllowList approved an int",
        lambda _: federated.AllowList(approved=5),
        "approved",
    ),
    case("mlp empty options", lambda _: federated.mlp({}), "sizes"),
    case("mlp dtype unknown", lambda _: federated.mlp({"sizes": [4, 2], "dtype": "float8"}), "dtype"),
    case(
        "mlp options an int",
        lambda _: federated.mlp(5),
        "options",
    ),
    case(
        "build_model unknown architecture",
        lambda _: federated.build_model(
            federated.ModelDescription("resnet9000", {}, lamploop.model_spec(_module()))
        ),
        "resnet9000",
    ),
    case(
        "build_model a spec that does not fit",
        lambda _: federated.build_model(
            federated.ModelDescription("mlp", {"sizes": [4, 2]}, lamploop.model_spec(torch.nn.Linear(4, 3)))
        ),
        "weight|spec|tensors",
    ),
    case(
        "build_model not a description",
        lambda _: federated.build_model(5),
        "description",
    ),
    case("describe_model options an int", lambda _: federated.describe_model("mlp", 5, _module()), "options"),
    case(
        "describe_model module an int",
        lambda _: federated.describe_model("mlp", {}, 5),
        "module",
    ),
    case("federated_average no updates", lambda _: _average([]), "update", FederatedError),
    case(
        "federated_average zero examples",
        lambda _: _average([("a", 0, {"w": torch.ones(2)})]),
        "example",
        FederatedError,
    ),
    case(
        "federated_average negative count",
        lambda _: _average([("a", -1, {"w": torch.ones(2)}), ("b", 3, {"w": torch.ones(2)})]),
        "'?a'?|count",
        FederatedError,
    ),
    case(
        "federated_average a missing tensor",
        lambda _: _average([("nodeA", 1, {})]),
        "nodeA",
        FederatedError,
    ),
    case(
        "federated_average a tensor of another shape",
        lambda _: _average([("nodeA", 1, {"w": torch.ones(3)})]),
        "nodeA.*w|w.*nodeA",
        FederatedError,
    ),
    case(
        "federated_average a tensor of another dtype",
        lambda _: _average([("nodeA", 1, {"w": torch.ones(2, dtype=torch.float64)})]),
        "nodeA",
        FederatedError,
    ),
    case(
        "federated_average names not in the model",
        lambda _: _average([("nodeA", 1, {"w": torch.ones(2)})], names=frozenset({"v"})),
        "v",
    ),
    case("run_aggregator settings an int", lambda _: _aggregate(settings=5), "settings"),
    case("run_aggregator plan an int", lambda _: _aggregate(plan=5), "plan"),
    case(
        "run_aggregator an initial model that does not fit",
        lambda _: _aggregate(initial_model=torch.nn.Linear(4, 3)),
        "initial_model|weight",
    ),
    case("run_aggregator empty token", lambda _: _aggregate(token=""), "token"),
    case("run_aggregator port -1", lambda _: _aggregate(port=-1), "port"),
    case("run_node port -1", lambda tmp: _run_node(tmp, port=-1), "port"),
    case("run_node name empty", lambda tmp: _run_node(tmp, name=""), "name"),
    case("run_node settings an int", lambda tmp: _run_node(tmp, settings=5), "settings"),
    case("run_node train_batches tensors", lambda tmp: _run_node(tmp, train_batches=X), "train_batches"),
]


def _in_loop(make: Callable[[], object]) -> object:
    async def run() -> object:
        return make()

    return anyio.run(run)


def _written(tmp: Path, text: str) -> Path:
    path = tmp / "plan.json"
    path.write_text(text)
    return path


def _run_node(tmp: Path, **changes: Any) -> object:
    allow = tmp / "allow.json"
    if not allow.exists():
        federated.save_allow_list(federated.AllowList(), allow)
    kwargs: dict[str, Any] = {
        "name": "node",
        "host": "127.0.0.1",
        "port": 1,
        "token": "t",
        "allow_list": allow,
        "train_batches": _batches(),
        "settings": federated.NodeSettings(connect_timeout=1.0, retry_interval=0.1, handshake_timeout=1.0),
    }
    kwargs.update(changes)
    return _run_async(federated.run_node, kwargs)


PIPELINE = [
    case("PipelineSpec boundaries a str", lambda _: pipeline.PipelineSpec(boundaries="2"), "boundar"),
    case(
        "PipelineSpec n_microbatches 0",
        lambda _: pipeline.PipelineSpec(boundaries=(1,), n_microbatches=0),
        "n_microbatches",
    ),
    case(
        "PipelineSpec schedule unknown",
        lambda _: pipeline.PipelineSpec(boundaries=(1,), schedule="zigzag"),
        "zigzag|schedule",
    ),
    case(
        "PipelineSpec 1f1b with too few microbatches",
        lambda _: pipeline.PipelineSpec(boundaries=(1, 2), n_microbatches=1, schedule="1f1b"),
        "n_microbatches|1f1b",
    ),
    case("split_sequential a Linear", lambda _: pipeline.split_sequential(_module(), [1]), "Sequential"),
    case("split_sequential boundary 0", lambda _: pipeline.split_sequential(_seq(), [0]), "boundar"),
    case(
        "split_sequential boundary past the end",
        lambda _: pipeline.split_sequential(_seq(), [5]),
        "boundar|5",
    ),
    case(
        "split_sequential boundaries an int",
        lambda _: pipeline.split_sequential(_seq(), 1),
        "boundar",
    ),
    case("stage_checkpoint_dir stage -1", lambda tmp: pipeline.stage_checkpoint_dir(tmp, -1), "stage_index"),
    case(
        "stage_checkpoint_dir directory an int",
        lambda _: pipeline.stage_checkpoint_dir(5, 0),
        "directory",
    ),
    case(
        "stage_checkpointer keep_last 0",
        lambda tmp: pipeline.stage_checkpointer(tmp, 0, keep_last=0),
        "keep_last",
    ),
    case(
        "stage_checkpointer directory a file",
        lambda tmp: pipeline.stage_checkpointer(_a_file(tmp), 0),
        "a-file",
    ),
    case("saved_epochs stage a str", lambda tmp: pipeline.saved_epochs(tmp, "0"), "stage_index"),
    case(
        "load_stage_checkpoint stage beyond stages",
        lambda tmp: pipeline.load_stage_checkpoint(tmp, stage_index=2, num_stages=2),
        "stage_index",
    ),
    case(
        "load_stage_checkpoint num_stages 0",
        lambda tmp: pipeline.load_stage_checkpoint(tmp, stage_index=0, num_stages=0),
        "num_stages|stage_index",
    ),
    case(
        "open_pipeline_group rank beyond world",
        lambda _: _enter(
            pipeline.open_pipeline_group(rank=2, world_size=2, host="127.0.0.1", port=1, timeout=1.0)
        ),
        "rank",
    ),
    case(
        "open_pipeline_group timeout 0",
        lambda _: _enter(
            pipeline.open_pipeline_group(rank=0, world_size=2, host="127.0.0.1", port=1, timeout=0)
        ),
        "timeout",
    ),
    case("train_pipeline a Linear", lambda _: _train_pipeline(model=_module()), "Sequential|model"),
    case("train_pipeline spec an int", lambda _: _train_pipeline(spec=5), "spec"),
    case("train_pipeline max_epochs -1", lambda _: _train_pipeline(max_epochs=-1), "max_epochs"),
    case(
        "train_pipeline two stages on one rank",
        lambda _: _train_pipeline(spec=pipeline.PipelineSpec(boundaries=(2,))),
        "2 stages",
        ConfigurationError,
    ),
    case(
        "train_pipeline a batch not a multiple of the microbatches",
        lambda _: _train_pipeline(
            spec=pipeline.PipelineSpec(boundaries=(), n_microbatches=3),
            train_batches=_yielding((X[:8], Y[:8])),
        ),
        "n_microbatches|multiple|micro",
        BatchError,
    ),
    case(
        "train_pipeline no process group",
        lambda _: _run_async(
            pipeline.train_pipeline,
            {
                "model": _seq(),
                "spec": pipeline.PipelineSpec(boundaries=()),
                "optimizer_factory": _sgd,
                "train_batches": _batches(),
                "max_epochs": 1,
            },
        ),
        "open_pipeline_group",
        ConfigurationError,
    ),
    case(
        "train_pipeline optimizer_factory None",
        lambda _: _train_pipeline(optimizer_factory=None),
        "optimizer_factory",
    ),
]


def _enter(manager: Any) -> object:
    with manager as group:
        return group


SYNC = [
    case("CompressedAllReduce wire fp8", lambda _: sync.CompressedAllReduce(wire="fp8"), "wire"),
    case(
        "CompressedAllReduce growth_interval 0",
        lambda _: sync.CompressedAllReduce(growth_interval=0),
        "growth_interval",
    ),
    case("LocalSGD every_n_steps 0", lambda _: sync.LocalSGD(every_n_steps=0), "every_n_steps"),
    case("LocalSGD outer an int", lambda _: sync.LocalSGD(outer=5), "outer"),
    case("OuterNesterov lr -1", lambda _: sync.OuterNesterov(lr=-1.0), "lr"),
    case("OuterNesterov momentum 1.5", lambda _: sync.OuterNesterov(momentum=1.5), "momentum"),
    case("PowerSGD rank 0", lambda _: sync.PowerSGD(rank=0), "rank"),
    case("PowerSGD seed -1", lambda _: sync.PowerSGD(seed=-1), "seed"),
    case("FullyShard param_dtype unknown", lambda _: sync.FullyShard(param_dtype="float9"), "param_dtype"),
    case(
        "FullyShard units an int",
        lambda _: sync.FullyShard(units=5),
        "units",
    ),
    case("strategy_named unknown", lambda _: sync.strategy_named("telepathy"), "telepathy"),
    case("strategy_named an int", lambda _: sync.strategy_named(5), "name|5"),
    case("register_strategy an int", lambda _: lamploop.register_strategy(5), "strategy"),
    case(
        "register_strategy a taken name",
        lambda _: lamploop.register_strategy(sync.strategy_named("all_reduce")),
        "all_reduce",
    ),
]

SETTINGS = [
    case(
        "drive init_state whose loop_state is an int",
        lambda _: _drive(init_state=_state_with(loop_state=5)),
        "loop_state",
    ),
    case(
        "epochs init_state with a curve of ints",
        lambda _: _epochs(init_state=lamploop.LoopState(epoch=1, learning_curve=[1])),
        "learning_curve",
    ),
    case(
        "epochs init_state with a str last validation loss",
        lambda _: _epochs(init_state=lamploop.LoopState(epoch=1, last_validation_loss="0.5")),
        "last_validation_loss",
    ),
    case(
        "epochs init_state with a negative min_validation_epoch",
        lambda _: _epochs(init_state=lamploop.LoopState(epoch=1, min_validation_epoch=-1)),
        "min_validation_epoch",
    ),
    case(
        "drive init_state whose loop_state has a curve of dicts",
        lambda _: _drive(init_state=_state_with(loop_state=lamploop.LoopState(epoch=1, learning_curve=[{}]))),
        r"loop_state\.learning_curve\[0\]",
    ),
    case("TrainingSettings max_epochs -1", lambda _: lamploop.TrainingSettings(max_epochs=-1), "max_epochs"),
    case(
        "TrainingSettings validation_frequency 0",
        lambda _: lamploop.TrainingSettings(validation_frequency=0),
        "validation_frequency",
    ),
    case(
        "TrainingSettings smoothing nan",
        lambda _: lamploop.TrainingSettings(validation_loss_exponential_smoothing_factor=NAN),
        "validation_loss_exponential_smoothing_factor",
    ),
    case(
        "TrainingSettings accumulate 0",
        lambda _: lamploop.TrainingSettings(accumulate_gradient_over_n_batches=0),
        "accumulate_gradient_over_n_batches",
    ),
    case(
        "TrainingSettings strategy unknown",
        lambda _: lamploop.TrainingSettings(strategy="telepathy"),
        "telepathy",
    ),
    case(
        "TrainingSettings bucket_cap_mb -1",
        lambda _: lamploop.TrainingSettings(bucket_cap_mb=-1.0),
        "bucket_cap_mb",
    ),
    case(
        "TrainingSettings collective_timeout 0",
        lambda _: lamploop.TrainingSettings(collective_timeout=0.0),
        "collective_timeout",
    ),
    case(
        "TrainingSettings checkpoint_every_n_steps 0",
        lambda _: lamploop.TrainingSettings(checkpoint_every_n_steps=0),
        "checkpoint_every_n_steps",
    ),
    case(
        "TrainingSettings on_non_finite_loss bad",
        lambda _: lamploop.TrainingSettings(on_non_finite_loss="x"),
        "on_non_finite_loss",
    ),
    case("TrainingSettings precision bad", lambda _: lamploop.TrainingSettings(precision="64"), "precision"),
    case(
        "TrainingSettings lr_scheduler_interval bad",
        lambda _: lamploop.TrainingSettings(lr_scheduler_interval="x"),
        "lr_scheduler_interval",
    ),
    case(
        "TrainingSettings model_selection_mode bad",
        lambda _: lamploop.TrainingSettings(model_selection_mode="x"),
        "model_selection_mode",
    ),
    case(
        "TrainingSettings early_stopping_patience 0",
        lambda _: lamploop.TrainingSettings(early_stopping_patience=0),
        "early_stopping_patience",
    ),
    case(
        "TrainingSettings learning_rate_schedule an int",
        lambda _: lamploop.TrainingSettings(learning_rate_schedule=5),
        "learning_rate_schedule",
    ),
    case("TrainingSettings averaging an int", lambda _: lamploop.TrainingSettings(averaging=5), "averaging"),
]

ALL = FIT + EPOCHS + ONE_EPOCH + DRIVERS + MODEL + BATCHES + SCHEDULES + AVERAGING + CHECKPOINTS
ALL += REPORTERS + METRICS + STREAMING + CONTROL + FEDERATED + PIPELINE + SYNC + SETTINGS


@pytest.mark.timeout(30, method="signal")
@pytest.mark.parametrize(("call", "error", "pattern"), ALL)
def test_a_bad_input_gets_a_lamploop_error_naming_it(
    call: Case, error: type[BaseException], pattern: str, tmp_path: Path
) -> None:
    with pytest.raises(Exception) as info:  # noqa: PT011 - any raise is caught, then judged below
        call(tmp_path)
    raised = info.value
    assert isinstance(raised, LamploopError), (
        f"a raw {type(raised).__name__} instead of a lamploop error: {raised!r}"
    )
    assert isinstance(raised, error), f"{type(raised).__name__} instead of {error.__name__}: {raised}"
    assert re.search(pattern, str(raised), re.IGNORECASE), (
        f"the message does not match {pattern!r}: {type(raised).__name__}: {raised}"
    )
