"""Hostile inputs, round 6: federated rounds, the pipeline, schedules and the loop's options.

What a hostile user meets from the docs alone (docs/federated.md, pipeline.md, schedules.md,
loop.md, training.md, concepts/schedules.md, DESIGN.md): every keyword of the federated
plan, settings, aggregator and node, of the pipeline's spec and ``train_pipeline``, of the
epoch and step schedules, and of ``one_epoch`` / ``fit`` (precision, clipping, accumulation,
non-finite policies, metrics, model selection) given the wrong type or value; schedule
functions that return NaN, negative numbers, non-numbers or the wrong shape; nodes whose
training fails on their own data and a node SIGKILLed inside a round (a real process);
pipeline ranks whose stages do not fit together or that were given different set-ups (real
processes, Gloo). Each bad input must end in a lamploop error (``lamploop.errors``) whose
message says what was wrong and where, before training starts where it can be checked then,
within a bound. Where the docs say a result is exact it is compared with a float64 reference
written here: FedAvg is the sample-weighted mean of the nodes' trained parameters; a one-stage
pipeline with micro-batches and an epoch schedule is hand-written SGD; ``k`` accumulated
batches (clipped or not, with a skipped step or not) are one step on their union; the step
and epoch schedules' rates are their documented formulas; a metric is its sum over its count.
Written from the docs alone; the 6 defects it found are fixed and their cases pass
(CHANGELOG). Tiny CPU tensors; real processes and sockets on 127.0.0.1; every
wait bounded.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.nn.functional as F
from support import free_port
from torch import nn

import lamploop
import lamploop.federated as federated
import lamploop.metrics as metrics
import lamploop.pipeline as pipeline
from lamploop.errors import (
    BatchError,
    CheckpointError,
    ConfigurationError,
    FederatedError,
    LamploopError,
    NonFiniteLossError,
)
from lamploop.schedules import warmup_cosine, warmup_linear

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/, for workers.hostile_r6_worker
from workers.hostile_r6_worker import CLASSES, FEATURES, build, data

WORKER = Path(__file__).resolve().parent / "workers" / "hostile_r6_worker.py"
NAN = math.nan
INF = math.inf
BOUND_S = 30.0  # generous: a loaded 2-core machine
TOKEN = "hostile-r6-token-0123456789abcdef"

torch.manual_seed(0)
X, Y = torch.randn(16, 4), torch.randint(0, 2, (16,))


# ----------------------------------------------------------------------------- helpers


class Boom(Exception):
    """What the user's callbacks raise."""


def _run(make: Callable[[], Any]) -> Any:
    async def main() -> Any:
        with anyio.fail_after(BOUND_S):
            return await make()

    return anyio.run(main)


MLP = {"sizes": [4, 2], "seed": 0}


def _plan(**changes: Any) -> federated.TrainingPlan:
    kwargs: dict[str, Any] = {
        "name": "hostile-r6",
        "model": federated.describe_model("mlp", MLP, federated.mlp(MLP)),
        "optimizer": federated.OptimizerConfig("sgd", learning_rate=0.1),
    }
    kwargs.update(changes)
    return federated.TrainingPlan(**kwargs)


def _aggregate(**changes: Any) -> Any:
    kwargs: dict[str, Any] = {
        "plan": _plan(),
        "initial_model": federated.mlp(MLP),
        "token": TOKEN,
        "settings": federated.AggregatorSettings(rounds=1, join_timeout=0.5),
    }
    kwargs.update(changes)
    return _run(lambda: federated.run_aggregator(**kwargs))


def _fedavg(global_model: dict[str, torch.Tensor], *updates: tuple[str, Any, dict[str, torch.Tensor]]) -> Any:
    return federated.federated_average(global_model, list(updates), names=frozenset(global_model))


def _saved_plan_read_back(tmp: Path, **changes: Any) -> Any:
    path = federated.save_plan(_plan(**changes), tmp / "plan.json")
    return federated.load_plan(path)


def _seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _train_pipeline(**changes: Any) -> Any:
    kwargs: dict[str, Any] = {
        "model": _seq(),
        "spec": pipeline.PipelineSpec(boundaries=()),
        "optimizer_factory": lambda params: torch.optim.SGD(params, lr=0.1),
        "train_batches": lamploop.tensor_batches(X, Y, batch_size=8),
        "max_epochs": 1,
    }
    kwargs.update(changes)
    with pipeline.open_pipeline_group(rank=0, world_size=1, host="127.0.0.1", port=free_port(), timeout=10):
        return anyio.run(partial(pipeline.train_pipeline, **kwargs))


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _fit(**changes: Any) -> Any:
    kwargs: dict[str, Any] = {
        "model": lamploop.SupervisedModel(nn.Linear(4, 2)),
        "optimizer_factory": _sgd,
        "train_batches": lamploop.tensor_batches(X, Y, batch_size=4),
        "max_epochs": 2,
        "reporters": [],
        "device": "cpu",
    }
    kwargs.update(changes)
    return lamploop.fit(**kwargs)


def _fit_valid(**changes: Any) -> Any:
    return _fit(validation_batches=lamploop.tensor_batches(X, Y, batch_size=8, shuffle=False), **changes)


def _one_epoch(**changes: Any) -> Any:
    module = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)

    async def stream() -> Any:
        yield X[:8], Y[:8]
        yield X[8:], Y[8:]

    kwargs: dict[str, Any] = {
        "model": lamploop.SupervisedModel(module),
        "batches": stream(),
        "step_optimizer": optimizer.step,
    }
    kwargs.update(changes)
    return _run(lambda: lamploop.one_epoch(**kwargs))


def _local_two_replicas(**changes: Any) -> Any:
    replicas = [
        (lamploop.SupervisedModel(nn.Linear(4, 2)), lamploop.tensor_batches(X, Y, batch_size=4), None)
        for _ in range(2)
    ]
    kwargs: dict[str, Any] = {"optimizer_factory": _sgd, "max_epochs": 1}
    kwargs.update(changes)
    return _run(lambda: lamploop.local_data_parallel_training_loop(replicas, **kwargs))


class _Returns:
    """An epoch schedule of one's own whose ``learning_rate_factor`` returns ``value``."""

    def __init__(self, value: object) -> None:
        self.value = value

    def init(self) -> None:
        return None

    def learning_rate_factor(self, state: None, epoch: int, last_validation_loss: float | None) -> Any:
        return self.value


class _Step:
    """A step schedule whose factor is ``value`` at (epoch 1, step 2), 1 elsewhere."""

    def __init__(self, value: object) -> None:
        self.value = value

    def factor(self, epoch: int, step: int) -> object:
        return self.value if (epoch, step) == (1, 2) else 1.0


def _nan_rows(rows: int = 16) -> torch.Tensor:
    return torch.full((rows, 4), NAN)


# ----------------------------------------------------------------------------- the sweep


def case(
    name: str,
    call: Callable[[Path], object],
    pattern: str,
    error: type[BaseException] = ConfigurationError,
) -> Any:
    return pytest.param(call, error, pattern, id=name)


HOSTILE = [
    # -- the training plan and its parts
    case("TrainingPlan local_epochs True", lambda _: _plan(local_epochs=True), "local_epochs.*True"),
    case("TrainingPlan local_epochs 1.0", lambda _: _plan(local_epochs=1.0), "local_epochs.*1.0"),
    case(
        "TrainingPlan local_epochs and local_steps",
        lambda _: _plan(local_epochs=1, local_steps=3),
        "exactly one of local_epochs and local_steps",
    ),
    case(
        "TrainingPlan neither local_epochs nor local_steps",
        lambda _: _plan(local_epochs=None),
        "exactly one of local_epochs and local_steps",
    ),
    case(
        "TrainingPlan optimizer_state 'kept'",
        lambda _: _plan(optimizer_state="kept"),
        "optimizer_state.*'kept'",
    ),
    case("TrainingPlan average 'buffers'", lambda _: _plan(average="buffers"), "average.*'buffers'"),
    case("TrainingPlan loss 'nll'", lambda _: _plan(loss="nll"), "loss.*'nll'"),
    case("TrainingPlan metrics ('f1',)", lambda _: _plan(metrics=("f1",)), "metrics.*'f1'"),
    case("TrainingPlan metrics a bare str", lambda _: _plan(metrics="accuracy"), "metrics"),
    case("TrainingPlan seed '0'", lambda _: _plan(seed="0"), "seed.*'0'"),
    case("TrainingPlan seed -1", lambda _: _plan(seed=-1), "seed.*-1"),
    case("TrainingPlan model a dict", lambda _: _plan(model={"architecture": "mlp"}), "model.*dict"),
    case("TrainingPlan optimizer a str", lambda _: _plan(optimizer="sgd"), "optimizer.*str"),
    case("TrainingPlan format_version 2", lambda _: _plan(format_version=2), "format_version.*2"),
    case(
        "TrainingPlan name an int",
        lambda _: _plan(name=5),
        "name.*5",
    ),
    case(
        "OptimizerConfig learning_rate '0.1'",
        lambda _: federated.OptimizerConfig("sgd", learning_rate="0.1"),
        "learning_rate.*'0.1'",
    ),
    case(
        "OptimizerConfig learning_rate nan",
        lambda _: federated.OptimizerConfig("sgd", learning_rate=NAN),
        "nan",
    ),
    case(
        "OptimizerConfig learning_rate 0",
        lambda _: federated.OptimizerConfig("sgd", learning_rate=0.0),
        "> 0",
    ),
    case(
        "OptimizerConfig name lbfgs",
        lambda _: federated.OptimizerConfig("lbfgs", learning_rate=0.1),
        "'lbfgs'",
    ),
    case(
        "OptimizerConfig betas of one",
        lambda _: federated.OptimizerConfig("adam", learning_rate=0.1, betas=(0.9,)),
        "betas",
    ),
    case(
        "OptimizerConfig weight_decay inf",
        lambda _: federated.OptimizerConfig("sgd", learning_rate=0.1, weight_decay=INF),
        "weight_decay.*inf",
    ),
    case("mlp sizes '4,2'", lambda _: federated.mlp({"sizes": "4,2"}), "sizes.*'4,2'"),
    case("mlp sizes with a float", lambda _: federated.mlp({"sizes": [4, 2.0]}), "sizes"),
    case(
        "mlp dtype float16", lambda _: federated.mlp({"sizes": [4, 2], "dtype": "float16"}), "dtype.*float16"
    ),
    case("mlp seed 'x'", lambda _: federated.mlp({"sizes": [4, 2], "seed": "x"}), "seed.*'x'"),
    case(
        "describe_model architecture ''",
        lambda _: federated.describe_model("", MLP, federated.mlp(MLP)),
        "architecture",
    ),
    case(
        "describe_model options holding a tensor",
        lambda _: federated.describe_model("mlp", {**MLP, "t": torch.ones(1)}, federated.mlp(MLP)),
        "options.t.*JSON",
    ),
    case("describe_model module None", lambda _: federated.describe_model("mlp", MLP, None), "NoneType"),
    # -- settings
    case("AggregatorSettings rounds 1.5", lambda _: federated.AggregatorSettings(rounds=1.5), "rounds.*1.5"),
    case(
        "AggregatorSettings expected_nodes below min_nodes",
        lambda _: federated.AggregatorSettings(rounds=1, min_nodes=3, expected_nodes=2),
        "expected_nodes.*2",
    ),
    case(
        "AggregatorSettings round_timeout nan",
        lambda _: federated.AggregatorSettings(rounds=1, round_timeout=NAN),
        "round_timeout.*nan",
    ),
    case(
        "AggregatorSettings round_timeout inf",
        lambda _: federated.AggregatorSettings(rounds=1, round_timeout=INF),
        "round_timeout.*inf",
    ),
    case(
        "AggregatorSettings round_attempts 0",
        lambda _: federated.AggregatorSettings(rounds=1, round_attempts=0),
        "round_attempts.*0",
    ),
    case(
        "AggregatorSettings keep_last 0",
        lambda _: federated.AggregatorSettings(rounds=1, keep_last=0),
        "keep_last",
    ),
    case(
        "AggregatorSettings checkpoint_dir an int",
        lambda _: federated.AggregatorSettings(rounds=1, checkpoint_dir=5),
        "checkpoint_dir.*int",
    ),
    case(
        "NodeSettings connect_timeout nan",
        lambda _: federated.NodeSettings(connect_timeout=NAN),
        "connect_timeout",
    ),
    case(
        "NodeSettings retry_interval 0", lambda _: federated.NodeSettings(retry_interval=0), "retry_interval"
    ),
    case(
        "NodeSettings idle_timeout '1'",
        lambda _: federated.NodeSettings(idle_timeout="1"),
        "idle_timeout.*'1'",
    ),
    case(
        "NodeSettings max_frame_bytes 0",
        lambda _: federated.NodeSettings(max_frame_bytes=0),
        "max_frame_bytes",
    ),
    # -- the aggregator, before it listens
    case("run_aggregator token ''", lambda _: _aggregate(token=""), "token"),
    case("run_aggregator token an int", lambda _: _aggregate(token=5), "token.*int"),
    case("run_aggregator port 70000", lambda _: _aggregate(port=70000), "port.*70000"),
    case("run_aggregator port '7611'", lambda _: _aggregate(port="7611"), "port.*'7611'"),
    case(
        "run_aggregator settings of a node",
        lambda _: _aggregate(settings=federated.NodeSettings()),
        "settings.*NodeSettings",
    ),
    case("run_aggregator plan a dict", lambda _: _aggregate(plan={"name": "p"}), "plan.*dict"),
    case("run_aggregator ssl_context an int", lambda _: _aggregate(ssl_context=5), "ssl_context"),
    case(
        "run_aggregator initial model of another shape",
        lambda _: _aggregate(initial_model={"0.weight": torch.zeros(3, 4), "0.bias": torch.zeros(2)}),
        r"'0.weight'.*\(2, 4\).*\(3, 4\)",
    ),
    case(
        "run_aggregator initial model lacking a tensor",
        lambda _: _aggregate(initial_model={"0.weight": torch.zeros(2, 4)}),
        "lacks.*0.bias",
    ),
    case(
        "run_aggregator initial model with an extra tensor",
        lambda _: _aggregate(initial_model={**federated.mlp(MLP).state_dict(), "extra": torch.zeros(1)}),
        "unexpected.*extra",
    ),
    case(
        "run_aggregator initial model in float64 for a float32 plan",
        lambda _: _aggregate(
            initial_model={k: v.double() for k, v in federated.mlp(MLP).state_dict().items()}
        ),
        "0.weight.*float32.*float64",
    ),
    case(
        "run_aggregator initial model another module",
        lambda _: _aggregate(initial_model=nn.Linear(4, 2)),
        "initial model does not fit",
    ),
    # -- FedAvg of garbage updates
    case(
        "federated_average sample count -1",
        lambda _: _fedavg(
            {"w": torch.ones(2)}, ("a", -1, {"w": torch.ones(2)}), ("b", 2, {"w": torch.ones(2)})
        ),
        "node 'a'.*-1",
        FederatedError,
    ),
    case(
        "federated_average sample count True",
        lambda _: _fedavg({"w": torch.ones(2)}, ("a", True, {"w": torch.ones(2)})),
        "node 'a'.*True",
        FederatedError,
    ),
    case(
        "federated_average sample count 1.5",
        lambda _: _fedavg({"w": torch.ones(2)}, ("a", 1.5, {"w": torch.ones(2)})),
        "node 'a'.*1.5",
        FederatedError,
    ),
    case(
        "federated_average no examples in all",
        lambda _: _fedavg({"w": torch.ones(2)}, ("a", 0, {"w": torch.ones(2)})),
        "0 examples",
        FederatedError,
    ),
    case(
        "federated_average an update of another dtype",
        lambda _: _fedavg({"w": torch.ones(2)}, ("a", 1, {"w": torch.ones(2, dtype=torch.float64)})),
        "node 'a'.*'w'.*float64",
        FederatedError,
    ),
    case(
        "federated_average an update lacking a tensor",
        lambda _: _fedavg({"w": torch.ones(2)}, ("a", 1, {})),
        "node 'a'.*lacks.*'w'",
        FederatedError,
    ),
    # -- the pipeline
    case("PipelineSpec boundaries '2'", lambda _: pipeline.PipelineSpec(boundaries="2"), "boundaries.*'2'"),
    case("PipelineSpec boundaries an int", lambda _: pipeline.PipelineSpec(boundaries=2), "boundaries"),
    case(
        "PipelineSpec boundaries (1.5,)",
        lambda _: pipeline.PipelineSpec(boundaries=(1.5,)),
        "boundaries.*1.5",
    ),
    case(
        "PipelineSpec boundaries (0,)", lambda _: pipeline.PipelineSpec(boundaries=(0,)), "boundaries.*>= 1"
    ),
    case(
        "PipelineSpec boundaries decreasing", lambda _: pipeline.PipelineSpec(boundaries=(3, 1)), "increase"
    ),
    case(
        "PipelineSpec n_microbatches 2.0",
        lambda _: pipeline.PipelineSpec(boundaries=(), n_microbatches=2.0),
        "2.0",
    ),
    case(
        "PipelineSpec schedule 'interleaved'",
        lambda _: pipeline.PipelineSpec(boundaries=(), schedule="interleaved"),
        "schedule.*'interleaved'",
    ),
    case(
        "split_sequential boundary at the end",
        lambda _: pipeline.split_sequential(_seq(), (3,)),
        "boundary 3",
    ),
    case(
        "split_sequential a ModuleList",
        lambda _: pipeline.split_sequential(nn.ModuleList([nn.Linear(4, 4)]), ()),
        "Sequential.*ModuleList",
    ),
    case("train_pipeline max_epochs -1", lambda _: _train_pipeline(max_epochs=-1), "max_epochs.*-1"),
    case("train_pipeline max_epochs '1'", lambda _: _train_pipeline(max_epochs="1"), "max_epochs.*'1'"),
    case(
        "train_pipeline validation_frequency 0",
        lambda _: _train_pipeline(validation_frequency=0),
        "validation_frequency",
    ),
    case(
        "train_pipeline smoothing nan",
        lambda _: _train_pipeline(validation_loss_exponential_smoothing_factor=NAN),
        "smoothing_factor.*nan",
    ),
    case(
        "train_pipeline learning_rate_schedule an int",
        lambda _: _train_pipeline(learning_rate_schedule=5),
        "learning_rate_schedule",
    ),
    case(
        "train_pipeline return_min_validation_loss_model an int",
        lambda _: _train_pipeline(return_min_validation_loss_model=5),
        "return_min_validation_loss_model",
    ),
    case("train_pipeline spec a tuple", lambda _: _train_pipeline(spec=((),)), "spec.*tuple"),
    case(
        "train_pipeline optimizer_factory an int",
        lambda _: _train_pipeline(optimizer_factory=5),
        "optimizer_factory",
    ),
    case(
        "train_pipeline a layer returning a tuple",
        lambda _: _train_pipeline(model=nn.Sequential(nn.Linear(4, 8), nn.LSTM(8, 2))),
        "stage 0.*tuple.*one tensor",
    ),
    case(
        "train_pipeline data wider than the first layer",
        lambda _: _train_pipeline(train_batches=lamploop.tensor_batches(torch.randn(16, 5), Y, batch_size=8)),
        r"stage 0.*\(8, 5\)",
    ),
    case(
        "train_pipeline float targets for cross-entropy",
        lambda _: _train_pipeline(train_batches=lamploop.tensor_batches(X, Y.float(), batch_size=8)),
        "epoch 0, batch 0.*target dtype",
        BatchError,
    ),
    case(
        "train_pipeline a model on the meta device",
        lambda _: _train_pipeline(model=nn.Sequential(nn.Linear(4, 2, device="meta"))),
        "CPU",
    ),
    case(
        "train_pipeline a model without parameters",
        lambda _: _train_pipeline(model=nn.Sequential(nn.ReLU())),
        "parameter",
    ),
    case(
        "train_pipeline plateau schedule without validation",
        lambda _: _train_pipeline(learning_rate_schedule=lamploop.reduce_lr_on_plateau()),
        "ReduceLrOnPlateau.*validation",
    ),
    case(
        "train_pipeline an epoch factor of nan",
        lambda _: _train_pipeline(learning_rate_schedule=lamploop.from_epoch_count(lambda e: NAN)),
        "nan.*epoch 0",
    ),
    case("train_pipeline loss returning None", lambda _: _train_pipeline(loss=lambda o, t: None), "NoneType"),
    case(
        "train_pipeline NaN features",
        lambda _: _train_pipeline(train_batches=lamploop.tensor_batches(_nan_rows(), Y, batch_size=8)),
        "epoch 0, batch 0.*nan",
        NonFiniteLossError,
    ),
    case(
        "train_pipeline an empty stream",
        lambda _: _train_pipeline(train_batches=lamploop.iterable_batches(lambda context: [])),
        "epoch 0.*empty",
        BatchError,
    ),
    case(
        "train_pipeline an item that is not a pair",
        lambda _: _train_pipeline(train_batches=lamploop.iterable_batches(lambda context: [X[:8]])),
        "epoch 0, batch 0.*pair",
        BatchError,
    ),
    # -- epoch schedules
    case("decrement every 2.5", lambda _: lamploop.decrement(2.5, 0.5), "every.*2.5"),
    case("decrement every True", lambda _: lamploop.decrement(True, 0.5), "every.*True"),
    case("decrement fraction '0.5'", lambda _: lamploop.decrement(1, "0.5"), "fraction.*'0.5'"),
    case("linear start '1'", lambda _: lamploop.linear("1", 0.0, 2), "start.*'1'"),
    case("step_after factor inf", lambda _: lamploop.step_after(1, INF), "factor.*inf"),
    case("cyclic period_length 1", lambda _: lamploop.cyclic(2.0, 1), "period_length.*1"),
    case("cyclic max_factor nan", lambda _: lamploop.cyclic(NAN, 4), "max_factor.*nan"),
    case(
        "reduce_lr_on_plateau reduce_factor 0",
        lambda _: lamploop.reduce_lr_on_plateau(reduce_factor=0.0),
        "reduce_factor",
    ),
    case(
        "reduce_lr_on_plateau start_factor nan",
        lambda _: lamploop.reduce_lr_on_plateau(start_factor=NAN),
        "start_factor",
    ),
    case("from_epoch_count of an int", lambda _: lamploop.from_epoch_count(5), "callable"),
    case(
        "fit epoch factor nan at epoch 1",
        lambda _: _fit(learning_rate_schedule=lamploop.from_epoch_count(lambda e: 1.0 if e == 0 else NAN)),
        "FromEpochCount.*nan.*epoch 1",
    ),
    case(
        "fit epoch factor inf",
        lambda _: _fit(learning_rate_schedule=lamploop.from_epoch_count(lambda e: INF)),
        "inf.*epoch 0",
    ),
    case(
        "fit epoch function returning None",
        lambda _: _fit(learning_rate_schedule=lamploop.from_epoch_count(lambda e: None)),
        r"\(0\) returned None",
    ),
    case(
        "fit epoch schedule giving a tensor nan",
        lambda _: _fit(learning_rate_schedule=_Returns((None, torch.tensor(NAN)))),
        "_Returns.*nan.*epoch 0",
    ),
    case(
        "fit epoch schedule returning a bare factor",
        lambda _: _fit(learning_rate_schedule=_Returns(0.5)),
        "_Returns.*epoch 0",
    ),
    case(
        "fit epoch schedule returning three values",
        lambda _: _fit(learning_rate_schedule=_Returns((None, 0.5, 1))),
        "_Returns.*epoch 0",
    ),
    case(
        "fit learning_rate_schedule an object",
        lambda _: _fit(learning_rate_schedule=object()),
        "learning_rate_schedule",
    ),
    # -- step schedules
    case(
        "warmup_cosine warmup_steps -1",
        lambda _: warmup_cosine(warmup_steps=-1, total_steps=10, steps_per_epoch=2),
        "warmup_steps.*-1",
    ),
    case(
        "warmup_cosine warmup past total",
        lambda _: warmup_cosine(warmup_steps=10, total_steps=5, steps_per_epoch=2),
        "warmup_steps <= total_steps",
    ),
    case(
        "warmup_cosine steps_per_epoch 0",
        lambda _: warmup_cosine(warmup_steps=1, total_steps=5, steps_per_epoch=0),
        "steps_per_epoch",
    ),
    case(
        "warmup_cosine final nan",
        lambda _: warmup_cosine(warmup_steps=1, total_steps=5, steps_per_epoch=2, final=NAN),
        "final.*nan",
    ),
    case(
        "warmup_linear final -0.1",
        lambda _: warmup_linear(warmup_steps=1, total_steps=5, steps_per_epoch=2, final=-0.1),
        "final.*-0.1",
    ),
    case(
        "warmup_linear total_steps 2.0",
        lambda _: warmup_linear(warmup_steps=0, total_steps=2.0, steps_per_epoch=2),
        "total_steps.*2.0",
    ),
    case("fit step factor True", lambda _: _fit(step_schedule=_Step(True)), "_Step.*True.*epoch 1, step 2"),
    case(
        "fit step factor a tensor", lambda _: _fit(step_schedule=_Step(torch.tensor(0.5))), "epoch 1, step 2"
    ),
    case("fit step factor -1e-9", lambda _: _fit(step_schedule=_Step(-1e-9)), "epoch 1, step 2"),
    case("fit step factor inf", lambda _: _fit(step_schedule=_Step(INF)), "inf.*epoch 1, step 2"),
    # -- precision, clipping, accumulation, non-finite policies, metrics
    case("fit precision 'fp8'", lambda _: _fit(precision="fp8"), "precision.*'fp8'"),
    case("fit precision 16", lambda _: _fit(precision=16), "precision.*16"),
    case("fit precision 32 as an int", lambda _: _fit(precision=32), "precision.*32"),
    case(
        "fit on_non_finite_loss 'ignore'",
        lambda _: _fit(on_non_finite_loss="ignore"),
        "on_non_finite_loss.*'ignore'",
    ),
    case("fit on_non_finite_loss None", lambda _: _fit(on_non_finite_loss=None), "on_non_finite_loss.*None"),
    case("fit max_gradient_norm 0", lambda _: _fit(max_gradient_norm=0), "max_gradient_norm.*0"),
    case("fit max_gradient_norm -1", lambda _: _fit(max_gradient_norm=-1.0), "max_gradient_norm.*-1"),
    case("fit max_gradient_norm nan", lambda _: _fit(max_gradient_norm=NAN), "max_gradient_norm.*nan"),
    case("fit max_gradient_norm '1'", lambda _: _fit(max_gradient_norm="1"), "max_gradient_norm.*'1'"),
    case(
        "fit accumulate 0",
        lambda _: _fit(accumulate_gradient_over_n_batches=0),
        "accumulate_gradient_over_n_batches.*0",
    ),
    case(
        "fit accumulate True",
        lambda _: _fit(accumulate_gradient_over_n_batches=True),
        "accumulate_gradient_over_n_batches.*True",
    ),
    case(
        "fit model_selection_mode 'maximum'",
        lambda _: _fit_valid(model_selection_mode="maximum"),
        "'maximum'",
    ),
    case(
        "fit early_stopping_patience 0",
        lambda _: _fit_valid(early_stopping_patience=0),
        "early_stopping_patience.*0",
    ),
    case(
        "fit early_stopping_patience 1.5",
        lambda _: _fit_valid(early_stopping_patience=1.5),
        "early_stopping_patience.*1.5",
    ),
    case(
        "fit early_stopping_patience without validation",
        lambda _: _fit(early_stopping_patience=2),
        "validation_batches",
    ),
    case(
        "fit model_selection_metric without validation",
        lambda _: _fit(
            model=lamploop.SupervisedModel(nn.Linear(4, 2), metrics={"accuracy": metrics.accuracy}),
            model_selection_metric="accuracy",
        ),
        "model_selection_metric.*validation_batches",
    ),
    case(
        "fit lr_scheduler_interval 'batch'",
        lambda _: _fit(
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1), lr_scheduler_interval="batch"
        ),
        "lr_scheduler_interval.*'batch'",
    ),
    case(
        "fit a metric returning a mean",
        lambda _: _fit(model=lamploop.SupervisedModel(nn.Linear(4, 2), metrics={"m": lambda o, t: 0.5})),
        "metric 'm'.*float.*\\(sum, count\\)",
    ),
    case(
        "fit a metric that divides by zero",
        lambda _: _fit(model=lamploop.SupervisedModel(nn.Linear(4, 2), metrics={"m": lambda o, t: 1 / 0})),
        "epoch 0, batch 0.*metric.*ZeroDivisionError",
        BatchError,
    ),
    case(
        "local fp16 with reduce_to_root",
        lambda _: _local_two_replicas(strategy="reduce_to_root", precision="fp16"),
        "fp16.*reduce_to_root",
    ),
    case(
        "fit skip_step with every step non-finite",
        lambda _: _fit(
            train_batches=lamploop.tensor_batches(_nan_rows(), Y, batch_size=4),
            on_non_finite_loss="skip_step",
        ),
        "all 4 steps of epoch 0",
        NonFiniteLossError,
    ),
    case(
        "fit skip_step with a NaN validation loss",
        lambda _: _fit(
            validation_batches=lamploop.tensor_batches(_nan_rows(), Y, batch_size=4),
            on_non_finite_loss="skip_step",
        ),
        "epoch 0.*validation.*nan",
        NonFiniteLossError,
    ),
    case("one_epoch precision 'fp8'", lambda _: _one_epoch(precision="fp8"), "precision.*'fp8'"),
    case("one_epoch on_non_finite_loss 'warn'", lambda _: _one_epoch(on_non_finite_loss="warn"), "'warn'"),
    case("one_epoch max_gradient_norm 0.0", lambda _: _one_epoch(max_gradient_norm=0.0), "max_gradient_norm"),
    case(
        "one_epoch max_gradient_norm nan",
        lambda _: _one_epoch(max_gradient_norm=NAN),
        "max_gradient_norm.*nan",
    ),
    case(
        "one_epoch accumulate -2",
        lambda _: _one_epoch(accumulate_gradient_over_n_batches=-2),
        "accumulate.*-2",
    ),
    case(
        "one_epoch accumulate 2.0",
        lambda _: _one_epoch(accumulate_gradient_over_n_batches=2.0),
        "accumulate.*2.0",
    ),
    case("one_epoch forward_only 'yes'", lambda _: _one_epoch(forward_only="yes"), "forward_only.*'yes'"),
    case("one_epoch epoch -1", lambda _: _one_epoch(epoch=-1), "epoch.*-1"),
    case("one_epoch step_optimizer an int", lambda _: _one_epoch(step_optimizer=5), "step_optimizer"),
    case("one_epoch before_step an int", lambda _: _one_epoch(before_step=5), "before_step"),
    case("one_epoch device 'tpu'", lambda _: _one_epoch(device="tpu"), "device.*'tpu'"),
    case(
        "one_epoch a NaN batch, raise",
        lambda _: _one_epoch(batches=_nan_pair_stream(), epoch=4),
        "epoch 4, step 1.*nan.*not taken",
        NonFiniteLossError,
    ),
]


async def _nan_pair_stream() -> Any:
    yield X[:8], Y[:8]
    yield _nan_rows(8), Y[8:]


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("call", "error", "pattern"), HOSTILE)
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
    assert isinstance(caught.value, LamploopError), type(caught.value)
    message = str(caught.value)
    assert re.search(pattern, message, re.IGNORECASE | re.DOTALL), message


# ----------------------------------------------------------------------------- a schedule's state


@pytest.mark.timeout(60)
def test_a_schedule_state_checkpoints_cannot_store_is_refused_before_any_step(tmp_path: Path) -> None:
    class SetState:
        def init(self) -> set[int]:
            return {1, 2}

        def learning_rate_factor(
            self, state: set[int], epoch: int, loss: float | None
        ) -> tuple[set[int], float]:
            return state, 1.0

    steps: list[int] = []

    def counting_sgd(params: Any) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(params, lr=0.1)
        step = optimizer.step
        optimizer.step = lambda *a, **k: (steps.append(1), step(*a, **k))[1]  # type: ignore[method-assign]
        return optimizer

    with pytest.raises((CheckpointError, ConfigurationError), match=r"schedule state.*set"):
        _fit(optimizer_factory=counting_sgd, checkpoint_dir=tmp_path / "c", learning_rate_schedule=SetState())
    assert steps == [], f"{len(steps)} optimizer steps were taken before the refusal"


@pytest.mark.timeout(60)
def test_a_negative_epoch_factor_ends_training_instead_of_failing() -> None:
    factors: list[int] = []

    def factor(epoch: int) -> float:
        factors.append(epoch)
        return 1.0 if epoch < 2 else -0.5

    state = _fit(max_epochs=5, learning_rate_schedule=lamploop.from_epoch_count(factor))
    assert state is not None
    assert state.epoch == 2
    assert [entry.epoch for entry in state.learning_curve] == [0, 1]
    assert factors == [0, 1, 2]  # asked before each epoch, and once more at the stop


# ----------------------------------------------------------------------------- schedules by formula


def _warmup(t: int, warmup: int) -> float | None:
    return (t + 1) / warmup if t < warmup else None


def _cosine_reference(t: int, warmup: int, total: int, final: float) -> float:
    up = _warmup(t, warmup)
    if up is not None:
        return up
    progress = min(t - warmup, total - warmup) / (total - warmup)
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _linear_reference(t: int, warmup: int, total: int, final: float) -> float:
    up = _warmup(t, warmup)
    if up is not None:
        return up
    progress = min(t - warmup, total - warmup) / (total - warmup)
    return final + (1.0 - final) * (1.0 - progress)


def _cyclic_reference(epoch: int, max_factor: float, period: int) -> float:
    p, h = epoch % period, period / 2
    return 1 + (max_factor - 1) * (1 - abs(p - h) / h)


@pytest.mark.parametrize(
    ("make", "reference"),
    [
        pytest.param(warmup_cosine, _cosine_reference, id="warmup_cosine"),
        pytest.param(warmup_linear, _linear_reference, id="warmup_linear"),
    ],
)
def test_a_step_schedule_with_a_final_factor_follows_its_formula_past_the_end(
    make: Any, reference: Any
) -> None:
    schedule = make(warmup_steps=3, total_steps=11, steps_per_epoch=5, final=0.2)
    got = [schedule.factor(e, s) for e in range(3) for s in range(5)]
    expected = [reference(t, 3, 11, 0.2) for t in range(15)]
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert got[-1] == pytest.approx(0.2, abs=1e-15)  # at final from total_steps on


@pytest.mark.timeout(60)
def test_every_step_rate_is_base_times_cyclic_epoch_factor_times_step_factor_with_accumulation() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    rates: list[float] = []

    def recorded_sgd(params: Any) -> torch.optim.Optimizer:
        optimizer = torch.optim.SGD(params, lr=0.1)
        step = optimizer.step
        optimizer.step = lambda *a, **k: (rates.append(optimizer.param_groups[0]["lr"]), step(*a, **k))[1]  # type: ignore[method-assign]
        return optimizer

    _fit(
        optimizer_factory=recorded_sgd,
        train_batches=lamploop.tensor_batches(x, y, batch_size=4),  # 8 batches: 4 optimizer steps
        accumulate_gradient_over_n_batches=2,
        max_epochs=3,
        learning_rate_schedule=lamploop.cyclic(3.0, 4),
        step_schedule=warmup_cosine(warmup_steps=3, total_steps=10, steps_per_epoch=4, final=0.1),
    )
    expected = [
        0.1 * _cyclic_reference(e, 3.0, 4) * _cosine_reference(e * 4 + s, 3, 10, 0.1)
        for e in range(3)
        for s in range(4)
    ]
    assert rates == pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------------------------- accumulation, clipping, skips


def _dataset64(rows: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, 4, generator=generator, dtype=torch.float64),
        torch.randint(0, 3, (rows,), generator=generator),
    )


def _module64() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _reference_steps(
    module: nn.Module,
    groups: list[list[tuple[torch.Tensor, torch.Tensor]]],
    lr: float,
    max_norm: float | None = None,
) -> float:
    """Plain SGD, one step per group on the group's union; returns the mean loss over every example."""
    loss_sum, examples = 0.0, 0
    for group in groups:
        features = torch.cat([b[0] for b in group])
        target = torch.cat([b[1] for b in group])
        module.zero_grad(set_to_none=True)
        loss = F.cross_entropy(module(features), target, reduction="sum")
        loss_sum += float(loss.detach())
        examples += len(target)
        (loss / len(target)).backward()
        grads = [p.grad for p in module.parameters()]
        if max_norm is not None:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            coefficient = min(1.0, max_norm / (float(norm) + 1e-6))
            grads = [g * coefficient for g in grads]
        with torch.no_grad():
            for parameter, grad in zip(module.parameters(), grads, strict=True):
                parameter -= lr * grad
    return loss_sum / examples


def _one_epoch_over(
    module: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], **options: Any
) -> Any:
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)

    async def stream() -> Any:
        for batch in batches:
            yield batch

    return _run(
        lambda: lamploop.one_epoch(
            model=lamploop.SupervisedModel(module), batches=stream(), step_optimizer=optimizer.step, **options
        )
    )


def _cut(x: torch.Tensor, y: torch.Tensor, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out, start = [], 0
    for size in sizes:
        out.append((x[start : start + size], y[start : start + size]))
        start += size
    return out


def _assert_same_parameters(actual: nn.Module, expected: nn.Module, tolerance: float = 1e-12) -> None:
    for (name, a), b in zip(actual.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=tolerance, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_norm", [None, 0.05], ids=["unclipped", "clipped"])
def test_accumulated_uneven_batches_step_as_one_batch_on_their_union(max_norm: float | None) -> None:
    x, y = _dataset64(20)
    batches = _cut(x, y, [5, 3, 4, 2, 6])  # k=3: steps over [5, 3, 4] and, at the epoch's end, [2, 6]
    module, reference = _module64(), _module64()
    options: dict[str, Any] = {"accumulate_gradient_over_n_batches": 3}
    if max_norm is not None:
        options["max_gradient_norm"] = max_norm
    loss = _one_epoch_over(module, batches, **options)
    expected_loss = _reference_steps(reference, [batches[:3], batches[3:]], lr=0.1, max_norm=max_norm)
    _assert_same_parameters(module, reference)
    assert float(loss) == pytest.approx(expected_loss, rel=1e-12)
    untouched = _module64()
    assert not torch.equal(next(module.parameters()), next(untouched.parameters()))


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore")
def test_a_skipped_accumulated_step_equals_a_run_that_never_saw_its_batches() -> None:
    x, y = _dataset64(12)
    x[7, 1] = NAN  # batch 3 of 6 batches of 2: step 1 (batches 2 and 3) with k=2
    batches = _cut(x, y, [2] * 6)
    module, reference = _module64(), _module64()
    loss = _one_epoch_over(
        module, batches, accumulate_gradient_over_n_batches=2, on_non_finite_loss="skip_step"
    )
    expected_loss = _reference_steps(reference, [batches[0:2], batches[4:6]], lr=0.1)
    _assert_same_parameters(module, reference)
    assert float(loss) == pytest.approx(expected_loss, rel=1e-12)  # the mean over the 8 kept examples
    with pytest.raises(NonFiniteLossError) as caught:
        _one_epoch_over(_module64(), batches, accumulate_gradient_over_n_batches=2, epoch=3)
    assert (caught.value.epoch, caught.value.step, caught.value.batch) == (3, 1, 3)


@pytest.mark.timeout(60)
def test_a_metric_is_its_sum_over_its_count_not_a_mean_of_batch_means() -> None:
    x, y = _dataset64(15)
    batches = _cut(x, y, [5, 3, 7])
    module = _module64()

    def hits_on_class_0(output: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        chosen = target == 0  # a count that differs from the batch size, batch by batch
        return (output.argmax(dim=1)[chosen] == 0).sum(), int(chosen.sum())

    model = lamploop.SupervisedModel(
        module, metrics={"accuracy": metrics.accuracy, "recall0": hits_on_class_0}
    )

    async def stream() -> Any:
        for batch in batches:
            yield batch

    result = _run(lambda: lamploop.one_epoch(model=model, batches=stream(), forward_only=True))
    with torch.no_grad():
        output = module(x)
    predicted = output.argmax(dim=1)
    assert isinstance(result, metrics.PassResult)
    assert float(result) == pytest.approx(float(F.cross_entropy(output, y)), rel=1e-12)
    assert result.metrics["accuracy"] == pytest.approx(float((predicted == y).double().mean()), abs=1e-15)
    assert result.metrics["recall0"] == pytest.approx(
        float((predicted[y == 0] == 0).sum()) / int((y == 0).sum()), abs=1e-15
    )


# ----------------------------------------------------------------------------- federated rounds


FED_MLP = {"sizes": [FEATURES, CLASSES], "seed": 0}


def _fed_plan(**changes: Any) -> federated.TrainingPlan:
    kwargs: dict[str, Any] = {
        "name": "hostile-r6-fedavg",
        "model": federated.describe_model("mlp", FED_MLP, federated.mlp(FED_MLP)),
        "optimizer": federated.OptimizerConfig("sgd", learning_rate=0.2),
        "local_epochs": 2,
    }
    kwargs.update(changes)
    return federated.TrainingPlan(**kwargs)


def _capturing_builders(name: str, built: dict[str, list[nn.Module]]) -> dict[str, Any]:
    """The node's own registry: the built-in mlp, keeping every module it builds (the one it trains)."""

    def build_mlp(options: Any) -> nn.Module:
        module = federated.mlp(options)
        built.setdefault(name, []).append(module)
        return module

    return {"mlp": build_mlp}


def _weighted_mean(states: list[tuple[int, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    total = sum(count for count, _ in states)
    names = states[0][1].keys()
    return {
        name: (sum(count * state[name].double() for count, state in states) / total).to(
            states[0][1][name].dtype
        )
        for name in names
    }


async def _federation(
    tmp: Path,
    plan: federated.TrainingPlan,
    nodes: dict[str, tuple[torch.Tensor, torch.Tensor]],
    built: dict[str, list[nn.Module]],
    settings: federated.AggregatorSettings,
    also: Callable[[int, anyio.abc.TaskGroup], Any] | None = None,
    initial_options: dict[str, Any] = FED_MLP,
) -> dict[str, Any]:
    federated.approve_plan(plan, tmp / "allow.json")
    results: dict[str, Any] = {}
    listening = anyio.Event()
    port: list[int] = []

    def on_listening(value: int) -> None:
        port.append(value)
        listening.set()

    async def aggregate() -> None:
        results["aggregator"] = await federated.run_aggregator(
            plan=plan,
            initial_model=federated.mlp(initial_options),
            token=TOKEN,
            settings=settings,
            on_listening=on_listening,
            on_round=lambda record: results.setdefault("round_done_at", time.monotonic()),
        )

    async def node(name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        try:
            results[name] = await federated.run_node(
                name=name,
                host="127.0.0.1",
                port=port[0],
                token=TOKEN,
                allow_list=tmp / "allow.json",
                train_batches=lamploop.tensor_batches(x, y, batch_size=5, shuffle=False),
                builders=_capturing_builders(name, built),
                settings=federated.NodeSettings(connect_timeout=10.0, retry_interval=0.05),
            )
        except Exception as error:
            results[name] = error

    with anyio.fail_after(BOUND_S):
        async with anyio.create_task_group() as group:
            group.start_soon(aggregate)
            await listening.wait()
            for name, (x, y) in nodes.items():
                group.start_soon(node, name, x, y)
            if also is not None:
                await also(port[0], group)
    return results


@pytest.mark.timeout(60)
def test_a_round_is_the_sample_weighted_float64_mean_of_the_nodes_trained_parameters(tmp_path: Path) -> None:
    x, y = data()
    x, plan = x.float(), _fed_plan()
    shards = {"node-a": (x[:25], y[:25]), "node-b": (x[25:35], y[25:35])}  # 25 and 10 rows, 2 local epochs
    built: dict[str, list[nn.Module]] = {}
    settings = federated.AggregatorSettings(rounds=1, min_nodes=2, join_timeout=20, round_timeout=20)
    results = anyio.run(_federation, tmp_path, plan, shards, built, settings)
    record = results["aggregator"].rounds[0]
    assert [r.node for r in record.answered] == ["node-a", "node-b"]
    assert record.missing == ()
    counts = {r.node: r.sample_count for r in record.answered}
    assert counts == {"node-a": 50, "node-b": 20}, "the examples trained on this round: rows x local epochs"
    initial = federated.mlp(FED_MLP).state_dict()
    trained = {name: built[name][-1].state_dict() for name in shards}
    for name, state in trained.items():
        assert not torch.equal(state["0.weight"], initial["0.weight"]), f"{name} did not train"
    expected = _weighted_mean([(counts[name], trained[name]) for name in shards])
    model = results["aggregator"].model
    assert sorted(model) == sorted(expected)
    for name, tensor in expected.items():
        assert model[name].dtype == torch.float32
        torch.testing.assert_close(model[name], tensor, rtol=1.2e-7, atol=1e-9)
    losses = {r.node: r.training_loss for r in record.answered}
    assert record.training_loss == pytest.approx(
        (50 * losses["node-a"] + 20 * losses["node-b"]) / 70, rel=1e-12
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("nan features", "non-finite loss.*nan"),
        ("features too wide", "shapes cannot be multiplied"),
        ("float targets", "target dtype"),
    ],
)
def test_a_node_whose_own_data_breaks_training_is_named_and_the_round_averages_the_others(
    tmp_path: Path, bad: str, why: str
) -> None:
    x, y = data()
    bad_x, bad_y = x[40:50].clone(), y[40:50].clone()
    if bad == "nan features":
        bad_x[2, 0] = NAN
    elif bad == "features too wide":
        bad_x = torch.randn(10, FEATURES + 1, dtype=torch.float64)
    else:
        bad_y = bad_y.double()
    options = {**FED_MLP, "dtype": "float64"}
    plan = _fed_plan(model=federated.describe_model("mlp", options, federated.mlp(options)))
    built: dict[str, list[nn.Module]] = {}
    settings = federated.AggregatorSettings(
        rounds=1, min_nodes=1, expected_nodes=2, join_timeout=20, round_timeout=20
    )

    nodes = {"good": (x[:20], y[:20]), "bad": (bad_x, bad_y)}
    started = time.monotonic()
    results = anyio.run(partial(_federation, tmp_path, plan, nodes, built, settings, initial_options=options))
    assert time.monotonic() - started < 15.0, "the bad node was waited for, not refused"
    record = results["aggregator"].rounds[0]
    assert [r.node for r in record.answered] == ["good"]
    assert [m.node for m in record.missing] == ["bad"]
    assert re.search(why, record.missing[0].why, re.IGNORECASE), record.missing[0].why
    assert isinstance(results["bad"], federated.NodeSummary), results["bad"]
    assert results["bad"].refused == (0,)
    assert results["bad"].trained == ()
    trained = built["good"][-1].state_dict()
    for name, tensor in trained.items():
        torch.testing.assert_close(results["aggregator"].model[name], tensor, rtol=0, atol=1e-15)


@pytest.mark.timeout(60)
def test_a_node_whose_honest_step_overflows_to_infinite_parameters_is_named_and_not_averaged(
    tmp_path: Path,
) -> None:
    x, y = data()
    x = x.float()
    huge = x[40:45] * 3e37  # one batch, a finite loss, and a step of lr 1e3 that overflows float32
    plan = _fed_plan(local_epochs=1, optimizer=federated.OptimizerConfig("sgd", learning_rate=1e3))
    built: dict[str, list[nn.Module]] = {}
    settings = federated.AggregatorSettings(
        rounds=1, min_nodes=1, expected_nodes=2, join_timeout=20, round_timeout=20
    )
    nodes = {"good": (x[:5], y[:5]), "overflow": (huge, y[40:45])}
    results = anyio.run(_federation, tmp_path, plan, nodes, built, settings)
    overflowed = built["overflow"][-1].state_dict()["0.weight"]
    assert not bool(torch.isfinite(overflowed).all()), "the test's premise: the node's parameters overflowed"
    record = results["aggregator"].rounds[0]
    assert [r.node for r in record.answered] == ["good"]
    assert [m.node for m in record.missing] == ["overflow"]
    assert re.search("non-finite", record.missing[0].why), record.missing[0].why
    for name, tensor in built["good"][-1].state_dict().items():
        torch.testing.assert_close(results["aggregator"].model[name], tensor, rtol=0, atol=0)


def _leaves(error: BaseException) -> list[BaseException]:
    inner = getattr(error, "exceptions", None)  # an exception group's
    if inner is not None:
        return [leaf for each in inner for leaf in _leaves(each)]
    return [error]


@pytest.mark.timeout(60)
def test_when_the_only_node_cannot_train_every_attempt_the_run_fails_naming_it_and_why(
    tmp_path: Path,
) -> None:
    x, y = data()
    x = x.float()
    broken = x[40:50].clone()
    broken[1, 1] = NAN
    settings = federated.AggregatorSettings(
        rounds=2, min_nodes=1, round_attempts=2, join_timeout=20, round_timeout=20
    )
    started = time.monotonic()
    with pytest.raises(BaseException) as caught:  # noqa: PT011 -- the group's leaf is checked below
        anyio.run(
            _federation, tmp_path, _fed_plan(local_epochs=1), {"broken": (broken, y[40:50])}, {}, settings
        )
    assert time.monotonic() - started < 15.0
    errors = [leaf for leaf in _leaves(caught.value) if isinstance(leaf, FederatedError)]
    assert errors, repr(caught.value)
    error = errors[0]
    assert type(error) is FederatedError, "the plan was approved: not a PlanNotApprovedError"
    message = str(error)
    assert re.search(r"round 0 \(attempt 2 of 2\).*min_nodes=1.*broken.*non-finite loss", message), message


def _node_process(
    tmp: Path, name: str, port: int, rows: tuple[int, int], marker: Path
) -> subprocess.Popen[str]:
    config = {
        "name": name,
        "port": port,
        "allow_list": str(tmp / "allow.json"),
        "rows": list(rows),
        "batch_size": 5,
        "spin_s": 0.5,
        "marker": str(marker),
    }
    return subprocess.Popen(
        [sys.executable, str(WORKER), "node", json.dumps(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "LAMPLOOP_FEDERATED_TOKEN": TOKEN},
        start_new_session=True,
    )


@pytest.mark.timeout(90)
def test_a_node_sigkilled_inside_local_training_is_dropped_at_once_and_the_others_are_averaged(
    tmp_path: Path,
) -> None:
    x, y = data()
    options = {**FED_MLP, "dtype": "float64"}
    plan = _fed_plan(model=federated.describe_model("mlp", options, federated.mlp(options)), local_epochs=1)
    built: dict[str, list[nn.Module]] = {}
    settings = federated.AggregatorSettings(
        rounds=1, min_nodes=2, expected_nodes=3, join_timeout=40, round_timeout=40
    )
    marker = tmp_path / "victim-is-training"
    killed: dict[str, Any] = {}

    async def victim(port: int, group: anyio.abc.TaskGroup) -> None:
        process = _node_process(tmp_path, "victim", port, (40, 60), marker)
        killed["process"] = process
        try:
            with anyio.fail_after(25):
                while not marker.exists() and process.poll() is None:  # noqa: ASYNC110 -- a file
                    await anyio.sleep(0.02)
            assert process.poll() is None, process.communicate(timeout=5)
            os.kill(process.pid, signal.SIGKILL)
            killed["at"] = time.monotonic()
        except BaseException:
            process.kill()
            raise

    nodes = {"node-a": (x[:20], y[:20]), "node-b": (x[20:35], y[20:35])}
    try:
        results = anyio.run(
            partial(_federation, tmp_path, plan, nodes, built, settings, also=victim, initial_options=options)
        )
    finally:
        process = killed.get("process")
        if process is not None:
            process.kill()
            process.communicate(timeout=10)
    assert process is not None
    assert process.returncode == -signal.SIGKILL
    dropped_after = results["round_done_at"] - killed["at"]
    assert dropped_after < 5.0, (
        f"the round waited {dropped_after:.1f} s for the dead node (round_timeout 40 s)"
    )
    record = results["aggregator"].rounds[0]
    assert [r.node for r in record.answered] == ["node-a", "node-b"]
    assert [m.node for m in record.missing] == ["victim"]
    assert record.missing[0].why
    counts = {r.node: r.sample_count for r in record.answered}
    assert counts == {"node-a": 20, "node-b": 15}
    expected = _weighted_mean([(counts[n], built[n][-1].state_dict()) for n in ("node-a", "node-b")])
    for name, tensor in expected.items():
        torch.testing.assert_close(results["aggregator"].model[name], tensor, rtol=0, atol=1e-14)


# ----------------------------------------------------------------------------- the pipeline


@pytest.mark.timeout(60)
def test_a_one_stage_pipeline_with_micro_batches_and_an_epoch_schedule_is_hand_written_sgd() -> None:
    layers = [["linear", FEATURES, 8], ["relu"], ["linear", 8, CLASSES]]
    model, reference = build(layers), build(layers)
    x, y = data(rows=32)
    schedule = lamploop.decrement(1, 0.5)
    with pipeline.open_pipeline_group(rank=0, world_size=1, host="127.0.0.1", port=free_port(), timeout=30):
        state = anyio.run(
            partial(
                pipeline.train_pipeline,
                model=model,
                spec=pipeline.PipelineSpec(boundaries=(), n_microbatches=4),
                optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.1),
                train_batches=lamploop.tensor_batches(x, y, batch_size=8, shuffle=False),
                max_epochs=3,
                learning_rate_schedule=schedule,
            )
        )
    losses = []
    for epoch in range(3):
        groups = [[(x[i : i + 8], y[i : i + 8])] for i in range(0, 32, 8)]
        losses.append(_reference_steps(reference, groups, lr=0.1 * 0.5**epoch))
    assert [entry.training_loss for entry in state.learning_curve] == pytest.approx(losses, rel=1e-12)
    _assert_same_parameters(model, reference)


def _stage_processes(configs: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any], str]]:
    port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "stage", json.dumps({**config, "rank": rank, "port": port})],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank, config in enumerate(configs)
    ]
    outcomes = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=60)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            outcomes.append((process.returncode, json.loads(lines[-1]) if lines else {}, err[-2000:]))
    finally:
        for process in processes:
            process.kill()
            process.communicate(timeout=10)
    return outcomes


STAGES = [["linear", FEATURES, 8], ["relu"], ["linear", 8, CLASSES]]


@pytest.mark.soak
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("configs", "pattern"),
    [
        pytest.param(
            [
                {
                    "layers": [["linear", FEATURES, 8], ["linear", 5, CLASSES]],
                    "boundaries": [1],
                    "n_microbatches": 2,
                }
            ]
            * 2,
            r"stage 1 .*\(4, 8\)",
            id="stages that do not fit together",
        ),
        pytest.param(
            [
                {"layers": STAGES, "boundaries": [2], "n_microbatches": 2},
                {"layers": STAGES, "boundaries": [2], "n_microbatches": 4},
            ],
            "disagree on the n_microbatches",
            id="ranks given other micro-batches",
        ),
        pytest.param(
            [
                {"layers": STAGES, "boundaries": [2], "n_microbatches": 2},
                {
                    "layers": [["linear", FEATURES, 9], ["relu"], ["linear", 9, CLASSES]],
                    "boundaries": [2],
                    "n_microbatches": 2,
                },
            ],
            "disagree on the number of parameters",
            id="ranks given other models",
        ),
    ],
)
def test_pipeline_ranks_that_cannot_work_together_both_refuse_before_training(
    configs: list[dict[str, Any]], pattern: str
) -> None:
    started = time.monotonic()
    outcomes = _stage_processes(configs)
    assert time.monotonic() - started < 50.0
    for rank, (code, result, err) in enumerate(outcomes):
        assert code == 1, (rank, code, result, err)
        assert result.get("ok") is False, (rank, result, err)
        assert "ConfigurationError" in result["classes"], (rank, result)
        assert re.search(pattern, result["message"]), (rank, result["message"])


@pytest.mark.soak
@pytest.mark.timeout(120)
def test_a_parameterless_stage_trains_or_is_refused_alike_on_both_ranks() -> None:
    config = {"layers": [["linear", FEATURES, CLASSES], ["relu"]], "boundaries": [1], "n_microbatches": 2}
    outcomes = _stage_processes([config, config])
    if all(code == 0 for code, _, _ in outcomes):
        assert outcomes[0][1]["losses"] == outcomes[1][1]["losses"]  # every rank returns the same state
        return
    for rank, (code, result, err) in enumerate(outcomes):
        assert code == 1, (rank, code, result, err)
        assert "ConfigurationError" in result.get("classes", []), (rank, result, err)
        assert re.search("stage 1", result["message"]), (rank, result["message"])
